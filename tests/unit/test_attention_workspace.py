"""FlashAttention-2's backward workspace on a GPU (launcher/memory/runtime.py
`flash_attention_backward_bytes`: the fp32 dq accumulator and, with grouped-query attention, K/V
gradients expanded to every head) exists only inside each layer's attention backward. The trace
holds a 0-byte row there (launcher/trace.py `_dispatch_mode`), and a GPU estimate gives it the
kernel's bytes (launcher/steptrace.py `with_workspace`), so it adds to the peak only when that
moment is the peak."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

from launcher import trace as tr  # noqa: E402
from launcher.backends.registry import knobs  # noqa: E402
from launcher.config import DDPConfig  # noqa: E402
from launcher.memory.estimate import FLASH_NOTE, estimate, trace_request  # noqa: E402
from launcher.memory.runtime import flash_attention_backward_bytes  # noqa: E402
from launcher.steptrace import OpClass, with_workspace  # noqa: E402
from launcher.types import Cluster, Strategy, Workload  # noqa: E402

B, S = 2, 64
CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=3, vocab_size=8192, max_position_embeddings=256, tie_word_embeddings=False)
GPU = Cluster("test", "cuda", 1, 1, 80 * 2**30, 2**40, {"fp32": 1.0, "bf16": 1.0, "fp16": 1.0}, 0.5,
              1.0, 1.0, 1.0, 1.0, 80, 0)
SINGLE = Strategy("single", "ddp")
WL = Workload(S, B, "bf16-true", "sgd", False, "sdpa", sgd_momentum=0.0)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    key = tr.TraceKey(json.dumps(CONFIG, sort_keys=True), 3, B, S, attn_implementation="sdpa",
                      **trace_request(SINGLE, WL))
    tr._MEMO.clear()
    return tr.trace_set(key, 3, cache_dir=tmp_path_factory.mktemp("traces"))


def test_one_row_per_layer_right_after_the_attention_gradients(traces):
    t = traces.depth2
    rows = np.nonzero(t.op_class == OpClass.WORKSPACE)[0]
    assert len(rows) == t.num_layers and (t.nbytes[rows] == 0).all()
    first, last = t.layer_bounds["backward"]
    for r in rows:
        e = t.alloc[r]
        assert first <= e < last
        grads = np.nonzero((t.alloc >= e - 3) & (t.alloc < e))[0]  # dq, dk, dv of that call
        assert len(grads) == 3 and (t.op_class[grads] == OpClass.FLOP).all()
        assert (t.free[grads] > t.free[r]).all()  # still alive when the workspace is freed


def test_it_adds_to_the_peak_only_at_an_attention_backward(traces):
    """Here the backward peaks at the LM head (8192-entry vocabulary), far above any layer's
    attention backward: the kernel's own workspace does not move it (adding it to the whole
    backward phase did). A workspace larger than that gap makes the attention backward the peak:
    the live bytes there plus the workspace."""
    t = traces.depth2
    curve = t.live_curve()
    peak = t.phase_max(curve, "backward")
    w = flash_attention_backward_bytes(B, S, 4, 2, 16)
    assert 0 < w < peak - curve[t.alloc[t.op_class == OpClass.WORKSPACE]].max()
    small = with_workspace(traces, w).depth2
    assert small.phase_max(small.live_curve(), "backward") == peak
    at = t.alloc[t.op_class == OpClass.WORKSPACE]
    big = int(peak - curve[at].min()) + 1
    grown = with_workspace(traces, big).depth2
    assert grown.phase_max(grown.live_curve(), "backward") == curve[at].max() + big
    cpu_curve = t.live_curve()  # CPU estimates read the 0-byte rows: nothing changes
    assert (cpu_curve == curve).all()


def test_a_gpu_estimate_gives_the_workspace_its_moment(traces):
    k = knobs(ddp=DDPConfig())
    w = flash_attention_backward_bytes(B, S, 4, 2, 16)
    without = estimate(traces, SINGLE, WL, GPU, k, 1, 0)
    with_ws = estimate(traces, SINGLE, WL, GPU, k, 1, w)
    assert with_ws.peak_allocated_bytes == without.peak_allocated_bytes  # the peak is at the LM head
    assert FLASH_NOTE in with_ws.notes
    # a trace without fused attention rows (attention run as separate ops) keeps the phase-level term
    plain = type(traces)(*(_without_workspace_rows(t) for t in (traces.depth1, traces.depth2)), traces.num_layers)
    assert estimate(plain, SINGLE, WL, GPU, k, 1, w).peak_allocated_bytes == without.peak_allocated_bytes + w


def _without_workspace_rows(t):
    import dataclasses

    keep = t.op_class != OpClass.WORKSPACE
    return dataclasses.replace(t, op_class=np.where(keep, t.op_class, OpClass.ELEMENTWISE).astype(np.int8))


def test_a_run_of_varying_lengths_gives_its_shorter_step_its_own_workspace(traces, tmp_path):
    """With a length profile the allocator also replays batches of varying length, sizes
    interpolated per storage between the step at the peak length and one at half of it: the
    shorter step's workspace rows take the workspace of its length, so the two steps still hold
    the same storages (no mismatch note) and the replay runs."""
    import dataclasses

    from launcher.lengths import VarlenRun
    from launcher.memory.estimate import VARLEN_MISMATCH_NOTE

    short_wl = dataclasses.replace(WL, seq_len=S // 2)
    key = tr.TraceKey(json.dumps(CONFIG, sort_keys=True), 3, B, S // 2, attn_implementation="sdpa",
                      **trace_request(SINGLE, short_wl))
    short = tr.trace_set(key, 3, cache_dir=tmp_path)
    run = VarlenRun(short, short_wl, (S // 2, S, S // 2, S), "test",
                    flash_attention_backward_bytes(B, S // 2, 4, 2, 16))
    est = estimate(traces, SINGLE, WL, GPU, knobs(ddp=DDPConfig()), 1,
                   flash_attention_backward_bytes(B, S, 4, 2, 16), varlen=run)
    mismatch = VARLEN_MISMATCH_NOTE.split("{short}")[1]  # " tokens allocates other storages..."
    assert FLASH_NOTE in est.notes and not any(mismatch in n for n in est.notes)
    assert any(n.startswith("variable-length batches") and "4 micro-batches" in n for n in est.notes)

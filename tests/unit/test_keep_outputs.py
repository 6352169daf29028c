"""A loop that keeps each step's model outputs (training.keep_outputs; `outputs = model(**batch)`
in transformers' *_no_trainer.py examples): the previous step's outputs are alive through the
next forward, and this step's outlive its backward and optimizer step (launcher/trace.py
`_previous_outputs`); with transformers 4's cache of keys and values in training
(training.use_cache, `_transformers4_cache`), the outputs hold it too."""
from __future__ import annotations

import collections
import dataclasses

import pytest

transformers = pytest.importorskip("transformers")

from launcher import trace as tr  # noqa: E402
from launcher.memory.allocator import replay  # noqa: E402
from launcher.memory.estimate import trace_request  # noqa: E402
from launcher.memory.replay import allocation_events, full_depth_items  # noqa: E402
from launcher.steptrace import TraceSet  # noqa: E402
from launcher.types import Strategy, Workload  # noqa: E402

from tests.unit.test_full_depth_replay import _layouts  # noqa: E402

B, S, H, V = 2, 16, 64, 320  # micro-batch, tokens, hidden size, vocabulary
GPT2 = transformers.GPT2Config(n_embd=H, n_head=4, vocab_size=V, n_positions=64, n_layer=2)


def _key(depth: int, keep: bool, cache: bool = True, **more) -> tr.TraceKey:
    return tr.TraceKey(tr.canonical_config_json(GPT2), depth, B, S, attn_implementation="eager",
                       loss="shift_copy", optimizer="adamw_foreach", keep_outputs=keep, use_cache=cache, **more)


def test_the_previous_step_s_logits_and_each_layer_s_qkv_projection_are_alive_through_the_forward():
    """transformers 4's GPT-2 returns each layer's keys and values as views of its fused qkv
    projection (b x s x 3h), which autograd does not save (the attention matmuls save copies), so
    the kept outputs are the logits (b x s x V) and one projection per layer, fp32 here."""
    t = tr.trace_step(_key(3, True))
    fwd0, fwd1 = t.phases["forward"]
    before = (t.alloc < fwd0) & (t.alloc >= t.phases["previous"][0]) & (t.free >= fwd0)
    assert sorted(t.nbytes[before].tolist()) == sorted([B * S * 3 * H * 4] * 3 + [B * S * V * 4])
    assert sorted(t.buffer_layer[before].tolist()) == [-1, 0, 1, 2]  # each projection's layer
    assert (t.free[before] <= t.phases["backward"][0]).all()  # dropped as this step's forward returns
    assert (t.free[before] >= fwd1 - 8).all()
    # this step's logits and projections live until the step ends, past the optimizer step
    ends = t.phases["zero_grad"]
    kept = (t.alloc >= fwd0) & (t.alloc < fwd1) & (t.free >= ends[0]) & (t.free < ends[1])
    assert collections.Counter(t.nbytes[kept].tolist()) == {B * S * 3 * H * 4: 3, B * S * V * 4: 1}


def test_the_forward_peak_grows_by_what_the_outputs_hold():
    """The forward peaks at the loss (the logits, their shifted copy and the cross-entropy's
    temporaries), where this step's logits are alive either way. A loop that keeps its outputs adds
    the previous step's logits; the cache adds this step's qkv projections (which a step without
    it frees inside each layer), and, kept, the previous step's too."""
    def forward_peak(keep: bool, cache: bool) -> int:
        t = tr.trace_step(_key(3, keep, cache))
        return t.phase_max(t.live_curve(), "forward")
    logits, projections = B * S * V * 4, 3 * B * S * 3 * H * 4
    base = forward_peak(False, False)
    assert forward_peak(True, False) - base == logits
    assert forward_peak(False, True) - base == projections
    assert forward_peak(True, True) - base == logits + 2 * projections
    assert len({tr.cache_key(_key(3, keep, cache)) for keep in (False, True) for cache in (False, True)}) == 4


def test_kept_outputs_rebuilt_at_depth_replay_like_the_step_traced_there():
    """The previous step's projections are made outside the step's layers: the rebuild at the real
    depth repeats the middle layer's (`StepTrace.buffer_layer`), as it repeats its activations."""
    strategy, depth = Strategy("single", "ddp"), 6
    wl = Workload(S, B, "32-true", "sgd", False, "eager", sgd_momentum=0.0, keep_outputs=True)  # peaks in forward
    t = {d: tr.trace_step(dataclasses.replace(_key(d, True), **trace_request(strategy, wl))) for d in (2, 3, depth - 1, depth)}
    assert max(("forward", "backward", "optimizer"), key=lambda ph: t[depth].phase_max(t[depth].live_curve(), ph)) == "forward"
    shallow, deep = _layouts(t, 2, 3, strategy, wl)
    real = _layouts(t, depth - 1, depth, strategy, wl)[1]
    items, num_events = full_depth_items(shallow, deep, depth)
    rebuilt, traced = replay(allocation_events(deep, 80, items, num_events)), replay(allocation_events(real, 80))
    assert (rebuilt.peak_allocated, rebuilt.peak_reserved) == (traced.peak_allocated, traced.peak_reserved)
    # and the linear extrapolation of the phase peaks agrees with the traced depth
    extrapolated = TraceSet(t[2], t[3], depth).phase_max("forward")
    assert extrapolated == t[depth].phase_max(t[depth].live_curve(), "forward")


def test_a_real_loop_that_keeps_its_outputs_peaks_as_traced():
    """Two real steps on the CPU of the loop the trace models (`outputs = model(input_ids=ids,
    labels=ids)`, backward, AdamW, zero_grad), with transformers 4's cache: the second step, which
    starts with the first one's outputs and optimizer states alive, peaks at the traced step's
    live bytes plus those states (which the traced step makes in its optimizer phase)."""
    import torch

    from launcher.steptrace import Kind, event_curve
    from launcher.worker.storage_tracker import StorageTracker

    key = dataclasses.replace(_key(3, True), loss="model")
    t = tr.trace_step(key)
    alloc = t.alloc.copy()
    alloc[t.kind == Kind.OPTIM] = 0  # alive from the start of a later step
    steady = event_curve(alloc, t.free, t.nbytes, t.num_events)
    traced = int(steady[t.phases["forward"][0]:].max())

    cfg = tr.build_config(key)
    torch.manual_seed(0)
    with tr._transformers4_cache(), StorageTracker() as tracker:
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        for step in range(2):
            if step == 1:
                tracker.reset_peak()
            ids = torch.randint(0, V, (B, S))
            outputs = model(input_ids=ids, labels=ids)
            outputs.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        real = tracker.peak_bytes
    del outputs
    assert real == traced  # the same loop dropping its outputs peaks 3% lower

"""Memory models on real traces of a tiny transformers model (launcher.trace)."""
import json

import pytest

from launcher.config import DDPConfig, DeepSpeedConfig
from launcher.backends.registry import knobs as registry_knobs
from launcher.memory.estimate import estimate, layout_set, trace_request
from launcher.memory.common import model_state_bytes
from launcher.types import Cluster, Strategy, Workload

trace = pytest.importorskip("launcher.trace")

CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=4, num_hidden_layers=3, vocab_size=512,
              max_position_embeddings=128, tie_word_embeddings=False)
CPU = Cluster("cpu", "cpu", 2, 1, 2**34, 2**34, {}, 0.5, 1, 1, 1, 1, 0, 0)
TINY_BUCKETS = DeepSpeedConfig(reduce_bucket_size=2000, allgather_bucket_size=2000,
                               stage3_prefetch_bucket_size=2000, stage3_param_persistence_threshold=0)


def _traces(strategy, workload, tmp_path):
    key = trace.TraceKey(hf_config_json=json.dumps(CONFIG, sort_keys=True), num_layers=3,
                         micro_batch_size=2, seq_len=32, attn_implementation="sdpa",
                         **trace_request(strategy, workload))
    return trace.trace_set(key, 3, cache_dir=tmp_path)


def test_ddp_estimate_is_at_least_the_single_process_traced_peak(tmp_path):
    wl = Workload(32, 2, "32-true", "adamw_torch", False, "sdpa")
    ddp = Strategy("ddp", "ddp")
    traces = _traces(ddp, wl, tmp_path)
    single = traces.at_depth(lambda t: int(t.live_curve().max()))
    est = estimate(traces, ddp, wl, CPU, registry_knobs(deepspeed=TINY_BUCKETS, ddp=DDPConfig()), 2)
    assert est.peak_allocated_bytes >= single
    num_params = traces.at_depth(lambda t: int(t.params.numel.sum()))
    assert est.peak_allocated_bytes <= single + 4 * num_params  # at most one bucket copy more


def test_zero_stages_order_model_state_bytes(tmp_path):
    wl = Workload(32, 2, "bf16-mixed", "adamw_torch", False, "sdpa")
    got = {}
    for stage in (0, 1, 2, 3):
        s = Strategy(f"zero{stage}", "deepspeed", stage)
        traces = _traces(s, wl, tmp_path)
        layouts = layout_set(traces, s, wl, {"deepspeed": TINY_BUCKETS, "ddp": DDPConfig()}, 2, "cpu").groups[0][1]
        got[stage] = model_state_bytes(layouts[1])
        assert estimate(traces, s, wl, CPU, registry_knobs(deepspeed=TINY_BUCKETS, ddp=DDPConfig()), 2).peak_allocated_bytes > 0
    assert got[3] < got[2] < got[1] <= got[0]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lowlevel_zero2_reduction_holds_the_bucket_gradients_with_its_flat_and_received_copies(tmp_path, precision):
    """ColossalAI ZeRO-2 (one bucket: reduce_bucket_size above the model): while the post-backward
    reduction runs, the bucket's gradients (still referenced by `_grad_in_bucket`), their flat copy
    and `received_grad` (1/dp) are all alive; afterwards only `received_grad`. With gradient
    checkpointing that moment can be the step's peak (launcher/backends/colossalai/layout.py
    `lowlevel_zero_layout`)."""
    from launcher.backends.registry import knobs
    from launcher.memory.common import category_curves

    wl = Workload(32, 2, precision, "adamw_torch", True, "sdpa")
    s = Strategy("cai_zero2", "colossalai", 2)
    traces = _traces(s, wl, tmp_path)
    lay = layout_set(traces, s, wl, knobs(), 2, "cpu").groups[0][1][1]
    e = 4 if precision == "32-true" else 2
    numel = int(traces.depth2.params.numel.sum())  # every numel even: no padding at dp 2
    grads = category_curves(lay)["gradients"]
    assert grads[lay.reduce_ev(0)] == e * numel + e * numel + e * numel // 2
    assert grads[lay.reduce_ev(1)] == e * numel // 2

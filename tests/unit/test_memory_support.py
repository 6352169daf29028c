"""Which DeepSpeed (strategy, precision) pairs run with the worker's torch AdamW: one rule
(launcher/backends/deepspeed/emit.py `unsupported_reason`) shared by the planner, the memory model and the
worker, and an estimate for every supported pair.

The rule was checked by 2-rank gloo CPU runs of a tiny Llama with `torch.optim.AdamW` (DeepSpeed
0.19.8): bf16-true trains at ZeRO-0 (no wrapper, bf16 AdamW states) and ZeRO 1-3 (bf16 master
weights and states); ZeRO-2/3 optimizer offload with bf16 master weights asserts it needs
DeepSpeedCPUAdam; any fp16 fails on this CPU ("Type fp16 is not supported on your device").
"""
import itertools
from types import SimpleNamespace

import pytest

from launcher.config import DeepSpeedConfig
from launcher.backends.deepspeed.emit import unsupported_reason
from launcher.errors import ConfigError
from launcher.backends.base import Ask
from launcher.backends.registry import backend_of
from launcher.backends.registry import knobs as registry_knobs
from launcher.memory.estimate import estimate, trace_request
from launcher.planner import STRATEGIES
from launcher.steptrace import TraceSet
from launcher.types import Cluster, Workload
from launcher.backends.deepspeed.worker import deepspeed_config as worker_ds_config

from test_memory_models import synthetic_trace

GPU = Cluster("a100", "cuda", 2, 1, 80 * 2**30, 2**38, {}, 0.5, 1, 1, 1, 1, 80, 768 * 2**20)
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
DEEPSPEED = [s for s in STRATEGIES.values() if s.backend == "deepspeed"]
UNSUPPORTED = {(s.name, "16-true") for s in DEEPSPEED} | {("zero2_offload", "bf16-true"),
                                                          ("zero3_offload", "bf16-true")}
CASES = list(itertools.product(DEEPSPEED, PRECISIONS))


def _id(case):
    return f"{case[0].name}-{case[1]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_one_rule_for_planner_memory_and_worker(case):
    strategy, precision = case
    reason = unsupported_reason(strategy, precision, "cuda")
    assert bool(reason) == ((strategy.name, precision) in UNSUPPORTED)
    ask = Ask(precision, "adamw_torch", device="cuda")  # what the planner and the worker check
    assert bool(backend_of(strategy).rules(strategy).problem(strategy.name, ask)) == bool(reason)
    if reason:
        assert precision in reason
        with pytest.raises(ConfigError):
            trace_request(strategy, Workload(8, 1, precision, "adamw_torch", False, "sdpa"))


@pytest.mark.parametrize("case", [c for c in CASES if (c[0].name, c[1]) not in UNSUPPORTED], ids=_id)
def test_every_supported_pair_is_estimated(case):
    strategy, precision = case
    wl = Workload(8, 1, precision, "adamw_torch", False, "sdpa")
    esize = {"float32": 4, "bfloat16": 2, "float16": 2}[trace_request(strategy, wl)["param_dtype"]]
    traces = TraceSet(synthetic_trace(1, esize, optimizer=False), synthetic_trace(2, esize, optimizer=False), 4)
    est = estimate(traces, strategy, wl, GPU, registry_knobs(), 2)
    assert est.peak_allocated_bytes > 0 and est.device_total_bytes >= est.peak_reserved_bytes


def test_bf16_true_zero0_has_no_master_weights():
    """ZeRO-0 bf16-true: the client AdamW steps the bf16 parameters (2 B states, no fp32 master);
    bf16-mixed wraps it in FP16_Optimizer with 4 B master weights and states."""
    z0 = STRATEGIES["zero0"]
    traces = TraceSet(synthetic_trace(1, 2, optimizer=False), synthetic_trace(2, 2, optimizer=False), 4)
    num_params = round(traces.at_depth(lambda t: int(t.params.numel.sum())))
    states = {}
    for precision in ("bf16-true", "bf16-mixed"):
        wl = Workload(8, 1, precision, "adamw_torch", False, "sdpa")
        est = estimate(traces, z0, wl, GPU, registry_knobs(), 2)
        states[precision] = est.breakdown["optimizer_states"]
    assert states["bf16-true"] <= 2 * 2 * num_params + 4 * num_params  # exp_avg, exp_avg_sq + temps
    assert states["bf16-mixed"] >= (4 + 2 * 4) * num_params  # fp32 master + fp32 states


def _worker_spec(strategy, precision, framework_config, device="cuda"):
    return SimpleNamespace(framework_config=framework_config, micro_batch_size=1, grad_accum_steps=1,
                           precision=precision, max_grad_norm=1.0, strategy=strategy.name, device=device)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_worker_accepts_what_the_emitter_writes(case):
    from launcher.config import Precision, TrainingConfig
    from launcher.backends.deepspeed.emit import deepspeed_config

    strategy, precision = case
    training = TrainingConfig(precision=Precision[precision])
    if (strategy.name, precision) in UNSUPPORTED:
        with pytest.raises(ConfigError):
            deepspeed_config(strategy, training, DeepSpeedConfig(), 1, 1, 2)
        with pytest.raises(ConfigError, match=precision):
            worker_ds_config(_worker_spec(strategy, precision, {"zero_optimization": {"stage": strategy.zero_stage}}), 2)
        return
    emitted = deepspeed_config(strategy, training, DeepSpeedConfig(), 1, 1, 2)
    assert worker_ds_config(_worker_spec(strategy, precision, emitted), 2)["zero_optimization"]


def test_fp16_is_refused_on_cpu_processes():
    z2 = STRATEGIES["zero2"]
    assert "16-mixed" in unsupported_reason(z2, "16-mixed", "cpu")
    assert unsupported_reason(z2, "16-mixed", "cuda") is None
    assert unsupported_reason(z2, "bf16-mixed", "cpu") is None


def test_flash_attention_backward_workspace_by_hand():
    """Mistral-7B shapes, micro-batch 4 x 4096 tokens, 32 heads of 128, 8 KV heads, bf16:
    dq_accum 4*4096*32*128*4 B, softmax_d 4*32*4096*4 B, expanded dK and dV 2*4*4096*32*128*2 B."""
    from launcher.memory.runtime import flash_attention_backward_bytes

    assert flash_attention_backward_bytes(4, 4096, 32, 8, 128) == 268_435_456 + 2_097_152 + 268_435_456
    # no grouped-query attention: no expanded K/V; sequence rounded up to 128, head dim to 32
    assert flash_attention_backward_bytes(1, 100, 2, 2, 80) == 1 * 128 * 2 * 96 * 4 + 1 * 2 * 128 * 4

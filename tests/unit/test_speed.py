"""Speed model: closed-form cases derived from the formulas' sources, and monotonic properties."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.config import DeepSpeedConfig
from launcher.errors import ConfigError
from launcher.speed import HOST_ADAM_PARAMS_PER_S, estimate_speed
from launcher.types import Cluster, Strategy, Workload

DDP = Strategy("ddp", "ddp")
ZERO = {stage: Strategy(f"zero{stage}", "deepspeed", zero_stage=stage) for stage in range(4)}
ZERO2_OFFLOAD = Strategy("zero2_offload", "deepspeed", zero_stage=2, offload_optimizer=True)
ZERO3_OFFLOAD = Strategy("zero3_offload", "deepspeed", zero_stage=3, offload_optimizer=True,
                         offload_params=True)


def cluster(num_gpus=1, num_nodes=1, intra=100.0, inter=25.0, host=25.0) -> Cluster:
    return Cluster(
        hardware="test", device="cuda", num_gpus=num_gpus, num_nodes=num_nodes,
        memory_bytes=80 * 2**30, host_memory_bytes=512 * 2**30,
        peak_tflops={"fp32": 20.0, "tf32": 150.0, "bf16": 300.0, "fp16": 300.0},
        matmul_efficiency=0.5, memory_bandwidth_gbps=2000.0, intra_node_bandwidth_gbps=intra,
        inter_node_bandwidth_gbps=inter, host_link_bandwidth_gbps=host, sm_arch=80,
        cuda_context_bytes=2**29)


def workload(precision="32-true", micro=2, seq_len=512) -> Workload:
    return Workload(seq_len=seq_len, micro_batch_size=micro, precision=precision,
                    optimizer="adamw_torch", gradient_checkpointing=False, attn_implementation="sdpa")


def run(strategy, clu, *, flops=(1e12, 2e12), precision="32-true", num_params=250_000_000,
        accum=1, dp=None, ds=None, ddp=None, trainable=None):
    return estimate_speed({"forward": flops[0], "backward": flops[1]}, strategy, workload(precision),
                          clu, num_params=num_params, grad_accum_steps=accum,
                          dp_size=clu.num_gpus if dp is None else dp,
                          knobs={"deepspeed": ds, "ddp": ddp}, num_trainable_params=trainable)


def test_single_gpu_is_pure_compute():
    est = run(DDP, cluster(), accum=3)
    expected_compute_s = 3 * (1e12 + 2e12) / (20.0e12 * 0.5)  # fp32 peak, 32-true
    assert est.compute_s == pytest.approx(expected_compute_s)
    assert est.breakdown["comm_s"] == 0 and est.comm_s == 0 and est.breakdown["offload_s"] == 0
    assert est.step_s == pytest.approx(expected_compute_s)
    assert est.tokens_per_s == pytest.approx(2 * 3 * 512 / expected_compute_s)


def test_attention_kernel_flops_at_the_measured_attention_rate():
    """The fused-attention part of each phase runs at attention_tflops[dtype] (no efficiency
    factor: a measured sustained rate); without one, at peak x efficiency like the matmuls."""
    flops = {"forward": 1e12, "backward": 2e12, "attention_forward": 0.2e12, "attention_backward": 0.5e12}
    ws = workload()
    plain = estimate_speed(flops, DDP, ws, cluster(), num_params=1000, grad_accum_steps=1, dp_size=1)
    assert plain.compute_s == pytest.approx(3e12 / (20.0e12 * 0.5))
    slow = dataclasses.replace(cluster(), attention_tflops={"fp32": 1.0, "bf16": 50.0})
    got = estimate_speed(flops, DDP, ws, slow, num_params=1000, grad_accum_steps=2, dp_size=1)
    assert got.compute_s == pytest.approx(2 * ((3e12 - 0.7e12) / (20.0e12 * 0.5) + 0.7e12 / 1.0e12))


def test_precision_selects_peak_dtype():
    bf16 = run(DDP, cluster(), precision="bf16-mixed")
    assert bf16.compute_s == pytest.approx(3e12 / (300e12 * 0.5))
    clu = dataclasses.replace(cluster(), peak_tflops={"bf16": 300.0})
    with pytest.raises(ConfigError, match="peak_tflops.fp32"):
        run(DDP, clu)


def test_ddp_all_reduce_volume_and_overlap():
    # 2.5e8 fp32 gradients = 1e9 bytes; ring all-reduce moves 2(n-1)/n x bytes at bus bandwidth.
    clu = cluster(num_gpus=2, intra=100.0)
    raw_s = 2 * (2 - 1) / 2 * 1e9 / 100e9
    est = run(DDP, clu, flops=(1e12, 2e12))  # backward 0.2 s >> 0.01 s of communication
    assert est.breakdown["comm_s"] == pytest.approx(raw_s)
    last_bucket_s = 2 * (2 - 1) / 2 * 25 * 2**20 / 100e9  # the last 25 MiB bucket cannot overlap
    assert est.comm_s == pytest.approx(last_bucket_s)
    short_backward = run(DDP, clu, flops=(1e12, 1e6))
    assert short_backward.comm_s == pytest.approx(raw_s - 1e6 / 10e12)


def test_zero0_all_reduce_is_exposed_after_backward():
    est = run(ZERO[0], cluster(num_gpus=2), flops=(1e12, 2e12))
    assert est.comm_s == pytest.approx(0.01)  # same volume as DDP, no overlap


def test_deepspeed_mixed_communicates_16bit_ddp_fp32():
    clu = cluster(num_gpus=4)
    ddp = run(DDP, clu, precision="bf16-mixed").breakdown["comm_s"]
    zero0 = run(ZERO[0], clu, precision="bf16-mixed").breakdown["comm_s"]
    assert zero0 == pytest.approx(ddp / 2)


def test_zero12_volume_equals_all_reduce_and_zero3_is_1_5x():
    clu = cluster(num_gpus=8)
    all_reduce_s = run(ZERO[0], clu).breakdown["comm_s"]
    for stage in (1, 2):
        assert run(ZERO[stage], clu).breakdown["comm_s"] == pytest.approx(all_reduce_s)
    assert run(ZERO[3], clu).breakdown["comm_s"] == pytest.approx(1.5 * run(ZERO[2], clu).breakdown["comm_s"])


def test_accumulation_repeats_only_per_micro_batch_collectives():
    clu = cluster(num_gpus=4)
    half_s = run(ZERO[1], clu).breakdown["comm_s"] / 2  # reduce-scatter = all-gather = half
    assert run(ZERO[1], clu, accum=4).breakdown["comm_s"] == pytest.approx(2 * half_s)
    assert run(ZERO[2], clu, accum=4).breakdown["comm_s"] == pytest.approx(5 * half_s)
    assert run(DDP, clu, accum=4).breakdown["comm_s"] == pytest.approx(run(DDP, clu).breakdown["comm_s"])
    assert run(ZERO[3], clu, accum=4).breakdown["comm_s"] == pytest.approx(4 * 3 * half_s)


def test_overlap_comm_hides_zero2_reduction():
    clu = cluster(num_gpus=4)
    plain = run(ZERO[2], clu)
    overlapped = run(ZERO[2], clu, ds=DeepSpeedConfig(overlap_comm=True, reduce_bucket_size=10**6))
    assert plain.breakdown["comm_s"] == pytest.approx(overlapped.breakdown["comm_s"])
    assert overlapped.comm_s < plain.comm_s == pytest.approx(plain.breakdown["comm_s"])


def test_multi_node_slower_than_single_node():
    one = run(DDP, cluster(num_gpus=16, num_nodes=1, intra=200.0, inter=25.0), flops=(1e9, 1e9))
    two = run(DDP, cluster(num_gpus=16, num_nodes=2, intra=200.0, inter=25.0), flops=(1e9, 1e9))
    assert two.breakdown["comm_s"] == pytest.approx(8 * one.breakdown["comm_s"])
    assert two.step_s > one.step_s


def test_offload_adds_host_transfer_and_host_step():
    clu = cluster(num_gpus=1, host=25.0)
    base = run(ZERO[2], clu, precision="bf16-mixed")
    off = run(ZERO2_OFFLOAD, clu, precision="bf16-mixed")
    # ZeRO-Offload sec. 4.1: 2 bytes/param of fp16 gradients out, 2 bytes/param of params back.
    n = 250_000_000
    assert off.breakdown["offload_s"] == pytest.approx(4 * n / 25e9 + n / HOST_ADAM_PARAMS_PER_S)
    assert off.step_s == pytest.approx(base.step_s + off.breakdown["offload_s"])
    z3 = run(ZERO[3], clu, precision="bf16-mixed")
    z3_off = run(ZERO3_OFFLOAD, clu, precision="bf16-mixed")
    assert z3_off.step_s > z3.step_s


def test_peft_communicates_only_trainable_gradients():
    clu = cluster(num_gpus=2)
    full = run(ZERO[2], clu).breakdown["comm_s"]
    lora = run(ZERO[2], clu, trainable=2_500_000).breakdown["comm_s"]
    assert lora == pytest.approx(full / 100)


@settings(max_examples=60, deadline=None)
@given(
    stage=st.sampled_from([DDP, *ZERO.values(), ZERO2_OFFLOAD, ZERO3_OFFLOAD]),
    num_gpus=st.sampled_from([1, 2, 4, 8]),
    flops=st.floats(1e9, 1e15),
    num_params=st.integers(1_000_000, 10**10),
    accum=st.integers(1, 8),
    bandwidth=st.floats(1.0, 900.0),
)
def test_monotonic(stage, num_gpus, flops, num_params, accum, bandwidth):
    clu = cluster(num_gpus=num_gpus, intra=bandwidth)
    est = run(stage, clu, flops=(flops, 2 * flops), num_params=num_params, accum=accum)
    assert est.step_s >= est.compute_s > 0
    assert 0 <= est.comm_s <= est.breakdown["comm_s"] + 1e-12
    more_flops = run(stage, clu, flops=(2 * flops, 4 * flops), num_params=num_params, accum=accum)
    assert more_flops.step_s >= est.step_s * (1 - 1e-9)
    bigger = run(stage, clu, flops=(flops, 2 * flops), num_params=2 * num_params, accum=accum)
    assert bigger.breakdown["comm_s"] >= est.breakdown["comm_s"]
    assert bigger.step_s >= est.step_s * (1 - 1e-9)
    faster_link = run(stage, cluster(num_gpus=num_gpus, intra=2 * bandwidth),
                      flops=(flops, 2 * flops), num_params=num_params, accum=accum)
    assert faster_link.step_s <= est.step_s * (1 + 1e-9)


def test_zero3_reduce_scatter_hides_only_with_overlap_comm():
    clu = cluster(num_gpus=8)
    # backward (0.2 s) is long enough to hide any share of the ~17 ms of backward communication
    default = run(ZERO[3], clu)  # overlap_comm defaults to True at stage 3
    serial = run(ZERO[3], clu, ds=DeepSpeedConfig(overlap_comm=False))
    assert default.breakdown["comm_s"] == pytest.approx(serial.breakdown["comm_s"])
    assert default.comm_s < serial.comm_s


def test_tensor_parallel_data_parallel_gradients_are_the_shards():
    """The planner gives a tensor-parallel candidate the parameter counts of its traced shard
    (launcher/tp_shard.py): with tp=2 each rank's data-parallel all-reduce moves half the
    gradients of the unsharded model, not a quarter."""
    clu, n = cluster(num_gpus=4), 250_000_000
    unsharded = run(Strategy("cai_tp", "colossalai", tp_size=1), clu, num_params=n, dp=2).breakdown["comm_s"]
    shard = run(Strategy("cai_tp", "colossalai", tp_size=2), clu, num_params=n // 2, dp=2).breakdown["comm_s"]
    assert unsharded > 0 and shard == pytest.approx(unsharded / 2)

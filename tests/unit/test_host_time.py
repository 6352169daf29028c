"""Host-side step time terms (launcher/host_time.py) from their definitions."""
from dataclasses import replace

import pytest

from launcher.backends.deepspeed.comm import host_style
from launcher.config import DDPConfig, DeepSpeedConfig
from launcher.host_time import (ADAMW_ACCESSES_PER_ELEM, CLIP_ACCESSES_PER_ELEM, GB, MIB, StepCounts,
                                WORKER_COLLECTIVES_PER_STEP, ZERO_STEP_COLLECTIVES, comm_s, host_time_s, torch_ddp)
from launcher.speed import estimate_speed
from launcher.types import Cluster, Strategy, Workload

CPU = Cluster(hardware="cpu", device="cpu", num_gpus=2, num_nodes=1, memory_bytes=2**34, host_memory_bytes=2**35,
              peak_tflops={"fp32": 0.05, "bf16": 0.1}, matmul_efficiency=1.0, memory_bandwidth_gbps=6.0,
              intra_node_bandwidth_gbps=1.0, inter_node_bandwidth_gbps=1.0, host_link_bandwidth_gbps=6.0,
              sm_arch=0, cuda_context_bytes=0, op_overhead_s=2e-5, collective_latency_s=1e-4,
              all_gather_bandwidth_gbps=0.2, elementwise_gelems_per_s=1.5)
COUNTS = StepCounts(forward_ops=100, backward_ops=150, optimizer_ops=80, activation_elements=30e6, copy_bytes=4e6, num_modules=25,
                    gathered_modules=2, gathered_numel=2e6)
WL = Workload(seq_len=128, micro_batch_size=2, precision="32-true", optimizer="adamw_torch",
              gradient_checkpointing=False, attn_implementation="sdpa")
DDP = Strategy("ddp", "ddp")
Z = {k: Strategy(f"zero{k}", "deepspeed", zero_stage=k) for k in range(4)}
N = 10_000_000


def style(strategy, ds=DeepSpeedConfig()):
    """The host mechanics of torch DDP or of a DeepSpeed stage (`HostStyle`)."""
    return torch_ddp(DDPConfig().bucket_cap_mb) if strategy.backend == "ddp" else host_style(strategy.zero_stage, ds)


def terms(strategy, accum=1, counts=COUNTS, cluster=CPU, ds=DeepSpeedConfig(), model_bytes=4):
    return host_time_s(counts, style(strategy, ds), WL, cluster, trainable=N, num_params=N, dp=2, accum=accum,
                       model_bytes=model_bytes, master_bytes=4, grad_bytes=model_bytes)


def test_optimizer_is_memory_bound_adamw_over_the_rank_elements():
    per_elem_s = (ADAMW_ACCESSES_PER_ELEM + CLIP_ACCESSES_PER_ELEM) * 4 / (6.0 * GB)
    assert terms(DDP)["optimizer_s"] == pytest.approx(N * per_elem_s)
    assert terms(Z[0])["optimizer_s"] == pytest.approx(N * per_elem_s)  # ZeRO-0 does not partition
    for k in (1, 2, 3):
        assert terms(Z[k])["optimizer_s"] == pytest.approx(N / 2 * per_elem_s)


def test_dispatch_counts_every_micro_batch_and_zero3_hooks():
    assert terms(DDP)["dispatch_s"] == pytest.approx((100 + 150 + 80) * 2e-5)
    assert terms(DDP, accum=3)["dispatch_s"] == pytest.approx(((100 + 150) * 3 + 80) * 2e-5)
    assert terms(Z[3])["dispatch_s"] > terms(Z[2])["dispatch_s"]
    more_modules = replace(COUNTS, num_modules=50)
    extra = terms(Z[3], counts=more_modules)["dispatch_s"] - terms(Z[3])["dispatch_s"]
    assert extra == pytest.approx(terms(Z[3])["dispatch_s"] - terms(Z[2])["dispatch_s"])  # linear in modules


def test_activation_traffic_elementwise_elements_and_copied_bytes():
    """Elementwise outputs at the elementwise rate; copies read and write their bytes at the memory
    bandwidth; per micro-batch."""
    copies_s = 2 * 4e6 / (6.0 * GB)
    assert terms(DDP)["activation_traffic_s"] == pytest.approx(30e6 / 1.5e9 + copies_s)
    assert terms(DDP, accum=3)["activation_traffic_s"] == pytest.approx(3 * (30e6 / 1.5e9 + copies_s))
    # uncalibrated: an fp32 elementwise op moves 12 bytes per output element at the memory bandwidth
    no_rate = replace(CPU, elementwise_gelems_per_s=None)
    assert terms(DDP, cluster=no_rate)["activation_traffic_s"] == pytest.approx(30e6 * 12 / (6.0 * GB) + copies_s)


def test_bus_bandwidth_of_the_dtype_at_the_message_size():
    """The 16-bit table for 2-byte elements, the fp32 one otherwise, at the call's message size:
    linear in log size between calibrated sizes, held beyond them, the largest without a size;
    without a table the scalar link bandwidths; DDP's fp32 and ZeRO's bf16 reductions differ."""
    import math

    from launcher.host_time import bus_gbps

    table = {"all_reduce_fp32": {1.0: 0.8, 16.0: 1.6}, "all_reduce_bf16": {1.0: 0.4, 16.0: 0.6}}
    c = replace(CPU, collective_gbps=table)
    assert bus_gbps(c, "all_reduce", 4) == 1.6 and bus_gbps(c, "all_reduce", 2) == 0.6
    assert bus_gbps(c, "all_reduce", 4, 4 * MIB) == pytest.approx(0.8 + 0.5 * 0.8)  # 4 MiB: halfway in log size
    assert bus_gbps(c, "all_reduce", 2, 0.1 * MIB) == 0.4 and bus_gbps(c, "all_reduce", 2, 64 * MIB) == 0.6
    assert bus_gbps(c, "all_gather", 4) == CPU.all_gather_bandwidth_gbps  # no all-gather table
    assert bus_gbps(CPU, "all_reduce", 2) == CPU.intra_node_bandwidth_gbps
    grads = 1e6 * 2  # a bf16 all-reduce of 2 MB, one call: latency + bus bytes at the bf16 rate of 2 MB
    rate = 0.4 + 0.2 * math.log(grads / MIB) / math.log(16)
    got = comm_s(COUNTS, style(Z[0], DeepSpeedConfig(reduce_bucket_size=10**7)), c, trainable=1_000_000, dp=2,
                 accum=1, model_bytes=2, grad_bytes=2)
    assert got == pytest.approx((WORKER_COLLECTIVES_PER_STEP + 1) * 1e-4 + grads * 2 * 0.5 / (rate * GB))


def test_reduce_buckets_follow_the_flush_rule():
    """A gradient that would overflow the bucket flushes it first; one larger than the bucket goes
    alone; ZeRO-0 reduces everything below 500M elements in one call whatever reduce_bucket_size is."""
    from launcher.backends.deepspeed.layout import no_retain_buckets
    from launcher.host_time import reduce_buckets

    counts = replace(COUNTS, grad_numels=(50, 60, 300, 10, 20, 30))
    assert reduce_buckets(counts, 470, 100) == [50, 60, 300, 60]
    assert reduce_buckets(counts, 470, 1000) == [470]
    assert reduce_buckets(counts, 235, 100) == [25 + 30, 150, 30]  # a tensor-parallel half of each gradient
    assert reduce_buckets(COUNTS, 250, 100) == [100, 100, 50]  # no sizes: full buckets and the rest
    assert no_retain_buckets(counts.grad_numels) == [470]
    big = replace(COUNTS, grad_numels=(300_000_000, 300_000_000, 10))
    assert no_retain_buckets(big.grad_numels) == [600_000_000, 10]


def test_ddp_buckets_and_latency():
    """40 MB of fp32 gradients: a 1 MiB first bucket, then 25 MiB buckets -> 3 all-reduces, plus a
    buffer broadcast per forward and the worker's two collectives."""
    grads = N * 4
    expected = (3 + 1 + WORKER_COLLECTIVES_PER_STEP) * 1e-4 + grads * 2 * 0.5 / GB
    got = comm_s(COUNTS, style(DDP), CPU, trainable=N, dp=2, accum=1, model_bytes=4, grad_bytes=4)
    assert got == pytest.approx(expected)
    assert 3 == 1 + -(-(grads - MIB) // (25 * MIB))


def test_zero2_all_reduces_per_bucket_and_gathers_at_the_all_gather_rate():
    ds = DeepSpeedConfig(reduce_bucket_size=1_000_000, allgather_bucket_size=2_000_000)
    got = comm_s(COUNTS, style(Z[2], ds), CPU, trainable=N, dp=2, accum=1, model_bytes=4, grad_bytes=4)
    # DeepSpeed 0.19 all-reduces each of the 10 buckets (use_multi_rank_bucket_allreduce):
    # 2 (n-1)/n of the gradient at the all-reduce bus bandwidth
    reduce = 10 * 1e-4 + N * 4 * 2 * 0.5 / GB
    gather = 3 * 1e-4 + N * 4 * 0.5 / (0.2 * GB)  # ceil(5e6 / 2e6) = 3 calls
    step_calls = WORKER_COLLECTIVES_PER_STEP + ZERO_STEP_COLLECTIVES
    assert got == pytest.approx(step_calls * 1e-4 + reduce + gather)


def test_single_rank_has_no_collectives_but_the_worker_calls():
    got = comm_s(COUNTS, style(DDP), CPU, trainable=N, dp=1, accum=1, model_bytes=4, grad_bytes=4)
    assert got == pytest.approx(WORKER_COLLECTIVES_PER_STEP * 1e-4)


def test_estimate_speed_cpu_adds_host_terms_and_gpu_is_launch_bound_only_when_tiny():
    flops = {"forward": 1e9, "backward": 2e9}
    base = estimate_speed(flops, DDP, WL, CPU, num_params=N, grad_accum_steps=1, dp_size=2)
    full = estimate_speed(flops, DDP, WL, CPU, num_params=N, grad_accum_steps=1, dp_size=2,
                          counts=COUNTS)
    host = {k[5:]: v for k, v in full.breakdown.items() if k.startswith("host_")}
    assert full.step_s == pytest.approx(base.compute_s + sum(host.values()))
    gpu = replace(CPU, device="cuda", peak_tflops={"fp32": 100.0}, op_overhead_s=5e-6)
    g = estimate_speed(flops, DDP, WL, gpu, num_params=N, grad_accum_steps=1, dp_size=2,
                       counts=COUNTS)
    assert g.compute_s == pytest.approx(max(3e9 / 100e12, 330 * 5e-6))
    big = {"forward": 1e14, "backward": 2e14}
    g2 = estimate_speed(big, DDP, WL, gpu, num_params=N, grad_accum_steps=1, dp_size=2,
                        counts=COUNTS)
    assert g2.compute_s == pytest.approx(3e14 / 100e12)


@pytest.mark.parametrize("strategy", [Strategy("cai_gemini", "colossalai"),
                                      Strategy("cai_pp", "colossalai", pp_size=2, zero_stage=1)],
                         ids=["gemini", "pipeline"])
def test_gpu_launch_floor_holds_for_gemini_and_pipeline_stages(strategy):
    """Gemini has no CPU host-time model and pipelines had none, but on a GPU they launch the same
    kernels: their step had no launch floor, so a launch-bound model planned them 50-80x faster
    than DDP (tiny-llama on 2 A100s: 340M against 4M tokens/s). A pipeline stage launches 1/pp
    of the layers' ops for each of its micro-batches."""
    gpu = replace(CPU, device="cuda", peak_tflops={"fp32": 100.0}, op_overhead_s=5e-6)
    flops = {"forward": 1e9, "backward": 2e9}
    accum = 4
    g = estimate_speed(flops, strategy, WL, gpu, num_params=N, grad_accum_steps=accum, dp_size=2 // strategy.pp_size,
                       counts=COUNTS)
    launches = (COUNTS.forward_ops + COUNTS.backward_ops) * accum / strategy.pp_size + COUNTS.optimizer_ops
    assert g.compute_s >= launches * 5e-6 > accum * 3e9 / 100e12


def test_a_pipeline_stage_on_cpu_does_its_share_of_the_host_work_stretched_by_the_bubble():
    """On CPU processes a stage's host work is its compute: 1/p of each micro-batch's dispatch and
    activation traffic, stretched by the 1F1B flush's (m + p - 1) / m like its FLOP time, and the
    optimizer over 1/p of the parameters. Without host terms a 2-stage pipeline was planned 2.4x
    faster than DDP for tiny-llama on 2 CPU processes (and measured 2.2x slower)."""
    flops, accum = {"forward": 1e9, "backward": 2e9}, 2  # m = pp = 2 micro-batches per flush
    pp = estimate_speed(flops, Strategy("cai_pp", "colossalai", pp_size=2), WL, CPU, num_params=N,
                        grad_accum_steps=accum, dp_size=1, counts=COUNTS).breakdown
    whole = estimate_speed(flops, DDP, WL, CPU, num_params=N, grad_accum_steps=accum, dp_size=1,
                           counts=COUNTS).breakdown
    stretch = (2 + 2 - 1) / 2
    assert pp["host_activation_traffic_s"] == pytest.approx(whole["host_activation_traffic_s"] / 2 * stretch)
    assert pp["host_dispatch_s"] == pytest.approx(whole["host_dispatch_s"] / 2 * stretch)
    assert pp["host_optimizer_s"] == pytest.approx(whole["host_optimizer_s"] / 2)
    assert pp["compute_s"] == pytest.approx(whole["compute_s"] / 2 * stretch)


def test_step_counts_from_a_real_trace_match_the_model():
    """Modules with parameters at full depth equal those of the transformers model built from the
    config (independent count on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from launcher import trace
    from launcher.host_time import step_counts

    hf = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
          "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 128, "max_position_embeddings": 64,
          "tie_word_embeddings": False, "use_cache": False}
    key = trace.TraceKey(hf_config_json=trace.canonical_config_json(hf), num_layers=3, micro_batch_size=1, seq_len=16)
    traces = trace.trace_set(key, 3)
    counts = step_counts(traces, persistence_threshold=1000)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    modules = [m for m in model.modules() if list(m.parameters(recurse=False))]
    assert counts.num_modules == pytest.approx(len(modules))
    big = [m for m in modules if max(p.numel() for p in m.parameters(recurse=False)) > 1000]
    assert counts.gathered_modules == pytest.approx(len(big))
    assert counts.gathered_numel == pytest.approx(sum(p.numel() for m in big for p in m.parameters(recurse=False)
                                                      if p.numel() > 1000))
    assert counts.forward_ops > 0 and counts.backward_ops > counts.forward_ops / 2 and counts.activation_elements > 0


def test_op_classes_of_a_real_trace():
    """The same step at fp32 and bf16: the FLOP-counted outputs (matmuls, attention) have the same
    shapes, so the same elements, in 4- and (mostly) 2-byte storages; the step counts take the
    elements of elementwise outputs and the bytes of copies of the forward and backward."""
    from launcher.steptrace import OpClass
    from launcher import trace
    from launcher.host_time import step_counts

    hf = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 128, "max_position_embeddings": 64,
          "tie_word_embeddings": False, "use_cache": False}
    key = trace.TraceKey(hf_config_json=trace.canonical_config_json(hf), num_layers=2, micro_batch_size=2,
                         seq_len=16, optimizer="none")
    fp32 = trace.cached_trace(key)
    bf16 = trace.cached_trace(replace(key, param_dtype="bfloat16"))
    mm32, mm16 = fp32.op_class == OpClass.FLOP, bf16.op_class == OpClass.FLOP
    assert mm32.sum() == mm16.sum() > 4 * 2  # at least q, k, v, o per layer, forward
    # bf16 matmul outputs are 2-byte; attention's logsumexp stays fp32 in both
    assert set(fp32.itemsize[mm32]) == {4} and set(bf16.itemsize[mm16]) == {2, 4}
    assert (fp32.nbytes[mm32] // 4).sum() == (bf16.nbytes[mm16] // bf16.itemsize[mm16]).sum()
    traces = trace.trace_set(key, 2)  # depths 1 and 2, extrapolated to 2: the depth-2 trace's own count
    fwd_bwd = (fp32.alloc >= fp32.phases["forward"][0]) & (fp32.alloc < fp32.phases["backward"][1])
    elementwise, copies = fwd_bwd & (fp32.op_class == OpClass.ELEMENTWISE), fwd_bwd & (fp32.op_class == OpClass.COPY)
    assert elementwise.any() and copies.any()
    counts = step_counts(traces, 1000)
    assert counts.activation_elements == pytest.approx((fp32.nbytes[elementwise] // fp32.itemsize[elementwise]).sum())
    assert counts.copy_bytes == pytest.approx(fp32.nbytes[copies].sum())
    # the bf16 model casts to fp32 for its norms and loss: more copies than the fp32 model
    bf16_fwd_bwd = (bf16.alloc >= bf16.phases["forward"][0]) & (bf16.alloc < bf16.phases["backward"][1])
    assert (bf16_fwd_bwd & (bf16.op_class == OpClass.COPY)).sum() > copies.sum()


def test_zero12_gradient_reductions_follow_each_framework():
    """DeepSpeed 0.19 ZeRO-1/2 all-reduce each bucket (`use_multi_rank_bucket_allreduce`, its
    default); ColossalAI LowLevelZero all-reduces at stage 1 and, on CPU processes, at stage 2 too
    (the worker's in-place all-reduce for gloo, launcher/backends/colossalai/cpu.py); ZeRO-3
    reduce-scatters at the calibrated reduce-scatter rate."""
    c = replace(CPU, collective_gbps={"all_reduce_fp32": {64.0: 1.0}, "reduce_scatter_fp32": {64.0: 0.4},
                                      "all_gather_fp32": {64.0: 0.25}})
    from launcher.backends.colossalai.comm import colossalai_host_style
    from launcher.config import ColossalAIConfig

    ds = DeepSpeedConfig(reduce_bucket_size=10**6, allgather_bucket_size=10**6)
    cai = ColossalAIConfig(reduce_bucket_size_in_m=1)  # 2**20-element buckets: 10 for N, 5 calls for a half
    kw = dict(trainable=N, dp=2, accum=1, model_bytes=4, grad_bytes=4)
    grads = N * 4
    fixed = (WORKER_COLLECTIVES_PER_STEP + ZERO_STEP_COLLECTIVES) * 1e-4
    gather = 5 * 1e-4 + grads * 0.5 / (0.25 * GB)  # 5 M-element partition in 1 M-element buckets
    assert comm_s(COUNTS, style(Z[2], ds), c, **kw) == pytest.approx(fixed + 10 * 1e-4 + grads * 2 * 0.5 / GB + gather)
    cai1, cai2 = (colossalai_host_style(Strategy(f"cai_zero{k}", "colossalai", zero_stage=k), cai, DDPConfig())
                  for k in (1, 2))
    assert comm_s(COUNTS, cai1, c, **kw) == pytest.approx(fixed + 10 * 1e-4 + grads * 2 * 0.5 / GB + gather)
    assert comm_s(COUNTS, cai2, c, **kw) == pytest.approx(fixed + 10 * 1e-4 + grads * 2 * 0.5 / GB + gather)
    z3 = comm_s(COUNTS, style(Z[3], ds), c, **kw) - COUNTS.gathered_modules * 1e-4
    assert z3 == pytest.approx(fixed + 10 * 1e-4 + grads * 0.5 / (0.4 * GB))


def test_sixteen_bit_optimizer_elements_cost_what_fp32_ones_do():
    """ATen computes 16-bit elementwise ops in fp32: AdamW over bf16 masters takes the fp32 time."""
    fp32 = host_time_s(COUNTS, style(DDP), WL, CPU, trainable=N, num_params=N, dp=2, accum=1, model_bytes=4,
                       master_bytes=4, grad_bytes=4)
    bf16 = host_time_s(COUNTS, style(DDP), WL, CPU, trainable=N, num_params=N, dp=2, accum=1, model_bytes=2,
                       master_bytes=2, grad_bytes=2)
    assert bf16["optimizer_s"] == fp32["optimizer_s"]


def test_gradient_passes_average_every_reduction_and_check_deepspeed_16_bit_partitions():
    """One division pass over the reduced gradients per reduction (DDP, ZeRO-0 and ZeRO-1 reduce once
    per step, ZeRO-2/3 per micro-batch); DeepSpeed
    ZeRO-1/2 with bf16 add an amax and an amin pass over the partition and an fp32 cast for the
    norm, ZeRO-0 the same over all gradients; ZeRO-3 tests for overflow only with fp16; fp32
    gradients need no cast."""
    from launcher.host_time import gradient_passes

    bf16 = replace(WL, precision="bf16-mixed")
    kw = dict(trainable=N, dp=2, accum=3)
    assert gradient_passes(style(DDP), bf16, model_bytes=4, **kw) == (N, 0.0)  # no_sync until the last micro-batch
    assert gradient_passes(style(Z[1]), WL, model_bytes=4, **kw) == (N, 0.0)  # ZeRO-1 reduces once per step
    assert gradient_passes(style(Z[0]), bf16, model_bytes=2, **kw) == (N + 2 * N, 6 * N)
    assert gradient_passes(style(Z[2]), bf16, model_bytes=2, **kw) == (3 * N + 2 * N / 2, 6 * N / 2)
    assert gradient_passes(style(Z[3]), bf16, model_bytes=2, **kw) == (3 * N, 6 * N / 2)
    assert gradient_passes(style(Z[3]), replace(WL, precision="16-mixed"), model_bytes=2, **kw) == (3 * N + N, 6 * N / 2)
    assert gradient_passes(style(Z[2]), bf16, model_bytes=2, trainable=N, dp=1, accum=1) == (0.0, 0.0)



def test_framework_copies_follow_each_framework():
    """Bytes read and written by the framework's own copies per step, fp32, N trainable elements on
    2 ranks, one micro-batch. torch DDP writes gradients in its buckets: none. ZeRO-2 (LowLevelZero
    and DeepSpeed alike): each gradient copied into its bucket (read + write, 8 N) and the rank's
    reduced half into the partition (4 N), the updated master half copied back into the model
    (4 N). DeepSpeed also flattens the partition for the step (4 N; fp32 needs no cast) and
    flattens each all-reduced bucket and copies the result back (16 N). DeepSpeed ZeRO-0 flattens
    all gradients for its all-reduce and copies them back (16 N)."""
    from launcher.backends.colossalai.comm import colossalai_host_style
    from launcher.config import ColossalAIConfig
    from launcher.host_time import framework_copy_bytes

    kw = dict(trainable=N, dp=2, accum=1, model_bytes=4, master_bytes=4)
    lowlevel = colossalai_host_style(Strategy("cai_zero2", "colossalai", zero_stage=2), ColossalAIConfig(),
                                     DDPConfig())
    assert framework_copy_bytes(style(DDP), **kw) == 0
    assert framework_copy_bytes(lowlevel, **kw) == pytest.approx(16 * N)
    assert framework_copy_bytes(style(Z[2]), **kw) == pytest.approx(36 * N)
    assert framework_copy_bytes(style(Z[0]), **kw) == pytest.approx(16 * N)

"""Step time of one candidate: compute from traced FLOPs, plus the communication and offload
time a strategy adds, minus what overlaps with compute. Pure arithmetic on plain values.

Units: FLOPs, bytes, seconds; bandwidths in the config are GB/s = 1e9 bytes/s.

Assumptions (each is used in exactly one function below, whose docstring gives its source):
1. Compute runs at `peak_tflops[dtype] x matmul_efficiency` for every FLOP the tracer counted
   (FlopCounterMode counts matmul/attention FLOPs; elementwise work is folded into the
   efficiency), except fused attention kernels, which run at the profile's measured
   `attention_tflops[dtype]` when it has one (`flop_time_s`). The dtype follows the precision:
   32-true -> fp32 (torch leaves
   `torch.backends.cuda.matmul.allow_tf32` False by default, so fp32 matmuls are not TF32),
   bf16-* -> bf16, 16-* -> fp16.
2. Collectives are bandwidth-bound ring algorithms: an all-reduce of S bytes over n ranks moves
   2(n-1)/n x S per rank, a reduce-scatter or all-gather (n-1)/n x S, at the link's bus bandwidth
   (nccl-tests doc/PERFORMANCE.md). Latency terms are ignored (large messages).
3. Link: all ranks in one node -> `intra_node_bandwidth_gbps`. Over several nodes a ring crosses
   each node boundary once per direction, so every byte a rank sends also crosses the node's
   network link: the bottleneck bus bandwidth is min(intra, inter_node_bandwidth_gbps) with
   `inter_node_bandwidth_gbps` the node's aggregate network bandwidth. NCCL's tree / hierarchical
   algorithms and NVLink SHARP are not modelled.
4. Volumes per optimizer step follow the ZeRO paper (arXiv:1910.02054, sec. 7): DDP/ZeRO-0 one
   gradient all-reduce; ZeRO-1/2 a gradient reduce-scatter plus a parameter all-gather (same
   volume as the all-reduce); ZeRO-3 a forward all-gather, a backward all-gather and a gradient
   reduce-scatter (1.5x). Gradient accumulation: DDP (under `no_sync`), ZeRO-0 and ZeRO-1 reduce
   only on the last micro-batch; ZeRO-2 and ZeRO-3 reduce on every micro-batch and ZeRO-3
   gathers parameters on every micro-batch (deepspeed/runtime/engine.py `allreduce_gradients`,
   deepspeed/runtime/zero/stage_1_and_2.py `reduce_ready_partitions_and_remove_grads`).
5. Overlap: DDP overlaps its bucketed all-reduce with backward (Li et al., PyTorch Distributed,
   arXiv:2006.15704 sec. 3.2.3; `no_sync` accumulation sec. 3.2.4); the last bucket can never
   overlap. DeepSpeed ZeRO-1/2 overlap
   only with `overlap_comm` (a side stream); otherwise the hooks reduce on the compute stream.
   ZeRO-0 all-reduces after backward (engine.py `_backward_epilogue`): fully exposed. The ZeRO-1/2
   parameter all-gather follows the optimizer step: fully exposed. ZeRO-3 prefetching hides at
   most ZERO3_OVERLAP_FRACTION of its gathers (and, with overlap_comm, its reduce-scatters)
   behind compute (an assumption, to be calibrated on a GPU).
6. Offload (ZeRO-Offload, arXiv:2101.06840 sec. 4): 16-bit gradient partitions go to the host
   on every reduction, updated 16-bit parameter partitions come back once per step (ZeRO-3
   param offload instead fetches its partition at every gather), over `host_link_bandwidth_gbps`
   per device, not overlapped (an upper bound). The optimizer step runs on the host at
   HOST_ADAM_PARAMS_PER_S per node, shared by the node's ranks.
7. Host time (launcher/host_time.py, when the planner passes the traced step's counts): on CPU
   processes op dispatch, activation traffic, the memory-bound optimizer, framework copies and
   gloo collectives (latency per call + bytes) add to the FLOP time, all exposed; on a GPU only
   op dispatch counts, as max(FLOP time, ops x op_overhead_s) since launches are asynchronous.
8. Framework overhead: what a strategy's step costs beyond all of the above (the engine's Python
   bookkeeping per step, per-parameter hooks, the worker's loop) is measured on the machine by
   training a small model at two depths (launcher/calibrate_frameworks.py) and stored in the
   hardware profile; it is added as is (0 for profiles that were not calibrated this way).
"""
from __future__ import annotations

from typing import Mapping, Optional

from launcher.config import DDPConfig, DeepSpeedConfig
from launcher.errors import ConfigError
from launcher.types import Cluster, SpeedEstimate, Strategy, Workload

GB = 1e9
MIB = 2**20

ZERO3_OVERLAP_FRACTION = 0.5
"""Share of ZeRO-3 communication that prefetching can hide behind compute (assumption)."""

HOST_ADAM_PARAMS_PER_S = 0.5e9
"""Parameters per second a node's CPUs update with torch AdamW (assumption). AdamW is
memory-bound: per fp32 parameter it reads p, g, m, v and writes p, m, v (28 B), and the foreach
implementation about doubles that with temporaries; at ~30 GB/s of achieved host memory bandwidth
that is ~0.5e9 parameters/s. DeepSpeedCPUAdam (SIMD) is several times faster (ZeRO-Offload,
arXiv:2101.06840, CPU-Adam evaluation), but the worker uses torch.optim.AdamW (see
launcher/backends/deepspeed/emit.py)."""


def compute_dtype(precision: str) -> str:
    """Key of `Cluster.peak_tflops` for the matmuls of this precision (assumption 1)."""
    if precision == "32-true":
        return "fp32"
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    raise ConfigError(f"unknown precision {precision!r}")


def grad_bytes_per_elem(strategy: Strategy, precision: str) -> int:
    """Bytes per gradient element on the wire. *-true: the model dtype. Mixed under torch DDP:
    autocast keeps fp32 parameters, so fp32 gradients (4). Mixed under DeepSpeed: the engine
    holds a 16-bit model and communicates in it (deepspeed/runtime/engine.py
    `communication_data_type`: fp16/bf16 when enabled)."""
    if precision == "32-true":
        return 4
    if precision.endswith("-true") or strategy.backend != "ddp":
        return 2
    return 4


def ring_time_s(num_bytes: float, num_ranks: int, bus_bandwidth_gbps: float, collective: str) -> float:
    """Ring collective time: all_reduce moves 2(n-1)/n x S per rank, reduce_scatter and
    all_gather (n-1)/n x S, at bus bandwidth busbw (nccl-tests doc/PERFORMANCE.md:
    busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for reduce-scatter / all-gather)."""
    if num_ranks <= 1 or num_bytes <= 0:
        return 0.0
    factor = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}[collective]
    return num_bytes * factor * (num_ranks - 1) / num_ranks / (bus_bandwidth_gbps * GB)


def bus_bandwidth_gbps(cluster: Cluster) -> float:
    """Bottleneck bus bandwidth of a data-parallel ring over the whole cluster (assumption 3)."""
    if cluster.num_nodes <= 1:
        return cluster.intra_node_bandwidth_gbps
    return min(cluster.intra_node_bandwidth_gbps, cluster.inter_node_bandwidth_gbps)


def overlapped_exposed_s(comm_s: float, compute_s: float, last_bucket_s: float) -> float:
    """Communication left visible when it runs beside `compute_s` of compute: what does not fit,
    and never less than the last bucket, which is only ready when compute ends
    (arXiv:2006.15704 sec. 3.2.3)."""
    return min(comm_s, max(comm_s - compute_s, last_bucket_s))


def deepspeed_overlap_comm(strategy: Strategy, ds: DeepSpeedConfig) -> bool:
    """DeepSpeed's effective overlap_comm: the configured value, else True only for stage 3
    (deepspeed/runtime/zero/config.py `overlap_comm_valid`)."""
    return ds.overlap_comm if ds.overlap_comm is not None else strategy.zero_stage == 3


def _grad_reduction(strategy, ds, ddp, dp_size, bus_gbps, grad_bytes, elem_bytes, accum, backward_s):
    """(raw, exposed) seconds of gradient reduction per optimizer step for DDP and ZeRO-0/1/2
    (assumptions 4 and 5)."""
    if strategy.backend == "ddp" or strategy.zero_stage == 0:
        comm_s = ring_time_s(grad_bytes, dp_size, bus_gbps, "all_reduce")
        num_reductions = 1
    else:
        comm_s = ring_time_s(grad_bytes, dp_size, bus_gbps, "reduce_scatter")
        num_reductions = accum if strategy.zero_stage == 2 else 1
    if strategy.backend == "ddp":
        bucket_bytes, overlaps = ddp.bucket_cap_mb * MIB, True
    else:
        bucket_bytes = ds.reduce_bucket_size * elem_bytes
        overlaps = strategy.zero_stage > 0 and deepspeed_overlap_comm(strategy, ds)
    if not overlaps:
        return comm_s * num_reductions, comm_s * num_reductions
    last_s = ring_time_s(min(bucket_bytes, grad_bytes), dp_size, bus_gbps,
                         "all_reduce" if strategy.backend == "ddp" else "reduce_scatter")
    exposed_s = overlapped_exposed_s(comm_s, backward_s, last_s)
    return comm_s * num_reductions, exposed_s * num_reductions


def _zero3_comm(dp_size, bus_gbps, param_bytes, grad_bytes, accum, forward_s, backward_s,
                overlap_comm):
    """(raw, exposed) seconds per optimizer step for ZeRO-3: every micro-batch all-gathers the
    parameters in forward and again in backward and reduce-scatters the gradients (ZeRO paper
    arXiv:1910.02054 sec. 7.2.2: 3 x (n-1)/n x S, 1.5x DDP). Prefetch hides up to
    ZERO3_OVERLAP_FRACTION of each phase's communication behind that phase's compute; the
    reduce-scatter runs on a side stream only with overlap_comm (deepspeed/runtime/zero/stage3.py,
    `reduce_and_partition_stream` in DeepSpeedZeroOptimizer_Stage3.__init__)."""
    gather_s = ring_time_s(param_bytes, dp_size, bus_gbps, "all_gather")
    scatter_s = ring_time_s(grad_bytes, dp_size, bus_gbps, "reduce_scatter")
    hidden_backward_s = gather_s + (scatter_s if overlap_comm else 0.0)
    exposed_s = (gather_s - min(ZERO3_OVERLAP_FRACTION * gather_s, forward_s)
                 + gather_s + scatter_s
                 - min(ZERO3_OVERLAP_FRACTION * hidden_backward_s, backward_s))
    return (2 * gather_s + scatter_s) * accum, exposed_s * accum


def offload_time_s(strategy: Strategy, cluster: Cluster, num_params: int, num_trainable_params: int,
                   dp_size: int, accum: int, elem_bytes: int) -> float:
    """Host-device copies plus the host optimizer step per optimizer step (assumption 6;
    ZeRO-Offload arXiv:2101.06840 sec. 4.1, single-GPU schedule: 16-bit gradients to the host,
    16-bit parameters back). Gradients move on every reduction (every micro-batch for stages 2 and 3, which
    reduce per micro-batch). With parameter offload the partition is fetched at each forward and
    backward gather instead of once after the step."""
    if not (strategy.offload_optimizer or strategy.offload_params):
        return 0.0
    link_bytes_per_s = cluster.host_link_bandwidth_gbps * GB
    trainable_partition = num_trainable_params / dp_size
    num_reductions = accum if strategy.zero_stage >= 2 else 1
    copy_bytes = trainable_partition * elem_bytes * num_reductions
    if strategy.offload_params:
        copy_bytes += 2 * accum * (num_params / dp_size) * elem_bytes
    else:
        copy_bytes += trainable_partition * elem_bytes
    ranks_per_node = max(1, min(dp_size, cluster.gpus_per_node))
    adam_s = trainable_partition * ranks_per_node / HOST_ADAM_PARAMS_PER_S
    return copy_bytes / link_bytes_per_s + adam_s


def flop_time_s(flops: Mapping[str, float], phase: str, cluster: Cluster, dtype: str) -> float:
    """Seconds of one micro-batch's `phase` FLOPs (assumption 1): matmul FLOPs at peak x
    matmul_efficiency, the part in fused attention kernels (`flops['attention_<phase>']`) at the
    profile's measured `attention_tflops[dtype]` when it has one."""
    peak = cluster.peak_tflops[dtype] * 1e12 * cluster.matmul_efficiency
    attention = flops.get(f"attention_{phase}", 0.0)
    attention_rate = cluster.attention_tflops.get(dtype, 0.0) * 1e12 or peak
    return (flops[phase] - attention) / peak + attention / attention_rate


def estimate_speed(flops_per_micro_batch: Mapping[str, float], strategy: Strategy, workload: Workload,
                   cluster: Cluster, *, num_params: int, grad_accum_steps: int, dp_size: int,
                   ds: DeepSpeedConfig, ddp: Optional[DDPConfig] = None,
                   num_trainable_params: Optional[int] = None, counts=None, cai=None,
                   spec=None) -> SpeedEstimate:
    """Time of one optimizer step and cluster throughput for one candidate.

    compute_s = (F + B) x grad_accum / (peak_tflops[dtype] x 1e12 x matmul_efficiency), with F, B
    the forward and backward FLOPs of one micro-batch (backward includes recomputation under
    gradient checkpointing); step_s = compute_s + exposed_comm_s + offload_s;
    tokens_per_s = micro_batch x grad_accum x dp x seq_len / step_s.
    `num_trainable_params` (default `num_params`) sizes gradients and optimizer work (PEFT);
    ZeRO-3 gathers all `num_params`.

    With `counts` (launcher/host_time.py `StepCounts` of the traced step) the host terms are
    added: on CPU processes step_s = compute_s + dispatch + activation traffic + optimizer +
    framework copies + collectives (all exposed; `host_time_s`); on a GPU, kernel launches are
    asynchronous, so compute_s = max(FLOP time, ops x op_overhead_s) (launch-bound small
    kernels) and the rest is unchanged.
    """
    ddp = ddp or DDPConfig()
    trainable = num_params if num_trainable_params is None else num_trainable_params
    dtype = compute_dtype(workload.precision)
    if dtype not in cluster.peak_tflops:
        raise ConfigError(f"hardware {cluster.hardware!r} has no peak_tflops.{dtype}; "
                          f"add hardware.peak_tflops.{dtype}=<dense TFLOP/s>")
    forward_s = flop_time_s(flops_per_micro_batch, "forward", cluster, dtype)
    backward_s = flop_time_s(flops_per_micro_batch, "backward", cluster, dtype)
    compute_s = (forward_s + backward_s) * grad_accum_steps

    elem_bytes = grad_bytes_per_elem(strategy, workload.precision)
    grad_bytes, param_bytes = trainable * elem_bytes, num_params * elem_bytes
    bus_gbps = bus_bandwidth_gbps(cluster)
    if strategy.zero_stage == 3:
        comm_s, exposed_s = _zero3_comm(dp_size, bus_gbps, param_bytes, grad_bytes, grad_accum_steps,
                                        forward_s, backward_s, deepspeed_overlap_comm(strategy, ds))
    else:
        comm_s, exposed_s = _grad_reduction(strategy, ds, ddp, dp_size, bus_gbps, grad_bytes,
                                            elem_bytes, grad_accum_steps, backward_s)
        if strategy.backend != "ddp" and strategy.zero_stage in (1, 2):
            gather_s = ring_time_s(trainable * elem_bytes, dp_size, bus_gbps, "all_gather")
            comm_s, exposed_s = comm_s + gather_s, exposed_s + gather_s
    if strategy.backend == "colossalai":  # ColossalAI plugins: colossalai_comm
        compute_s, comm_s, exposed_s, elem_bytes = colossalai_comm(
            strategy, workload, cluster, compute_s, forward_s, backward_s, trainable=trainable,
            num_params=num_params, dp=dp_size, accum=grad_accum_steps, ds=ds, ddp=ddp, cai=cai, spec=spec)
    offload_s = offload_time_s(strategy, cluster, num_params, trainable, dp_size,
                               grad_accum_steps, elem_bytes)
    host = {}
    if counts is not None:
        compute_s, exposed_s, host = _with_host_terms(counts, strategy, workload, cluster, compute_s, exposed_s,
                                                      trainable=trainable, num_params=num_params, dp=dp_size,
                                                      accum=grad_accum_steps, ds=ds, ddp=ddp, cai=cai, spec=spec)
    framework_s = framework_overhead_s(cluster, strategy, counts, grad_accum_steps)
    step_s = compute_s + exposed_s + offload_s + sum(v for k, v in host.items() if k != "comm_s") + framework_s
    tokens = workload.micro_batch_size * grad_accum_steps * dp_size * workload.seq_len
    breakdown = {
        "compute_s": compute_s, "comm_s": comm_s, "exposed_comm_s": exposed_s,
        "offload_s": offload_s, "flops": (flops_per_micro_batch["forward"]
                                          + flops_per_micro_batch["backward"]) * grad_accum_steps,
        "compute_dtype": dtype, "bus_bandwidth_gbps": bus_gbps, "comm_bytes_per_elem": elem_bytes,
        **{f"host_{k}": v for k, v in host.items()},
        "framework_overhead_s": framework_s,
        "num_param_tensors": counts.num_param_tensors if counts is not None else 0.0,
    }
    return SpeedEstimate(compute_s=compute_s, comm_s=exposed_s, step_s=step_s,
                         tokens_per_s=tokens / step_s if step_s > 0 else float("inf"),
                         breakdown=breakdown)


def framework_overhead_s(cluster: Cluster, strategy: Strategy, counts, accum: int) -> float:
    """The framework's own per-step cost (assumption 8): `fixed + per_tensor x parameter tensors x
    micro-batches`, the two numbers `mode=calibrate calibrate.frameworks=[...]` measured for this
    strategy on this machine (launcher/calibrate_frameworks.py); 0 where not calibrated."""
    fixed_s, per_tensor_s = (cluster.framework_overhead_s or {}).get(strategy.name, (0.0, 0.0))
    tensors = counts.num_param_tensors if counts is not None else 0.0
    return fixed_s + per_tensor_s * tensors * accum


def _with_host_terms(counts, strategy, workload, cluster, compute_s, exposed_s, *, trainable, num_params, dp,
                     accum, ds, ddp, cai=None, spec=None):
    """(compute_s, exposed comm_s, host terms) with launcher/host_time.py's terms (estimate_speed)."""
    from launcher.host_time import host_time_s

    host_strategy, ds, tp_s = strategy, ds, 0.0
    if strategy.backend == "colossalai":
        if strategy.name == "cai_gemini" or strategy.pp_size > 1:
            return compute_s, exposed_s, {}  # Gemini and pipelines do not run on CPU processes
        host_strategy, ds = colossalai_host_equivalent(strategy, cai)
        tp_s = tp_comm_s(strategy, workload, cluster, spec, accum, 4 if workload.precision == "32-true" else 2)
        shard = strategy.tp_size * strategy.pp_size
        trainable, num_params = trainable // shard, num_params // shard
    if cluster.device != "cpu":
        ops = (counts.forward_ops + counts.backward_ops) * accum + counts.optimizer_ops
        return max(compute_s, ops * cluster.op_overhead_s), exposed_s, {}
    model_bytes = 4 if workload.precision in ("32-true",) or (
        host_strategy.backend == "ddp" and workload.precision.endswith("-mixed")) else 2
    master_bytes = model_bytes if host_strategy.backend == "ddp" else (2 if workload.precision == "bf16-true" else 4)
    host = host_time_s(counts, host_strategy, workload, cluster, trainable=trainable, num_params=num_params, dp=dp,
                       accum=accum, model_bytes=model_bytes, master_bytes=master_bytes,
                       grad_bytes=grad_bytes_per_elem(host_strategy, workload.precision), ds=ds, ddp=ddp)
    host["comm_s"] += tp_s
    return compute_s, host["comm_s"], host


def colossalai_host_equivalent(strategy: Strategy, cai) -> tuple:
    """(strategy, bucket sizes) whose host terms a ColossalAI plugin shares: TorchDDPPlugin and
    HybridParallelPlugin's DP dimension without ZeRO are torch DDP (hybrid_parallel_plugin.py
    wraps the shard in DDP); LowLevelZeroPlugin and the ZeRO DP dimension copy gradients into
    `reduce_bucket_size_in_m` buckets, all-reduce (stage 1) or reduce-scatter (stage 2) them and
    all-gather the updated partition like DeepSpeed ZeRO-1/2 (colossalai/zero/low_level/
    low_level_optim.py `_run_reduction`, `step`: one all-gather of the whole flat partition per
    bucket store); the strategy keeps its ColossalAI backend for launcher/host_time.py `comm_s`."""
    from types import SimpleNamespace

    from launcher.config import ColossalAIConfig

    cai = cai or ColossalAIConfig()
    if strategy.name == "cai_ddp" or strategy.zero_stage == 0:
        return Strategy("ddp", "ddp"), None
    bucket = int(cai.reduce_bucket_size_in_m * 1024 * 1024)
    return (Strategy(strategy.name, "colossalai", strategy.zero_stage),
            SimpleNamespace(reduce_bucket_size=bucket, allgather_bucket_size=bucket))


def tp_comm_s(strategy: Strategy, workload: Workload, cluster: Cluster, spec, accum: int, elem: int) -> float:
    """Tensor-parallel all-reduces per optimizer step: each decoder layer all-reduces b x s x hidden
    activations twice in forward (the g operators) and twice in backward (the f operators)
    (Megatron-LM, arXiv:1909.08053 sec. 3), on the intra-node link over tp ranks, not overlapped;
    each call also pays `collective_latency_s`."""
    if strategy.tp_size <= 1 or spec is None:
        return 0.0
    calls = 4 * spec.num_layers / strategy.pp_size * accum
    act_bytes = workload.micro_batch_size * workload.seq_len * spec.hidden_size * elem
    per_call = ring_time_s(act_bytes, strategy.tp_size, cluster.intra_node_bandwidth_gbps, "all_reduce")
    return calls * (per_call + cluster.collective_latency_s)


def colossalai_comm(strategy: Strategy, workload: Workload, cluster: Cluster, compute_s: float,
                    forward_s: float, backward_s: float, *, trainable: int, num_params: int, dp: int,
                    accum: int, ds: DeepSpeedConfig, ddp: DDPConfig, cai=None, spec=None):
    """(compute_s, comm_s, exposed_s, bytes per communicated element) of a ColossalAI candidate.

    - cai_ddp: torch DDP (fp32 gradients under autocast), as `_grad_reduction`.
    - cai_zero1/2 (LowLevelZero) and the DP dimension of cai_tp/cai_pp with zero_stage 1/2:
      gradient reduce(-scatter) plus parameter all-gather, as DeepSpeed ZeRO-1/2 (ZeRO paper
      arXiv:1910.02054 sec. 7); overlapped with backward only with overlap_communication.
    - cai_gemini: chunk all-gathers in forward and backward and a gradient reduce-scatter per
      micro-batch, as ZeRO-3 (`_zero3_comm`); chunks are gathered whole, so the volume is the
      model's.
    - tensor parallelism (tp > 1): the traced FLOPs are already one shard's; `tp_comm_s` adds the
      per-layer activation all-reduces. DP gradients are 1/tp.
    - pipeline parallelism (p > 1): the micro-batches of one optimizer step (grad_accum, a
      multiple of num_microbatches m) are the pipeline's micro-batches; the traced FLOPs cover all
      layers, a stage runs 1/p of them, and each 1F1B flush of m micro-batches idles
      (p-1)/(m+p-1) of its time (the bubble; GPipe arXiv:1811.06965, 1F1B arXiv:2104.04473
      sec. 2.2): compute_s / p / (1 - bubble). Stage-to-stage activation sends are not modelled
      (b x s x hidden per micro-batch, small next to the all-reduces)."""
    from launcher.config import ColossalAIConfig

    cai = cai or ColossalAIConfig()
    tp, pp = strategy.tp_size, strategy.pp_size
    elem = 4 if workload.precision == "32-true" or strategy.name == "cai_ddp" else 2
    bus = bus_bandwidth_gbps(cluster)
    grads, params = trainable * elem / (tp * pp), num_params * elem / (tp * pp)
    if strategy.name == "cai_ddp":
        comm, exposed = _grad_reduction(Strategy("ddp", "ddp"), ds, ddp, dp, bus, grads, elem, accum, backward_s)
    elif strategy.name == "cai_gemini":
        comm, exposed = _zero3_comm(dp, bus, params, grads, accum, forward_s, backward_s, True)
    elif strategy.zero_stage in (1, 2):
        comm = ring_time_s(grads, dp, bus, "reduce_scatter") * (accum if strategy.zero_stage == 2 else 1)
        gather = ring_time_s(grads, dp, bus, "all_gather")
        overlap = cai.overlap_communication if cai.overlap_communication is not None else cluster.device != "cpu"
        exposed = (max(0.0, comm - backward_s * accum) if overlap else comm) + gather
        comm += gather
    else:
        comm = exposed = ring_time_s(grads, dp, bus, "all_reduce")
    tp_s = tp_comm_s(strategy, workload, cluster, spec, accum, elem)
    comm, exposed = comm + tp_s, exposed + tp_s
    if pp > 1:
        from launcher.backends.colossalai.emit import num_microbatches

        m = num_microbatches(cai, pp)
        bubble = (pp - 1) / (m + pp - 1)
        compute_s = compute_s / pp / (1 - bubble)
    return compute_s, comm, exposed, elem

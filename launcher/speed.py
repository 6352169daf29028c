"""Step time of one candidate: compute from traced FLOPs, plus the communication and offload
time a strategy adds, minus what overlaps with compute. Pure arithmetic on plain values.

Units: FLOPs, bytes, seconds; bandwidths in the config are GB/s = 1e9 bytes/s.

Assumptions (each is used in exactly one function below, whose docstring gives its source):
1. Compute runs at `peak_tflops[dtype] x matmul_efficiency` for every FLOP the tracer counted
   (FlopCounterMode counts matmul/attention FLOPs; elementwise work is folded into the
   efficiency). The dtype follows the precision: 32-true -> fp32 (torch leaves
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
launcher/emit/deepspeed.py)."""


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


def estimate_speed(flops_per_micro_batch: Mapping[str, float], strategy: Strategy, workload: Workload,
                   cluster: Cluster, *, num_params: int, grad_accum_steps: int, dp_size: int,
                   ds: DeepSpeedConfig, ddp: Optional[DDPConfig] = None,
                   num_trainable_params: Optional[int] = None) -> SpeedEstimate:
    """Time of one optimizer step and cluster throughput for one candidate.

    compute_s = (F + B) x grad_accum / (peak_tflops[dtype] x 1e12 x matmul_efficiency), with F, B
    the forward and backward FLOPs of one micro-batch (backward includes recomputation under
    gradient checkpointing); step_s = compute_s + exposed_comm_s + offload_s;
    tokens_per_s = micro_batch x grad_accum x dp x seq_len / step_s.
    `num_trainable_params` (default `num_params`) sizes gradients and optimizer work (PEFT);
    ZeRO-3 gathers all `num_params`.
    """
    ddp = ddp or DDPConfig()
    trainable = num_params if num_trainable_params is None else num_trainable_params
    dtype = compute_dtype(workload.precision)
    if dtype not in cluster.peak_tflops:
        raise ConfigError(f"hardware {cluster.hardware!r} has no peak_tflops.{dtype}; "
                          f"add hardware.peak_tflops.{dtype}=<dense TFLOP/s>")
    flops_per_s = cluster.peak_tflops[dtype] * 1e12 * cluster.matmul_efficiency
    forward_s = flops_per_micro_batch["forward"] / flops_per_s
    backward_s = flops_per_micro_batch["backward"] / flops_per_s
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
    offload_s = offload_time_s(strategy, cluster, num_params, trainable, dp_size,
                               grad_accum_steps, elem_bytes)
    step_s = compute_s + exposed_s + offload_s
    tokens = workload.micro_batch_size * grad_accum_steps * dp_size * workload.seq_len
    breakdown = {
        "compute_s": compute_s, "comm_s": comm_s, "exposed_comm_s": exposed_s,
        "offload_s": offload_s, "flops": (flops_per_micro_batch["forward"]
                                          + flops_per_micro_batch["backward"]) * grad_accum_steps,
        "compute_dtype": dtype, "bus_bandwidth_gbps": bus_gbps, "comm_bytes_per_elem": elem_bytes,
    }
    return SpeedEstimate(compute_s=compute_s, comm_s=exposed_s, step_s=step_s,
                         tokens_per_s=tokens / step_s if step_s > 0 else float("inf"),
                         breakdown=breakdown)

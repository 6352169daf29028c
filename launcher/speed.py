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
   op dispatch counts, as max(FLOP time, ops x op_overhead_s) since launches are asynchronous,
   for every strategy (Gemini and pipeline stages included: they launch the same kernels). A
   pipeline stage on CPU processes does 1/p of each micro-batch's host work, stretched by the
   1F1B bubble as its FLOP time is (launcher/backends/colossalai/comm.py `host_equivalent`).
8. Framework overhead: what a strategy's step costs beyond all of the above (the engine's Python
   bookkeeping per step, per-parameter hooks, the worker's loop) is measured on the machine by
   training a small model at two depths (launcher/calibrate_frameworks.py) and stored in the
   hardware profile; it is added as is (0 for profiles that were not calibrated this way).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Optional

from launcher.backends.base import CommInput
from launcher.backends.registry import backend_of
from launcher.backends.registry import knobs as registry_knobs
from launcher.collectives import GB, bus_bandwidth_gbps
from launcher.errors import ConfigError
from launcher.host_time import host_time_s
from launcher.precision import compute_dtype
from launcher.types import Cluster, SpeedEstimate, Strategy, Workload

HOST_ADAM_PARAMS_PER_S = 0.5e9
"""Parameters per second a node's CPUs update with torch AdamW (assumption). AdamW is
memory-bound: per fp32 parameter it reads p, g, m, v and writes p, m, v (28 B), and the foreach
implementation about doubles that with temporaries; at ~30 GB/s of achieved host memory bandwidth
that is ~0.5e9 parameters/s. DeepSpeedCPUAdam (SIMD) is several times faster (ZeRO-Offload,
arXiv:2101.06840, CPU-Adam evaluation), but the worker uses torch.optim.AdamW (see
launcher/backends/deepspeed/emit.py)."""


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
    profile's measured `attention_tflops[dtype]` when it has one.

    Attention FLOPs are counted over the whole L x S score matrix, as torch.utils.flop_counter
    counts them, although a causal fused kernel computes only the pairs its mask keeps (about
    half; FlashAttention-2, arXiv:2307.08691 sec. 3.1.1). Both rates are in that convention: the
    MFU figures behind `matmul_efficiency` count attention in full (PaLM, arXiv:2204.02311 app. B:
    6N + 12LHQT per token; Megatron-LM, arXiv:2104.04473: 96BslH^2(1 + s/6H + V/16lH)), and
    mode=calibrate times a causal kernel against the full count."""
    peak = cluster.peak_tflops[dtype] * 1e12 * cluster.matmul_efficiency
    attention = flops.get(f"attention_{phase}", 0.0)
    attention_rate = cluster.attention_tflops.get(dtype, 0.0) * 1e12 or peak
    return (flops[phase] - attention) / peak + attention / attention_rate


def estimate_speed(flops_per_micro_batch: Mapping[str, float], strategy: Strategy, workload: Workload,
                   cluster: Cluster, *, num_params: int, grad_accum_steps: int, dp_size: int,
                   knobs: Optional[Mapping] = None, num_trainable_params: Optional[int] = None, counts=None,
                   spec=None) -> SpeedEstimate:
    """Time of one optimizer step and cluster throughput for one candidate.

    compute_s = (F + B) x grad_accum / (peak_tflops[dtype] x 1e12 x matmul_efficiency), with F, B
    the forward and backward FLOPs of one micro-batch (backward includes recomputation under
    gradient checkpointing); step_s = compute_s + exposed_comm_s + offload_s;
    tokens_per_s = micro_batch x grad_accum x dp x seq_len / step_s. The backend's `comm`
    (launcher/backends/<name>/comm.py) gives the communication and may rescale compute (pipelines).
    `num_trainable_params` (default `num_params`) sizes gradients and optimizer work (PEFT);
    fully sharded strategies gather all `num_params`. `knobs`: config group name -> its dataclass
    (a group absent from it: its defaults).

    With `counts` (launcher/host_time.py `StepCounts` of the traced step) the host terms are
    added: on CPU processes step_s = compute_s + dispatch + activation traffic + optimizer +
    framework copies + collectives (all exposed; `host_time_s`); on a GPU, kernel launches are
    asynchronous, so compute_s = max(FLOP time, ops x op_overhead_s) (launch-bound small
    kernels) and the rest is unchanged.
    """
    knobs = registry_knobs(**(knobs or {}))
    trainable = num_params if num_trainable_params is None else num_trainable_params
    dtype = compute_dtype(workload.precision)
    if dtype not in cluster.peak_tflops:
        raise ConfigError(f"hardware {cluster.hardware!r} has no peak_tflops.{dtype}; "
                          f"add hardware.peak_tflops.{dtype}=<dense TFLOP/s>")
    forward_s = flop_time_s(flops_per_micro_batch, "forward", cluster, dtype)
    backward_s = flop_time_s(flops_per_micro_batch, "backward", cluster, dtype)
    x = CommInput(strategy, workload, cluster, (forward_s + backward_s) * grad_accum_steps, forward_s, backward_s,
                  trainable, num_params, dp_size, grad_accum_steps, knobs, spec)
    backend = backend_of(strategy)
    compute_s, comm_s, exposed_s, elem_bytes = backend.comm(x)
    offload_s = offload_time_s(strategy, cluster, num_params, trainable, dp_size,
                               grad_accum_steps, elem_bytes)
    host = {}
    if counts is not None:
        compute_s, exposed_s, host = _with_host_terms(counts, x, backend, compute_s, exposed_s)
    framework_s = framework_overhead_s(cluster, strategy, counts, grad_accum_steps)
    step_s = compute_s + exposed_s + offload_s + sum(v for k, v in host.items() if k != "comm_s") + framework_s
    tokens = workload.micro_batch_size * grad_accum_steps * dp_size * workload.seq_len
    breakdown = {
        "compute_s": compute_s, "comm_s": comm_s, "exposed_comm_s": exposed_s,
        "offload_s": offload_s, "flops": (flops_per_micro_batch["forward"]
                                          + flops_per_micro_batch["backward"]) * grad_accum_steps,
        "compute_dtype": dtype, "bus_bandwidth_gbps": bus_bandwidth_gbps(cluster), "comm_bytes_per_elem": elem_bytes,
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


STAGE_SCALED = ("forward_ops", "backward_ops", "optimizer_ops", "activation_elements", "copy_bytes",
                "num_modules", "num_param_tensors")  # launcher/host_time.py StepCounts, per pipeline stage


def _with_host_terms(counts, x: CommInput, backend, compute_s: float, exposed_s: float):
    """(compute_s, exposed comm_s, host terms) with launcher/host_time.py's terms (estimate_speed),
    as the backend's `host_equivalent` strategy has them on CPU processes (none for a backend
    without one); on a GPU the launch floor of every backend's step. A pipeline stage launches its
    share (1 / pp_size) of the layers' ops for each of its micro-batches."""
    workload, cluster = x.workload, x.cluster
    if cluster.device != "cpu":
        stage = max(1, x.strategy.pp_size)
        ops = (counts.forward_ops + counts.backward_ops) * x.accum / stage + counts.optimizer_ops
        return max(compute_s, ops * cluster.op_overhead_s), exposed_s, {}
    he = backend.host_equivalent(x) if backend.host_equivalent else None
    if he is None:
        return compute_s, exposed_s, {}
    torch_run = he.style.torch_amp
    model_bytes = 4 if workload.precision == "32-true" or (torch_run and workload.precision.endswith("-mixed")) else 2
    master_bytes = model_bytes if torch_run else (2 if workload.precision == "bf16-true" else 4)
    grad_bytes = model_bytes if torch_run else (4 if workload.precision == "32-true" else 2)
    share = he.stage_share  # a pipeline stage's part of the model and of each micro-batch
    if share != 1:
        counts = replace(counts, **{f: getattr(counts, f) * share for f in STAGE_SCALED})
    host = host_time_s(counts, he.style, workload, cluster, trainable=int(x.trainable * share),
                       num_params=int(x.num_params * share), dp=x.dp, accum=x.accum, model_bytes=model_bytes,
                       master_bytes=master_bytes, grad_bytes=grad_bytes)
    for term in ("dispatch_s", "activation_traffic_s"):  # per micro-batch: stretched by a pipeline's idle time
        host[term] *= he.idle_factor
    host["comm_s"] += he.extra_comm_s
    return compute_s, host["comm_s"], host

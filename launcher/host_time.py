"""Host-side time of a training step: what FLOPs do not count. On CPU processes it is most of the
step of a small model; on a GPU only op dispatch matters, and only when it outruns the kernels.

Terms, per optimizer step (inputs from the traced step, `step_counts`; rates from the hardware
profile, measured by mode=calibrate, launcher/calibrate.py):
1. dispatch: every op the traced forward, backward and (traced torch) optimizer allocate an
   output for costs `op_overhead_s` (Python, dispatcher, allocator, autograd node). The number
   of storages the trace allocates is the op count (an in-place op allocates nothing and is
   missed; a view is not an allocation: a lower bound).
2. activation traffic: what the forward and backward allocate, by the class of the op that
   allocated it (launcher/steptrace.py `OpClass`, recorded by the tracer):
   - elementwise outputs are produced at `elementwise_gelems_per_s` (calibrated with a chain of
     elementwise ops on fresh outputs: on CPU, first-touch page faults of new allocations cost
     more than the arithmetic; default memory_bandwidth_gbps / 12: an fp32 op reads two inputs
     and writes one output). Counted in elements, not bytes: ATen's CPU kernels compute bf16/fp16
     elementwise ops in fp32, converting on load and store
     (aten/src/ATen/cpu/vec/vec256/vec256_bf16.h `binary_op_as_fp32`), so a 16-bit element costs
     about what an fp32 one does;
   - copies (casts, clones, cat, gathers, zero fills: no arithmetic) read and write their
     output's bytes at `memory_bandwidth_gbps`, the calibrated copy rate;
   - outputs of ops with a FLOP formula (matmul, attention) are left out: their time, output
     included, is the FLOP term.
3. optimizer: foreach AdamW (torch/optim/adam.py `_multi_tensor_adam`, weight decay 0, no
   amsgrad) touches each element 19 times: lerp_(m, g) 3, mul_(v) 2, addcmul_(v, g, g) 4,
   sqrt 2, div_ 2, add_(eps) 2, addcdiv_(p, m, d) 4; gradient clipping (clip_grad_norm_: a norm
   read, then a scaling mul_) 3 more. Over all trainable elements for DDP and ZeRO-0, over the
   rank's partition for ZeRO-1/2/3, in the master dtype; a 16-bit access costs what a 4-byte one
   does (ATen computes 16-bit elementwise ops in fp32, term 2).
4. framework passes over gradients and master weights:
   - averaging: every reduction first divides the gradients it reduces by the data-parallel size,
     one elementwise pass (torch DDP reducer.cpp `bucket_view.div_(div_factor_)`; DeepSpeed
     stage_1_and_2.py `average_tensor` and engine.py `allreduce_bucket` `div_`);
   - copies (memory-bound): ZeRO-1/2 copy each gradient into the reduction bucket, flatten each
     bucket for its all-reduce and copy the result back (stage_1_and_2.py
     `reduce_independent_p_g_buckets_and_remove_grads`, `allreduce_and_copy_with_multiple_ranks`),
     copy it into the partition (`copy_grads_in_partition`), flatten the partition for the step and
     cast it to the master dtype (`step`: `flatten(averaged_gradients)`, `.to(fp32)`) and, after
     the step, copy the master partition into the 16-bit flat buffer; ZeRO-0 flattens the
     gradients for the all-reduce and copies them back (engine.py `allreduce_and_copy`); ZeRO-3
     copies gradients into its partition (stage3.py `__add_grad_to_ipg_bucket`, `partition_grads`),
     flattens and casts it (`_prepare_fp32_grad_for_sub_group`) and copies the master into the
     16-bit partition. DDP with gradient_as_bucket_view writes gradients in its buckets: no copy;
   - DeepSpeed's 16-bit gradient checks: ZeRO-1/2 with bf16 (`bf16.check_grad_overflow`, default
     true) or fp16 test the partition's gradients for inf/nan with an amax and an amin pass
     (runtime/utils.py `has_inf_or_nan`), ZeRO-3 only with fp16 (stage3.py
     `_overflow_check_and_loss_scale_update`); ZeRO 1-3 cast each 16-bit gradient to fp32 for the
     norm (`get_grad_norm_direct`: `g.to(get_norm_dtype())`), a copy. ZeRO-0 with a 16-bit model
     (fp16/unfused_optimizer.py `FP16_UnfusedOptimizer.step`) tests all gradients the same way
     (`CheckOverflow.check`), casts them to fp32 for the norm (`get_weight_norm`: `p.data.float()`)
     and for its fp32 masters, and copies the masters back into the 16-bit parameters.
   Elementwise passes run at the elementwise rate, copies at the memory bandwidth.
5. collectives, fully exposed on CPU (gloo's threads share the cores with compute): per call
   `collective_latency_s`, plus the bus bytes at the calibrated bandwidth of the call's collective,
   dtype and message size (`bus_gbps`: gloo's all-gather is several times slower than its
   all-reduce, its 16-bit sums slower than fp32 ones, and messages of a few hundred KB slower per
   byte than large ones).
   Calls: DDP one all-reduce per bucket (the first bucket holds 1 MiB,
   torch.distributed `_DEFAULT_FIRST_BUCKET_BYTES`, then `bucket_cap_mb`) and one buffer
   broadcast per forward (broadcast_buffers=True); DeepSpeed ZeRO-0 one all-reduce per 500M
   elements (its `HostStyle.flat_buckets`: launcher/backends/deepspeed/layout.py
   `no_retain_buckets`); ZeRO-1/2 (and LowLevelZero's, colossalai/cpu.py) one all-reduce
   per gradient bucket, ZeRO-3 one
   reduce-scatter (which gloo runs several times slower than an all-reduce of the same bytes), the
   buckets filled up to `reduce_bucket_size` elements gradient by gradient (`reduce_buckets`);
   ZeRO-1/2 one all-gather per `allgather_bucket_size` elements of the partition after the step; ZeRO-3 one all-gather per module with a parameter above
   `stage3_param_persistence_threshold` in forward (kept gathered for backward, as
   launcher/backends/deepspeed/zero3.py `gathered_param_bytes` finds by default); ZeRO 1-3 steps add two
   small all-reduces (ZERO_STEP_COLLECTIVES); the worker's loss all-reduce and per-step
   all_gather_object (launcher/worker/train.py) are two more.
6. ZeRO-3 module hooks: DeepSpeed wraps every module with parameters in pre/post forward and
   backward hooks (deepspeed/runtime/zero/parameter_offload.py `_register_deepspeed_module`)
   that run Python bookkeeping even when nothing is gathered; each of the 4 hook calls per
   module costs ZERO3_HOOK_OPS dispatched ops (assumption, see the constant).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from launcher.collectives import fill_buckets
from launcher.config import DDPConfig
from launcher.memory.common import full_depth_numels
from launcher.steptrace import OpClass
from launcher.types import Cluster, Workload

GB = 1e9
MIB = 2**20
ADAMW_ACCESSES_PER_ELEM = 19
CLIP_ACCESSES_PER_ELEM = 3
DDP_FIRST_BUCKET_BYTES = 1 * MIB
WORKER_COLLECTIVES_PER_STEP = 2
ZERO_STEP_COLLECTIVES = 2
"""ZeRO 1-3 `step` all-reduces an overflow flag (stage_1_and_2.py / stage3.py `check_overflow`) and
the squared gradient norm (`scaled_global_norm`) over the data-parallel group."""
ZERO3_HOOK_OPS = 20
"""Dispatched-op equivalents of one DeepSpeed ZeRO-3 module hook call (assumption: each hook walks
the module's parameters, updates the trace/prefetch coordinator and checks states, a few dozen
Python calls; the value makes ZeRO-3's measured overhead on the tiny Llama, all parameters
persistent, about right, see docs/accuracy.md)."""


@dataclass(frozen=True)
class HostStyle:
    """The data-parallel mechanics whose host terms (3-6) a strategy pays on CPU processes, as its
    backend describes them (launcher/backends/base.py `HostEquivalent`); this module prices them.

    - `reduction`: 'ddp_reducer', torch DDP's reducer (bucketed all-reduces of every gradient once
      per optimizer step, a buffer broadcast per forward; `torch_ddp`); 'flat', all-reduces of the
      flat buffers `flat_buckets` makes of the gradient sizes, once per step (DeepSpeed ZeRO-0);
      'zero', ZeRO-style partitioning (stage 1 and 2 all-reduce `reduce_bucket_size`-element
      buckets and all-gather the updated partition in `allgather_bucket_size`-element calls,
      stage 3 reduce-scatters the buckets; stage 2 and 3 reduce every micro-batch).
    - `torch_amp`: the model keeps its fp32 parameters and gradients under a *-mixed precision
      (torch autocast); otherwise the framework runs a 16-bit model with fp32 masters.
    - `flattens`: the framework flattens the partition and casts it to the master dtype, and at
      stage 1 and 2 flattens each all-reduced bucket and copies the result back (DeepSpeed).
    - `sixteen_bit_checks`: with 16-bit gradients, the overflow test (amax and amin passes; at
      stage 3 only with fp16) and the fp32 cast for the gradient norm (DeepSpeed).
    - `module_hooks`: ZeRO-3 per-module hooks and all-gathers of the gathered parameters
      (DeepSpeed, term 6)."""

    reduction: str
    zero_stage: int = 0
    bucket_cap_mb: float = 0.0  # 'ddp_reducer': its bucket size, MiB (`torch_ddp`)
    reduce_bucket_size: int = 0
    allgather_bucket_size: int = 0
    flat_buckets: Optional[Callable] = None
    torch_amp: bool = False
    flattens: bool = False
    sixteen_bit_checks: bool = False
    module_hooks: bool = False

    @property
    def partitioned(self) -> bool:
        """Optimizer states (and masters) split over the data-parallel ranks."""
        return self.reduction == "zero"


def torch_ddp(bucket_cap_mb: float = DDPConfig.bucket_cap_mb) -> HostStyle:
    """torch DistributedDataParallel's reducer (torch/nn/parallel/distributed.py, reducer.cpp), with
    `bucket_cap_mb` MiB buckets (default: the ddp group's default, DDP's own)."""
    return HostStyle("ddp_reducer", bucket_cap_mb=bucket_cap_mb, torch_amp=True)


@dataclass(frozen=True)
class StepCounts:
    """Per micro-batch, at the real depth, from the traced step (`step_counts`)."""

    forward_ops: float
    backward_ops: float
    optimizer_ops: float  # storages the traced torch optimizer allocates (0 if not traced)
    activation_elements: float  # elements of elementwise-op outputs the forward and backward allocate
    copy_bytes: float  # bytes of copy-op outputs the forward and backward allocate
    num_modules: float  # modules owning parameters
    gathered_modules: float  # ZeRO-3: modules with a parameter above the persistence threshold
    gathered_numel: float  # ZeRO-3: elements of the parameters above the persistence threshold
    num_param_tensors: float = 0.0  # parameter tensors of the model (framework per-tensor overhead)
    grad_numels: tuple = ()  # trainable parameters' elements at the real depth, in backward order (buckets)


def step_counts(traces, persistence_threshold: int) -> StepCounts:
    """Counts of a `TraceSet` extrapolated to full depth (launcher/steptrace.py `at_depth`)."""
    def allocs(phase, op_class=None, elements=False):
        def fn(t):
            a, b = t.phases[phase]
            sel = (t.alloc >= a) & (t.alloc < b)
            if t.op_class is not None:  # a kernel's workspace row is no op of its own
                sel &= t.op_class != OpClass.WORKSPACE
            if op_class is not None:  # hand-built traces without op classes: all elementwise
                sel &= (t.op_class == op_class) if t.op_class is not None else op_class == OpClass.ELEMENTWISE
            if not elements:
                return float(t.nbytes[sel].sum()) if op_class is not None else float(sel.sum())
            size = t.itemsize[sel] if t.itemsize is not None else 4
            return float((t.nbytes[sel] // size).sum())
        return traces.at_depth(fn)

    def fwd_bwd(op_class, elements):
        return allocs("forward", op_class, elements) + allocs("backward", op_class, elements)

    def modules(t, gathered_only=False):
        names = {}
        for name, numel in zip(t.params.names, t.params.numel):
            mod = name.rsplit(".", 1)[0]
            names[mod] = max(names.get(mod, 0), int(numel))
        return float(sum(1 for n in names.values() if n > persistence_threshold or not gathered_only))

    return StepCounts(
        forward_ops=allocs("forward"), backward_ops=allocs("backward"), optimizer_ops=allocs("optimizer"),
        activation_elements=fwd_bwd(OpClass.ELEMENTWISE, True), copy_bytes=fwd_bwd(OpClass.COPY, False),
        num_modules=traces.at_depth(modules), gathered_modules=traces.at_depth(lambda t: modules(t, True)),
        gathered_numel=traces.at_depth(lambda t: float(t.params.numel[t.params.numel > persistence_threshold].sum())),
        num_param_tensors=traces.at_depth(lambda t: float(len(t.params.numel))),
        grad_numels=tuple(reversed(full_depth_numels(traces.depth2, traces.num_layers))))


def reduce_buckets(counts: StepCounts, trainable: int, bucket_numel: int) -> list[float]:
    """Elements of each reduction call of one gradient reduction in `bucket_numel`-element buckets,
    filled in backward order as DeepSpeed ZeRO-1/2/3 and ColossalAI LowLevelZero fill them
    (launcher/collectives.py `fill_buckets`). Without the gradient sizes: full buckets and the
    remainder. A rank holding a shard of the model (tensor parallel: `trainable` is its share)
    holds that share of each gradient."""
    total = sum(counts.grad_numels)
    if not total:
        full, rest = divmod(trainable, bucket_numel)
        return [float(bucket_numel)] * int(full) + ([float(rest)] if rest or not full else [])
    sizes = [n * trainable / total for n in counts.grad_numels]
    return [sum(sizes[k] for k in group) for group in fill_buckets(sizes, bucket_numel)]


def elementwise_elems_per_s(cluster: Cluster) -> float:
    """Fresh elementwise output elements per second (term 2): the calibrated rate, else the memory
    bandwidth over 12 bytes (an fp32 op reads two inputs and writes one output)."""
    if cluster.elementwise_gelems_per_s:
        return cluster.elementwise_gelems_per_s * 1e9
    return cluster.memory_bandwidth_gbps * GB / 12


def _call_s(num_calls: float, num_bytes: float, factor: float, gbps: float, cluster: Cluster) -> float:
    return num_calls * cluster.collective_latency_s + (num_bytes * factor / (gbps * GB) if gbps > 0 else 0.0)


def bus_gbps(cluster: Cluster, collective: str, elem_bytes: int, message_bytes: float | None = None) -> float:
    """Bus bandwidth of `collective` ('all_reduce' | 'all_gather' | 'reduce_scatter') on `elem_bytes`-byte
    elements: the calibrated `collective_gbps` of that dtype (16-bit -> bf16, else fp32; gloo sums
    bf16 slower than fp32) at the call's message size (the whole tensor reduced, gathered or
    scattered), interpolated linearly in log size between the calibrated sizes and held at the
    smallest and largest; without a size, the largest. With the per-call `collective_latency_s`
    this is the alpha-beta (Hockney) model: a call costs the latency plus bytes / bandwidth
    (calibrate.py takes the latency out of each timing, and times messages that are not in the
    CPU caches, as gradient buckets are not). Without a table, the profile's scalar bandwidths
    (reduce-scatter: the all-reduce's)."""
    table = cluster.collective_gbps.get(f"{collective}_{'bf16' if elem_bytes == 2 else 'fp32'}")
    if table:
        sizes = sorted(table)
        mib = sizes[-1] if message_bytes is None else message_bytes / MIB
        if mib <= sizes[0] or mib >= sizes[-1]:
            return table[sizes[0] if mib <= sizes[0] else sizes[-1]]
        hi = next(k for k in sizes if k >= mib)
        lo = sizes[sizes.index(hi) - 1]
        w = math.log(mib / lo) / math.log(hi / lo)
        return table[lo] + w * (table[hi] - table[lo])
    if collective == "all_gather":
        return cluster.all_gather_bandwidth_gbps or cluster.intra_node_bandwidth_gbps
    return cluster.intra_node_bandwidth_gbps


def reductions_per_step(style: HostStyle, accum: int) -> int:
    """Gradient reductions per optimizer step: DDP (no_sync until the last micro-batch), ZeRO-0 and
    ZeRO-1 reduce once; ZeRO-2/3 partition gradients, so they reduce every micro-batch."""
    return accum if style.partitioned and style.zero_stage >= 2 else 1


def comm_s(counts: StepCounts, style: HostStyle, cluster: Cluster, *, trainable: int, dp: int, accum: int,
           model_bytes: int, grad_bytes: int) -> float:
    """Exposed collective time per optimizer step on CPU (term 5), each call at the bandwidth of its
    collective and dtype (`bus_gbps`)."""
    ring = (dp - 1) / dp if dp > 1 else 0.0
    worker_s = WORKER_COLLECTIVES_PER_STEP * cluster.collective_latency_s
    if dp <= 1:
        return worker_s
    grads = trainable * grad_bytes

    def calls_s(collective: str, num_calls: float, num_bytes: float, factor: float, elem_bytes: int) -> float:
        """`num_calls` equal calls moving `num_bytes` in all."""
        gbps = bus_gbps(cluster, collective, elem_bytes, num_bytes / num_calls if num_calls else None)
        return _call_s(num_calls, num_bytes, factor, gbps, cluster)

    def buckets_s(collective: str, buckets: list[float], factor: float) -> float:
        return sum(calls_s(collective, 1, n * grad_bytes, factor, grad_bytes) for n in buckets)

    if style.reduction == "ddp_reducer":
        calls = 1 + max(0, math.ceil((grads - DDP_FIRST_BUCKET_BYTES) / (style.bucket_cap_mb * MIB)))
        return (worker_s + calls_s("all_reduce", calls, grads, 2 * ring, grad_bytes)
                + accum * cluster.collective_latency_s)
    if style.reduction == "flat":
        return worker_s + buckets_s("all_reduce", style.flat_buckets(counts.grad_numels or (trainable,)), 2 * ring)
    buckets = reduce_buckets(counts, trainable, style.reduce_bucket_size)
    if style.zero_stage in (1, 2):
        # DeepSpeed 0.19 ZeRO-1/2 all-reduce each bucket and keep their partition's slice
        # (`use_multi_rank_bucket_allreduce`, default true: stage_1_and_2.py `average_tensor` ->
        # `allreduce_and_scatter` -> `allreduce_bucket` -> dist.all_reduce); LowLevelZero
        # all-reduces each bucket (low_level_optim.py `_run_reduction`), at stage 2 too on CPU
        # processes, where the worker makes its reduce-scatter an in-place all-reduce
        # (launcher/backends/colossalai/cpu.py `_InPlaceReduceScatter`)
        per_reduction = buckets_s("all_reduce", buckets, 2 * ring)
    else:  # ZeRO-3 `reduce_scatter_coalesced` (dist.reduce_scatter_tensor)
        per_reduction = buckets_s("reduce_scatter", buckets, ring)
    worker_s += ZERO_STEP_COLLECTIVES * cluster.collective_latency_s
    reductions = reductions_per_step(style, accum)
    if style.zero_stage in (1, 2):
        part = trainable / dp
        gather = calls_s("all_gather", math.ceil(part / style.allgather_bucket_size), trainable * model_bytes, ring,
                         model_bytes)
        return worker_s + reductions * per_reduction + gather
    gathered = _call_s(counts.gathered_modules, 0, 0, 1.0, cluster)  # bytes: zero3_gather_bytes
    return worker_s + reductions * per_reduction + accum * gathered


def framework_copy_bytes(style: HostStyle, *, trainable: int, dp: int, accum: int, model_bytes: int,
                         master_bytes: int) -> float:
    """Bytes read + written by the framework's own copies per optimizer step (term 4)."""
    if style.reduction == "ddp_reducer":
        return 0.0
    part = trainable / dp
    cast = model_bytes + master_bytes if master_bytes != model_bytes else 0  # bytes per element of a dtype cast
    if style.reduction == "flat":  # + a 16-bit model's fp32 gradient casts and master copies back
        return accum * 4 * model_bytes * trainable + 2 * cast * trainable
    grads_in = accum * 2 * model_bytes * trainable + 2 * model_bytes * part
    if style.flattens:
        grads_in += (2 * model_bytes + cast) * part  # flatten the partition, cast it to the master dtype
        if style.zero_stage in (1, 2):  # flatten each bucket, copy the result back
            grads_in += reductions_per_step(style, accum) * 4 * model_bytes * trainable
    return grads_in + (master_bytes + model_bytes) * part


def gradient_passes(style: HostStyle, workload: Workload, *, trainable: int, dp: int, accum: int,
                    model_bytes: int) -> tuple[float, float]:
    """(elements of elementwise passes, bytes of copies) over gradients per optimizer step beyond
    `framework_copy_bytes`: the averaging division of every reduction, DeepSpeed's 16-bit
    overflow test and fp32 norm cast (term 4)."""
    if dp <= 1:
        return 0.0, 0.0
    elements = reductions_per_step(style, accum) * float(trainable)
    copies = 0.0
    if style.sixteen_bit_checks and model_bytes == 2:
        checked = trainable / dp if style.partitioned else float(trainable)
        if style.zero_stage < 3 or workload.precision.startswith("16"):
            elements += 2 * checked  # has_inf_or_nan: amax and amin
        copies += (model_bytes + 4) * checked  # norm: cast to fp32
    return elements, copies


def host_time_s(counts: StepCounts, style: HostStyle, workload: Workload, cluster: Cluster, *, trainable: int,
                num_params: int, dp: int, accum: int, model_bytes: int, master_bytes: int, grad_bytes: int) -> dict:
    """Seconds per optimizer step of each host term (module docstring), for CPU processes."""
    mem_bps = cluster.memory_bandwidth_gbps * GB
    elem_s = elementwise_elems_per_s(cluster)
    ops = (counts.forward_ops + counts.backward_ops) * accum + counts.optimizer_ops
    hooks = 4 * counts.num_modules * ZERO3_HOOK_OPS * accum if style.module_hooks else 0.0
    opt_numel = trainable / dp if style.partitioned else trainable
    accesses = ADAMW_ACCESSES_PER_ELEM if workload.optimizer.startswith("adamw") else 4
    accesses += CLIP_ACCESSES_PER_ELEM
    zero3_gather_bytes = (counts.gathered_numel * model_bytes * (dp - 1) / dp * accum
                          if style.module_hooks else 0.0)
    gather_gbps = bus_gbps(cluster, "all_gather", model_bytes,
                           counts.gathered_numel * model_bytes / counts.gathered_modules if counts.gathered_modules else None)
    pass_elements, pass_copies = gradient_passes(style, workload, trainable=trainable, dp=dp, accum=accum,
                                                 model_bytes=model_bytes)
    return {
        "dispatch_s": (ops + hooks) * cluster.op_overhead_s,
        "activation_traffic_s": accum * (counts.activation_elements / elem_s + 2 * counts.copy_bytes / mem_bps),
        "optimizer_s": accesses * max(master_bytes, 4) * opt_numel / mem_bps,
        "framework_copy_s": (framework_copy_bytes(style, trainable=trainable, dp=dp, accum=accum,
                                                  model_bytes=model_bytes, master_bytes=master_bytes) + pass_copies)
        / mem_bps + pass_elements / elem_s,
        "comm_s": comm_s(counts, style, cluster, trainable=trainable, dp=dp, accum=accum, model_bytes=model_bytes,
                         grad_bytes=grad_bytes)
        + (zero3_gather_bytes / (gather_gbps * GB) if zero3_gather_bytes else 0.0),
    }

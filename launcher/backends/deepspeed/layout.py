"""DeepSpeed 0.19 ZeRO stages 0, 1, 2 (and ZeRO-Offload of the optimizer) on one rank, with a torch
optimizer passed as the client optimizer (what the worker does). Paths below are under
deepspeed/runtime/. The model is traced in the engine's dtype with no optimizer; everything the
engine and its optimizer wrapper allocate is added here, each term citing the code that allocates it.

Which wrapper runs (engine.py `_do_optimizer_sanity_check`, grad_accum_dtype left unset so it
equals the model dtype): stage 0 + fp32, and stage 0 + bf16-true (a bf16 model with no bf16
section in ds_config, launcher/backends/deepspeed/emit.py) -> the client optimizer itself; stage 0 + bf16/fp16 ->
`FP16_UnfusedOptimizer` (fp16/unfused_optimizer.py, also for bf16 as DDP_BFLOAT16; the flat
`FP16_Optimizer` only wraps a FusedAdam); stages 1-2 ->
`DeepSpeedZeroOptimizer` (zero/stage_1_and_2.py); stage 3 -> zero3.py.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from launcher.collectives import fill_buckets
from launcher.config import DeepSpeedConfig
from launcher.steptrace import Kind, StepTrace

from launcher.memory.common import (Layout, accumulated_gradients, add_modelled_states, at_traced_depth,
                                    first_ready_event, free_at_next_ready, full_depth_numels, grad_ready_order,
                                    layer_numel, optimizer_state_numel_factor, optimizer_step_scalar_bytes,
                                    optimizer_step_temp_bytes, trainable_params, trainable_shapes)

NCCL_START_ALIGNMENT_FACTOR = 2  # zero/stage_1_and_2.py __init__: "4-byte alignment/sizeof(fp16)"
MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000  # engine.py: stage-0 allreduce bucket, in elements


@dataclass(frozen=True)
class ZeroSetup:
    stage: int
    offload_optimizer: bool
    offload_params: bool
    model_bytes: int  # bytes per element of the 16-bit (or fp32) model
    master_bytes: int  # fp32 master / optimizer-state element (2 with bf16 master weights)
    optimizer: str  # HF optim name of the client torch optimizer
    ds: DeepSpeedConfig
    dp: int
    num_layers: int = 0  # the real model's depth, for terms not linear in depth (0: the traced depth)
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    # the embedding's output requires grad: transformers' activation_checkpointing_enable calls
    # enable_input_require_grads (modeling_utils.py), so a frozen embedding runs a backward hook
    input_grads: bool = False

    @property
    def overlap_comm(self) -> bool:
        """zero/config.py: `overlap_comm` defaults to True for stage 3 only."""
        return self.stage == 3 if self.ds.overlap_comm is None else bool(self.ds.overlap_comm)


def numels(trace: StepTrace) -> list[int]:
    return [int(trace.params.numel[i]) for i in trainable_params(trace)]


def flat_numel(total: int, dp: int) -> int:
    """stage_1_and_2.py __init__: the flat 16-bit buffer is padded to a multiple of
    `nccl_start_alignment_factor * dp` (`align_dense_tensors`); parameter_alignment off (default)."""
    alignment = NCCL_START_ALIGNMENT_FACTOR * dp
    return math.ceil(total / alignment) * alignment


def partition_mask(sizes: list[int], dp: int, rank: int) -> list[bool]:
    """Which parameters `rank`'s partition holds (stage_1_and_2.py `get_partition_info`): those
    starting inside [rank x part, (rank + 1) x part) of the flat buffer, plus the one crossing its
    start (`first_offset`); part = padded flat numel / dp (`flat_numel`)."""
    part = flat_numel(sum(sizes), dp) // dp
    lo, hi = rank * part, (rank + 1) * part
    out, start = [], 0
    for n in sizes:
        out.append(lo <= start < hi or start < lo < start + n)
        start += n
    return out


def grads_in_partition_numel(sizes: list[int], dp: int, rank: int | None = None) -> int:
    """stage_1_and_2.py `copy_grads_in_partition`: `grads_in_partition` holds the *whole* numel of
    every parameter in this rank's partition (`params_in_partition`, `partition_mask`). `rank`
    None: the worst rank."""
    ranks = range(dp) if rank is None else [rank]
    return max(sum(n for n, inside in zip(sizes, partition_mask(sizes, dp, r)) if inside) for r in ranks)


def norm_pieces(sizes: list[int], dp: int) -> list[int]:
    """Per rank, the elements of the largest gradient piece of its partition, which the gradient
    norm at the start of `step` converts to fp64: `get_grad_norm_direct` runs
    `torch.linalg.vector_norm(g.data.to(get_norm_dtype()))` over `averaged_gradients`, each
    parameter's gradient narrowed to the partition (`get_flat_partition(...,
    return_tensor_list=True)`), one piece at a time; `get_norm_dtype` is torch.double wherever the
    device has fp64 (zero/utils.py), CUDA and CPU included."""
    part = flat_numel(sum(sizes), dp) // dp
    best, start = [0] * dp, 0
    for n in sizes:
        end = start + n
        if n and part:  # the ranks whose partitions this parameter overlaps
            for r in range(start // part, min(dp - 1, (end - 1) // part) + 1):
                best[r] = max(best[r], min(end, (r + 1) * part) - max(start, r * part))
        start = end
    return best


def no_retain_buckets(sizes) -> list:
    """Elements of each flat buffer stage 0 all-reduces (engine.py `allreduce_no_retain` with
    `MEMORY_OPT_ALLREDUCE_SIZE`): a bucket is flushed once it holds more than that."""
    out, elements = [], 0
    for n in sizes:
        elements += n
        if elements > MEMORY_OPT_ALLREDUCE_SIZE:
            out.append(elements)
            elements = 0
    return out + ([elements] if elements else [])


def reduce_events(trace: StepTrace, bucket_numel: int) -> dict:
    """{parameter: traced ready event of the hook whose flush reduces its gradient, or None for the
    epilogue}: a bucket (`fill_buckets`) is flushed by the hook of the next bucket's first gradient
    (`reduce_ipg_grads`, which then copies each in-partition gradient, `copy_grads_in_partition`);
    what is left is reduced by the epilogue (`overlapping_partition_gradients_reduce_epilogue`)."""
    order = grad_ready_order(trace)
    groups = fill_buckets([int(trace.params.numel[i]) for i, _ in order], bucket_numel)
    out = {}
    for group, following in zip(groups, groups[1:] + [None]):
        event = order[following[0]][1] if following else None
        out.update((order[k][0], event) for k in group)
    return out


def stage1_unmoved_numel(sizes: list[int], dp: int, bucket_numel: int, rank: int | None,
                         contiguous_gradients: bool = True) -> int:
    """Gradient elements still in their parameters' own storages when ZeRO-1's `reduce_gradients`
    (no overlap_comm) allocates `rank`'s grads_in_partition. The walk goes in parameter order
    (`fill_buckets`); with contiguous_gradients each gradient of at most `reduce_bucket_size`
    elements is copied into the ipg bucket as it is added and its own storage dropped
    (`reduce_independent_p_g_buckets_and_remove_grads`: `grad_reduc.data = new_grad_tensor...`),
    larger ones stay; grads_in_partition comes at the flush of the first bucket holding a parameter
    of the rank's partition (`partition_mask`; `copy_grads_in_partition`). `rank` None: rank 0, the
    first to allocate it, a bound over ranks. Without contiguous_gradients nothing is moved."""
    if not contiguous_gradients:
        return sum(sizes)
    inside = partition_mask(sizes, dp, rank or 0)
    moved = 0
    for group in fill_buckets(sizes, bucket_numel):
        moved += sum(sizes[k] for k in group if sizes[k] <= bucket_numel)
        if any(inside[k] for k in group):
            break
    return sum(sizes) - moved


def first_flush_event(trace: StepTrace, bucket_numel: int):
    """The traced ready event at which the reduce bucket first overflows (`reduce_events`), else
    None (first flush at the epilogue)."""
    events = [e for e in reduce_events(trace, bucket_numel).values() if e is not None]
    return min(events) if events else None


def full_depth_flush_events(trace: StepTrace, num_layers: int, bucket_numel: int) -> list:
    """For each parameter of the real-depth model (`full_depth_numels` order), the traced event of
    the flush that reduces it (`reduce_events`; None: the epilogue). Parameters outside the layers
    map one to one; a real layer's parameter takes the earliest flush of the same parameter in any
    traced layer (the first real layer to reduce it runs first in backward)."""
    p = trace.params
    idx = trainable_params(trace)
    flushes = reduce_events(trace, bucket_numel)
    inf = float("inf")
    at = [inf if flushes.get(i) is None else flushes[i] for i in idx]
    in_layer = [k for k, i in enumerate(idx) if p.layer[i] >= 0]
    if not in_layer:
        return [None if e == inf else e for e in at]
    first, last = in_layer[0], in_layer[-1]
    layer_at: dict = {}
    for k in range(first, last + 1):
        layer_at.setdefault(int(p.layer[idx[k]]), []).append(at[k])
    per_param = [min(col) for col in zip(*layer_at.values())]
    out = at[:first] + per_param * num_layers + at[last + 1:]
    return [None if e == inf else e for e in out]


def gradient_partitions(trace: StepTrace, z: ZeroSetup) -> list[tuple[int, object]]:
    """Per rank, (numel, traced ready event or None for the epilogue) of `grads_in_partition`:
    the whole numel of the rank's partition's parameters at the real depth (`partition_mask`),
    allocated lazily by the first `copy_grads_in_partition`, i.e. at the first flush that reduces
    a gradient of its partition (`reduce_ipg_grads`: gradients outside the partition are only
    dropped, `clear_grad_attribute`). Stage 1 without overlap_comm reduces after backward
    (`reduce_gradients`): the epilogue for every rank."""
    depth = z.num_layers or trace.num_layers
    full = full_depth_numels(trace, depth)
    in_hooks = z.stage == 2 or z.overlap_comm
    flushes = full_depth_flush_events(trace, depth, z.ds.reduce_bucket_size) if in_hooks else [None] * len(full)
    part = flat_numel(sum(full), z.dp) // z.dp
    starts = [0]
    for n in full:
        starts.append(starts[-1] + n)
    out = []
    for rank in range(z.dp):
        lo, hi = rank * part, (rank + 1) * part
        a, b = bisect.bisect_left(starts, lo, 0, len(full)), bisect.bisect_left(starts, hi, 0, len(full))
        if a > 0 and starts[a - 1] < lo < starts[a]:  # the parameter crossing the partition's start
            a -= 1
        events = [e for e in flushes[a:b] if e is not None]
        out.append((starts[b] - starts[a], min(events) if events else None))
    return out


def rank_gradient_partition(trace: StepTrace, z: ZeroSetup, rank: int | None) -> tuple[int, object]:
    """`gradient_partitions` of one rank; `rank` None: the largest partition at the first flush
    (a bound over ranks)."""
    if rank is not None:
        return gradient_partitions(trace, z)[rank]
    full = full_depth_numels(trace, z.num_layers or trace.num_layers)
    in_hooks = z.stage == 2 or z.overlap_comm
    return (grads_in_partition_numel(full, z.dp),
            first_flush_event(trace, z.ds.reduce_bucket_size) if in_hooks else None)


def _states(layout: Layout, z: ZeroSetup, shapes: list[tuple], host: bool) -> None:
    """The optimizer states of the tensors it steps (`shapes`: one flat partition at ZeRO 1-2, each
    parameter at ZeRO-0), in the master dtype."""
    if add_modelled_states(layout, z.optimizer, shapes, z.master_bytes, host):
        return
    numel = sum(math.prod(s) for s in shapes)
    k = optimizer_state_numel_factor(z.optimizer)
    layout.add("optimizer_states", "optimizer_states",
               k * z.master_bytes * numel + optimizer_step_scalar_bytes(z.optimizer, len(shapes)),
               host=host)


def zero0_layout(trace: StepTrace, z: ZeroSetup) -> Layout:
    """Stage 0. Gradients are all-reduced after backward by `engine.buffered_allreduce_fallback` ->
    `allreduce_no_retain`, which flattens buckets of `MEMORY_OPT_ALLREDUCE_SIZE` elements
    (`allreduce_bucket`: `self.flatten(bucket)`, a copy) one at a time."""
    sizes = numels(trace)
    total = sum(sizes)
    largest = max(no_retain_buckets(sizes), default=0) if len(sizes) > 1 else 0
    e = z.model_bytes
    # at any depth a bucket holds at most MEMORY_OPT_ALLREDUCE_SIZE elements plus the gradient that
    # overflows it (`no_retain_buckets`); `reduce_bucket_size` is not used at stage 0
    cap = e * max(largest, MEMORY_OPT_ALLREDUCE_SIZE + max(sizes, default=0))
    if z.master_bytes == e:  # no wrapper: the client optimizer steps the model's own parameters
        # (fp32; or bf16-true, whose ds_config enables no bf16 mode: states in the parameters' dtype)
        layout = Layout.of(trace, reduce_events=1, step_events=1)
        layout.add("allreduce_flat", "buffers", largest * e, layout.reduce_ev(0), layout.reduce_ev(1), cap=cap)
        _states(layout, z, trainable_shapes(trace), host=False)
        layout.add("optimizer_step_temporaries", "optimizer_states",
                   optimizer_step_temp_bytes(z.optimizer, sizes, e), layout.step_ev(0), layout.step_ev(1))
        return _accumulating(layout, z)
    # FP16_UnfusedOptimizer (fp16/unfused_optimizer.py): `_configure_fp16_optimizer` (engine.py)
    # takes the flat FP16_Optimizer only for a FusedAdam client optimizer; the worker's, and the
    # stand-alone config's (`torch_adam`), is torch's. The model keeps its own 16-bit parameters.
    layout = Layout.of(trace, reduce_events=1, step_events=3)
    layout.add("fp32_master", "optimizer_states", 4 * total)  # __init__: p.clone().float() per parameter
    _states(layout, z, trainable_shapes(trace), host=False)  # initialize_optimizer_states: optimizer.step() at init
    layout.add("allreduce_flat", "buffers", largest * e, layout.reduce_ev(0), layout.reduce_ev(1), cap=cap)
    norm, s0, s1, s2 = (layout.step_ev(j) for j in range(4))
    # step(): get_weight_norm (runtime/utils.py) takes `p.data.float().norm()` of one gradient at a time
    layout.add("grad_norm_fp32_piece", "gradients", 4 * max(sizes, default=0), norm, s0)
    # then `fp32_param.grad = fp16_param.grad.to(fp32)` for every parameter; after optimizer.step()
    # each fp32 gradient is dropped as its master is copied back. The 16-bit gradients stay until
    # the engine's zero_grad after the step.
    layout.add("fp32_grads", "gradients", 4 * total, s0, s2)
    layout.add("optimizer_step_temporaries", "optimizer_states",
               optimizer_step_temp_bytes(z.optimizer, sizes, 4), s1, s2)
    return _accumulating(layout, z)


def _accumulating(layout: Layout, z: ZeroSetup) -> Layout:
    """Stage 0, and stage 1 without overlap_comm, reduce only at the accumulation boundary (engine.py
    `allreduce_gradients`; stage_1_and_2.py `reduce_gradients`): before it autograd sums the
    gradients (`accumulated_gradients`)."""
    if z.grad_accum_steps > 1:
        accumulated_gradients(layout)
    return layout


def zero12_layout(trace: StepTrace, z: ZeroSetup, rank: int | None = None) -> Layout:
    """Stages 1 and 2 (zero/stage_1_and_2.py `DeepSpeedZeroOptimizer`) on `rank` (None: a bound
    over ranks); ranks differ only by their gradient partition (`rank_gradient_partition`)."""
    sizes = numels(trace)
    e, m, dp = z.model_bytes, z.master_bytes, z.dp
    flat = flat_numel(sum(sizes), dp)
    part = flat // dp
    layout = Layout.of(trace, reduce_events=2, step_events=3)
    layout.drop_trainable_params()
    off = z.offload_optimizer
    layout.add("flat_16bit_params", "parameters", e * flat)  # __init__: bit16_groups_flat
    layout.add("fp32_master_partition", "optimizer_states", m * part, host=off)  # single_partition_of_fp32_groups
    _states(layout, z, [(part,)], host=off)  # one flat partition
    r0, r1 = layout.reduce_ev(0), layout.reduce_ev(1)
    norm, s0, s1, s2 = (layout.step_ev(j) for j in range(4))
    ready_first = int(layout.ev(first_ready_event(trace)))
    bucket = z.ds.reduce_bucket_size
    in_hooks = z.stage == 2 or z.overlap_comm  # process_gradients: partition_gradients or overlap_comm
    if z.ds.contiguous_gradients:  # setup_buckets at the first gradient hook; _release_ipg_buffers at the epilogue
        nbuf = 2 if z.overlap_comm else 1
        # at stage 1 the epilogue (and the release) runs only at the accumulation boundary, so with
        # several micro-batches the first one's buckets (`ready_for_gradients`) last to it
        start = 0 if z.stage == 1 and z.grad_accum_steps > 1 else ready_first
        layout.add("ipg_buckets", "buffers", nbuf * bucket * e, start, r1)
    g = layout.rows(Kind.GRAD)
    ready = layout.ev(trace.ready)
    if in_hooks:  # the gradient is copied into the bucket at its hook and autograd's copy dropped
        small = g & (trace.param >= 0)
        small &= trace.params.numel[trace.param.clip(0)] <= bucket
        layout.free[small] = ready[small]
        free_at_next_ready(layout, g & ~small, r0)
    else:  # stage 1: reduce_gradients after backward walks the parameters in order
        layout.free[g] = r0
        layout.add("grads_awaiting_reduction", "gradients",
                   e * stage1_unmoved_numel(sizes, dp, bucket, None if off else rank, z.ds.contiguous_gradients),
                   r0, r1)
        _accumulating(layout, z)
    if off:
        _offload_terms(layout, z, sizes, part)
        return layout
    gip, event = rank_gradient_partition(trace, z, rank)
    if z.num_layers:  # which parameters a partition holds depends on the real depth: written at the
        # traced depth as growing by at most a layer's share per layer, extrapolating to `gip`
        gip = at_traced_depth(gip, min(layer_numel(trace) / dp, gip / z.num_layers), trace, z.num_layers)
    flush = r0 if event is None else int(layout.ev(event))
    if in_hooks and z.grad_accum_steps > 1:  # every micro-batch reduces into the same partition
        flush = 0  # (`copy_grads_in_partition` adds into it after the first): alive from the step's start
    layout.add("grads_in_partition", "gradients", e * gip, flush, s1)
    # step(): the gradient norm (`norm_pieces`), then flatten(averaged_gradients) -> .to(the master
    # dtype) -> optimizer step -> grad = None; `.to` returns the flat tensor itself when the master
    # partition has the model's dtype (32-true: DeepSpeed's fp32 "master" of an fp32 model)
    pieces = norm_pieces(full_depth_numels(trace, z.num_layers or trace.num_layers), dp)
    layout.add("grad_norm_fp64_piece", "gradients", 8 * (max(pieces) if rank is None else pieces[rank]),
               norm, s0)
    if m == e:
        layout.add("flat_grad_partition", "gradients", e * part, s0, s2)
    else:
        layout.add("flat_grad_partition", "gradients", e * part, s0, s1)
        layout.add("fp32_grad_partition", "gradients", m * part, s0, s2)
    layout.add("optimizer_step_temporaries", "optimizer_states",
               optimizer_step_temp_bytes(z.optimizer, [part], m), s1, s2)
    return layout


def _offload_terms(layout: Layout, z: ZeroSetup, sizes: list[int], part: int) -> None:
    """ZeRO-Offload (stage_1_and_2.py, `cpu_offload`): the fp32 gradient partition
    (`initialize_optimizer_states`, kept), a 16-bit staging copy of the partition
    (`param_buffer_of_bit16_for_cpu_offload_groups`) and a largest-parameter staging buffer live in
    host RAM; `temp_grad_buffer_for_gpu_offload` stays on the device. The optimizer steps on host."""
    e, m = z.model_bytes, z.master_bytes
    largest = max(sizes) if sizes else 0
    layout.add("fp32_grad_partition", "gradients", m * part, host=True)
    layout.add("bit16_partition_staging", "buffers", e * part, host=True)
    layout.add("cpu_grad_staging", "buffers", e * largest, host=True)
    layout.add("device_grad_staging", "buffers", e * largest)
    s0, s1 = layout.step_ev(0), layout.step_ev(1)
    layout.add("optimizer_step_temporaries", "optimizer_states",
               optimizer_step_temp_bytes(z.optimizer, [part], m), s0, s1, host=True)

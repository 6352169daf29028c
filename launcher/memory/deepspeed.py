"""DeepSpeed 0.19 ZeRO stages 0, 1, 2 (and ZeRO-Offload of the optimizer) on one rank, with a torch
optimizer passed as the client optimizer (what the worker does). Paths below are under
deepspeed/runtime/. The model is traced in the engine's dtype with no optimizer; everything the
engine and its optimizer wrapper allocate is added here, each term citing the code that allocates it.

Which wrapper runs (engine.py `_do_optimizer_sanity_check`, grad_accum_dtype left unset so it
equals the model dtype): stage 0 + fp32, and stage 0 + bf16-true (a bf16 model with no bf16
section in ds_config, launcher/emit/deepspeed.py) -> the client optimizer itself; stage 0 + bf16/fp16 ->
`FP16_Optimizer` (fp16/fused_optimizer.py, also for bf16 as DDP_BFLOAT16); stages 1-2 ->
`DeepSpeedZeroOptimizer` (zero/stage_1_and_2.py); stage 3 -> zero3.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from launcher.config import DeepSpeedConfig
from launcher.steptrace import Kind, StepTrace

from .common import (Layout, at_traced_depth, first_ready_event, free_at_next_ready,
                     full_depth_numels, grad_ready_order, layer_numel, modelled_state_bytes,
                     optimizer_state_numel_factor,
                     optimizer_step_scalar_bytes, optimizer_step_temp_numel, trainable_params)

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


def grads_in_partition_numel(sizes: list[int], dp: int) -> int:
    """stage_1_and_2.py `copy_grads_in_partition`: `grads_in_partition` holds the *whole* numel of
    every parameter overlapping this rank's partition (`params_in_partition`,
    `get_partition_info`). Worst rank."""
    part = flat_numel(sum(sizes), dp) // dp
    worst, start = 0, 0
    bounds = []
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    for r in range(dp):
        lo, hi = r * part, (r + 1) * part
        worst = max(worst, sum(n for (a, b), n in zip(bounds, sizes) if a < hi and b > lo))
    return worst


def first_flush_event(trace: StepTrace, bucket_numel: int):
    """The traced ready event at which the reduce bucket first overflows
    (`reduce_independent_p_g_buckets_and_remove_grads`: `bucket.elements + param.numel() >
    self.reduce_bucket_size` -> `reduce_ipg_grads`), else None (first flush at the epilogue)."""
    elements = 0
    for i, event in grad_ready_order(trace):
        n = int(trace.params.numel[i])
        if elements and elements + n > bucket_numel:
            return event
        elements += n
    return None


def _states(layout: Layout, z: ZeroSetup, numel: int, num_tensors: int, host: bool) -> None:
    modelled = modelled_state_bytes(z.optimizer, [(numel,)], z.master_bytes)  # one flat partition
    if modelled is not None:
        layout.add("optimizer_states", "optimizer_states", modelled, host=host)
        return
    k = optimizer_state_numel_factor(z.optimizer)
    layout.add("optimizer_states", "optimizer_states",
               k * z.master_bytes * numel + optimizer_step_scalar_bytes(z.optimizer, num_tensors),
               host=host)


def zero0_layout(trace: StepTrace, z: ZeroSetup) -> Layout:
    """Stage 0. Gradients are all-reduced after backward by `engine.buffered_allreduce_fallback` ->
    `allreduce_no_retain`, which flattens buckets of `MEMORY_OPT_ALLREDUCE_SIZE` elements
    (`allreduce_bucket`: `self.flatten(bucket)`, a copy) one at a time."""
    sizes = numels(trace)
    total = sum(sizes)
    bucket, largest = 0, 0
    for n in sizes:  # allreduce_no_retain: flush once numel > numel_per_bucket
        bucket += n
        if bucket > MEMORY_OPT_ALLREDUCE_SIZE:
            largest, bucket = max(largest, bucket), 0
    largest = max(largest, bucket) if len(sizes) > 1 else 0
    e = z.model_bytes
    if z.master_bytes == e:  # no wrapper: the client optimizer steps the model's own parameters
        # (fp32; or bf16-true, whose ds_config enables no bf16 mode: states in the parameters' dtype)
        layout = Layout.of(trace, reduce_events=1, step_events=1)
        layout.add("allreduce_flat", "buffers", largest * e, layout.reduce_ev(0), layout.reduce_ev(1))
        _states(layout, z, total, len(sizes), host=False)
        layout.add("optimizer_step_temporaries", "optimizer_states",
                   e * optimizer_step_temp_numel(z.optimizer, sizes), layout.step_ev(0), layout.step_ev(1))
        return layout
    # FP16_Optimizer (fp16/fused_optimizer.py)
    layout = Layout.of(trace, reduce_events=1, step_events=2)
    layout.drop_trainable_params()
    layout.add("flat_16bit_params", "parameters", e * total)  # __init__: fp16_groups_flat
    layout.add("fp32_master", "optimizer_states", 4 * total)  # __init__: fp32_groups_flat
    _states(layout, z, total, 1, host=False)  # initialize_optimizer_states: optimizer.step() at init
    layout.add("allreduce_flat", "buffers", largest * e, layout.reduce_ev(0), layout.reduce_ev(1))
    s0, s1, s2 = layout.step_ev(0), layout.step_ev(1), layout.step_ev(2)
    # step(): [p.grad.to(fp32) ...] then _flatten_dense_tensors -> fp32 flat grad; p.grad = None
    layout.add("fp32_grad_list", "gradients", 4 * total, s0, s1)
    layout.add("fp32_flat_grad", "gradients", 4 * total, s0, s2)
    g = layout.rows(Kind.GRAD)
    layout.free[g] = s1
    layout.add("optimizer_step_temporaries", "optimizer_states",
               4 * optimizer_step_temp_numel(z.optimizer, [total]), s1, s2)
    return layout


def zero12_layout(trace: StepTrace, z: ZeroSetup) -> Layout:
    """Stages 1 and 2 (zero/stage_1_and_2.py `DeepSpeedZeroOptimizer`)."""
    sizes = numels(trace)
    e, m, dp = z.model_bytes, z.master_bytes, z.dp
    flat = flat_numel(sum(sizes), dp)
    part = flat // dp
    layout = Layout.of(trace, reduce_events=2, step_events=2)
    layout.drop_trainable_params()
    off = z.offload_optimizer
    layout.add("flat_16bit_params", "parameters", e * flat)  # __init__: bit16_groups_flat
    layout.add("fp32_master_partition", "optimizer_states", m * part, host=off)  # single_partition_of_fp32_groups
    _states(layout, z, part, 1, host=off)
    r0, r1 = layout.reduce_ev(0), layout.reduce_ev(1)
    s0, s1, s2 = layout.step_ev(0), layout.step_ev(1), layout.step_ev(2)
    ready_first = int(layout.ev(first_ready_event(trace)))
    bucket = z.ds.reduce_bucket_size
    in_hooks = z.stage == 2 or z.overlap_comm  # process_gradients: partition_gradients or overlap_comm
    if z.ds.contiguous_gradients:  # setup_buckets at the first gradient hook; _release_ipg_buffers at the epilogue
        nbuf = 2 if z.overlap_comm else 1
        layout.add("ipg_buckets", "buffers", nbuf * bucket * e, ready_first, r1)
    g = layout.rows(Kind.GRAD)
    ready = layout.ev(trace.ready)
    if in_hooks:  # the gradient is copied into the bucket at its hook and autograd's copy dropped
        small = g & (trace.param >= 0)
        small &= trace.params.numel[trace.param.clip(0)] <= bucket
        layout.free[small] = ready[small]
        free_at_next_ready(layout, g & ~small, r0)
        event = first_flush_event(trace, bucket)
        flush = r0 if event is None else int(layout.ev(event))
    else:  # stage 1: reduce_gradients after backward walks the parameters in order
        layout.free[g] = r0
        flush = r0
        first_bucket = 0
        for n in sizes:
            if first_bucket + n > bucket:
                break
            first_bucket += n
        layout.add("grads_awaiting_reduction", "gradients", e * (sum(sizes) - first_bucket), r0, r1)
    if off:
        _offload_terms(layout, z, sizes, part)
        return layout
    gip = grads_in_partition_numel(sizes, dp)
    if z.num_layers:  # which parameters straddle the partition boundary depends on the real depth
        gip = at_traced_depth(grads_in_partition_numel(full_depth_numels(trace, z.num_layers), dp),
                              layer_numel(trace) / dp, trace, z.num_layers)
    layout.add("grads_in_partition", "gradients", e * gip, flush, s1)
    # step(): flatten(averaged_gradients) -> .to(fp32) -> optimizer step -> grad = None
    layout.add("flat_grad_partition", "gradients", e * part, s0, s1)
    layout.add("fp32_grad_partition", "gradients", m * part, s0, s2)
    layout.add("optimizer_step_temporaries", "optimizer_states",
               m * optimizer_step_temp_numel(z.optimizer, [part]), s1, s2)
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
               m * optimizer_step_temp_numel(z.optimizer, [part]), s0, s1, host=True)

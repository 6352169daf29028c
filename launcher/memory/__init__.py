"""Per-rank peak memory of a parallel strategy, from a traced training step.

Method. `launcher.trace` records one real training step of the model at two depths under fake
tensors on the CPU (`StepTrace`: one row per storage with its allocation and free events). For a
strategy, each depth's trace becomes a `Layout`: the rows the framework keeps (with lifetimes
changed the way it changes them, e.g. gradients copied into buckets and freed when ready), plus
the storages the framework allocates itself (flat parameter buffers, master weights, optimizer
states, reduction buckets, gradient partitions, step temporaries), each citing the code that
allocates it (ddp.py, deepspeed.py, zero3.py). The live-bytes curve of the layout is maximised per
phase (forward, backward incl. the post-backward reduction, optimizer step) and per segment of a
phase (cut where the decoder layers start and end, `Layout.segments`); each segment maximum is
extrapolated linearly to the real depth from the two traced depths and the largest is the phase's
peak (`TraceSet.phase_max` rule: the maximum can move between segments as depth grows); the
estimate is the largest phase. The curve is the steady state from the second step on: optimizer states, created
lazily in the first step, are live during every later forward and backward.

Devices. cuda: allocations round to 512 B; peak reserved comes from replaying the layout's
allocation sequence (twice, for the steady state) through a simulator of the caching allocator
(allocator.py); cuBLAS workspaces are added to allocated and reserved, the CUDA context and NCCL
buffers to the device total (runtime.py). cpu (gloo processes): peak live tensor bytes, no rounding,
no runtime terms, and the offloaded host storages counted too (they are the same memory).

Ranks. All ranks of a data-parallel group hold the same bytes except under ZeRO 1-2, where each
rank's gradient partition holds the whole of the parameters its partition overlaps and is
allocated at the first reduction of one of them (deepspeed.py `gradient_partitions`): each
rank is estimated (`MemoryEstimate.per_rank_peak_allocated_bytes`), the worst is the headline.

Assumptions (also listed in each `MemoryEstimate.notes`): one parameter group; the
worker's torch optimizer (`adamw_torch` = foreach AdamW); DeepSpeed `grad_accum_dtype` and
`communication_data_type` unset; ZeRO-3 gathered parameters live from their module's forward to
their own backward when the reuse distance keeps them all (zero3.py `gathered_param_terms`),
else they are added at full depth to the forward and backward peaks. Not
modelled: the model-construction phase (its peak is below the step's), gradient-clipping norm
scalars, the loss scaler's small tensors, process-group internal scratch, side-stream late frees.
"""
from __future__ import annotations

from dataclasses import replace

from launcher.config import ColossalAIConfig, DDPConfig, DeepSpeedConfig
from launcher.errors import ConfigError
from launcher.steptrace import TraceSet
from launcher.types import Cluster, MemoryEstimate, Strategy, Workload

from . import runtime
from .common import (DTYPE_BYTES, PHASES, extrapolate_layouts, extrapolate_peaks, host_bytes,
                     phase_peaks)
from launcher.backends.ddp.layout import DDP_NOTES, SINGLE_NOTES, ddp_layout
from launcher.backends.deepspeed.layout import ZeroSetup, gradient_partitions, zero0_layout, zero12_layout
from .replay import peak_reserved_bytes
from launcher.backends.deepspeed.zero3 import full_depth_numels, gathered_param_bytes, zero3_layout

TORCH_PRECISION = {  # precision -> (param_dtype, autocast_dtype) for torch backends
    "32-true": ("float32", None), "bf16-mixed": ("float32", "bfloat16"),
    "16-mixed": ("float32", "float16"), "bf16-true": ("bfloat16", None), "16-true": ("float16", None)}
DEEPSPEED_PRECISION = {"32-true": "float32", "bf16-mixed": "bfloat16", "16-mixed": "float16",
                       "bf16-true": "bfloat16"}
TRACE_OPTIMIZER = {"adamw_torch": "adamw_foreach", "adamw_torch_foreach": "adamw_foreach",
                   "adamw_torch_fused": "adamw_fused", "sgd": "sgd", "adafactor": "adafactor",
                   "adamw_bnb_8bit": "none", "paged_adamw_8bit": "none"}  # 8-bit: modelled (ddp.py)


def deepspeed_support_problem(strategy: Strategy, precision: str, device: str | None = None) -> str:
    """Why DeepSpeed cannot run this precision with the worker's torch optimizer, or '': the
    emitter's rule (launcher/backends/deepspeed/emit.py `unsupported_reason`), which the worker applies too."""
    from launcher.backends.deepspeed.emit import unsupported_reason

    return unsupported_reason(strategy, precision, device) or ""


def trace_request(strategy: Strategy, workload: Workload) -> dict:
    """The `TraceKey` fields this strategy needs: how the framework runs the model.

    torch DDP runs the model as the user asked (*-mixed: fp32 parameters under autocast; *-true:
    parameters in that dtype) and the torch optimizer is traced for real. DeepSpeed bf16/fp16
    runs a 16-bit model without autocast (engine.py `_configure_distributed_model` casts the
    module) and its optimizer memory is modelled from its source, so no optimizer is traced;
    bf16-true is a bf16 model with bf16 optimizer states (ZeRO 1-3: bf16 master weights; ZeRO-0:
    the client optimizer steps the bf16 parameters themselves)."""
    if strategy.backend == "ddp":
        param_dtype, autocast = TORCH_PRECISION[workload.precision]
        return {"param_dtype": param_dtype, "autocast_dtype": autocast,
                "optimizer": TRACE_OPTIMIZER[workload.optimizer]}
    if strategy.backend == "deepspeed":
        problem = deepspeed_support_problem(strategy, workload.precision)
        if problem:
            raise ConfigError(problem)
        # ZeRO-3 replaces F.linear by a function that saves each Linear's input (trace.py `_zero3_linear`)
        return {"param_dtype": DEEPSPEED_PRECISION[workload.precision], "autocast_dtype": None,
                "optimizer": "none", **({"zero3_linear": True} if strategy.zero_stage == 3 else {})}
    if strategy.backend == "colossalai":
        from launcher.backends.colossalai.layout import trace_request as colossalai_trace_request

        return colossalai_trace_request(strategy, workload)
    raise ConfigError(f"strategy={strategy.name}: backend {strategy.backend!r} has no memory model")


def _zero_setup(traces: TraceSet, strategy: Strategy, workload: Workload, ds, dp: int) -> ZeroSetup:
    return ZeroSetup(stage=strategy.zero_stage, offload_optimizer=strategy.offload_optimizer,
                     offload_params=strategy.offload_params,
                     model_bytes=DTYPE_BYTES[DEEPSPEED_PRECISION[workload.precision]],
                     master_bytes=2 if workload.precision == "bf16-true" else 4,
                     optimizer=workload.optimizer, ds=ds, dp=dp, num_layers=traces.num_layers)


def _layouts(traces: TraceSet, strategy: Strategy, workload: Workload, ds, ddp, dp: int):
    depths = (traces.depth1, traces.depth2)
    if strategy.backend == "ddp":
        wrapped = strategy.name != "single"
        return ([ddp_layout(t, ddp, dp, workload.optimizer, wrapped) for t in depths],
                DDP_NOTES if wrapped else SINGLE_NOTES, None)
    trace_request(strategy, workload)  # raises if unsupported
    z = _zero_setup(traces, strategy, workload, ds, dp)
    build = {0: zero0_layout, 1: zero12_layout, 2: zero12_layout, 3: zero3_layout}[z.stage]
    layouts = [build(t, z) for t in depths]
    gathered = None
    if z.stage == 3:  # all kept: on the per-depth curve (zero3.py gathered_param_terms)
        gathered = gathered_param_bytes(full_depth_numels(traces.depth1, traces.num_layers, frozen_too=True), z)
        gathered = (0, True) if gathered[1] else gathered
    return layouts, deepspeed_notes(z, gathered), gathered


def _rank_layouts(traces: TraceSet, strategy: Strategy, workload: Workload, ds, dp: int) -> list:
    """[(ranks, [layout at depth 1, layout at depth 2])], one per set of ranks with the same
    gradient partition (deepspeed.py `gradient_partitions`), for ZeRO 1-2 without offload over
    more than one rank; [] for the others (every rank holds the same bytes)."""
    if strategy.backend != "deepspeed" or strategy.zero_stage not in (1, 2) or strategy.offload_optimizer or dp < 2:
        return []
    z = _zero_setup(traces, strategy, workload, ds, dp)
    depths = (traces.depth1, traces.depth2)
    groups: dict = {}
    for rank, key in enumerate(zip(*(gradient_partitions(t, z) for t in depths))):
        groups.setdefault(key, []).append(rank)
    return [(tuple(ranks), [zero12_layout(t, z, ranks[0]) for t in depths]) for ranks in groups.values()]


def deepspeed_notes(z: ZeroSetup, gathered) -> tuple:
    notes = [f"DeepSpeed ZeRO-{z.stage}: 16-bit (or fp32) model traced without optimizer; flat "
             "buffers, master weights, optimizer states, buckets and step temporaries modelled "
             "from deepspeed/runtime (see launcher/backends/deepspeed/layout.py, zero3.py).",
             f"reduce_bucket_size={z.ds.reduce_bucket_size} elements, overlap_comm={z.overlap_comm}, "
             f"contiguous_gradients={z.ds.contiguous_gradients}; allgather_bucket_size unused "
             "(all_gather_into_tensor writes into the flat buffer, runtime/utils.py all_gather_dp_groups)."]
    if z.master_bytes == 2 and z.stage == 0:
        notes.append("bf16-true at ZeRO-0: no bf16 section in ds_config, the model is handed over "
                     "in bf16 and the torch optimizer steps it directly (no master weights, bf16 "
                     "states; engine.py _do_optimizer_sanity_check returns no wrapper).")
    elif z.master_bytes == 2:
        notes.append("bf16-true: bf16.bf16_master_weights_and_grads and bf16_optimizer_states "
                     "must be set in ds_config (master, gradients and states in bf16).")
    if z.stage in (1, 2) and not z.offload_optimizer:
        notes.append("ZeRO-1/2 per rank: grads_in_partition holds the whole of every parameter the "
                     "rank's partition overlaps and is allocated at the first bucket flush that "
                     "reduces one of them (stage_1_and_2.py copy_grads_in_partition); the headline "
                     "is the worst rank.")
    if z.offload_optimizer:
        notes.append("ZeRO-Offload with a torch optimizer needs zero_force_ds_cpu_optimizer=false "
                     "(engine.py _configure_optimizer); master, states and fp32 gradients in host RAM.")
    if gathered is not None:
        notes.append("ZeRO-3 gathered parameters: " + (
            "each kept gathered from its module's forward fetch to its own backward (2 x model "
            "numel < stage3_max_reuse_distance), on the per-depth curve" if gathered[1] else
            "partly re-gathered per module, prefetch bucket added; added at full depth to the "
            "forward and backward peaks") + ".")
    return tuple(notes)


def estimate_memory(traces: TraceSet, strategy: Strategy, workload: Workload, cluster: Cluster,
                    ds: DeepSpeedConfig, ddp: DDPConfig, dp_size: int,
                    cai: ColossalAIConfig | None = None, attention_workspace_bytes: int = 0) -> MemoryEstimate:
    """Peak memory of the worst rank of `strategy` (module docstring: method and assumptions),
    with every rank's peak in `per_rank_peak_allocated_bytes` when ranks differ (ZeRO 1-2).
    ColossalAI strategies (colossalai.py) may add full-depth storages per phase (`extra`).
    `attention_workspace_bytes`: a GPU attention kernel's backward workspace
    (runtime.py `flash_attention_backward_bytes`), added to the backward peak on cuda."""
    extra: dict = {}
    if strategy.backend == "colossalai":
        from launcher.backends.colossalai.layout import colossalai_memory

        traces, layouts, notes, extra = colossalai_memory(traces, strategy, workload, ddp,
                                                          cai or ColossalAIConfig(), dp_size, cluster.device)
        gathered, groups = None, []
    else:
        groups = _rank_layouts(traces, strategy, workload, ds, dp_size)
        if groups:  # ZeRO 1-2: only the per-rank layouts are built
            notes, gathered = deepspeed_notes(_zero_setup(traces, strategy, workload, ds, dp_size), None), None
        else:
            layouts, notes, gathered = _layouts(traces, strategy, workload, ds, ddp, dp_size)
    if cluster.device == "cuda" and attention_workspace_bytes:
        extra = {**extra, "backward": dict(extra.get("backward", {}))}
        extra["backward"]["buffers"] = extra["backward"].get("buffers", 0) + attention_workspace_bytes
        notes = tuple(notes) + (FLASH_NOTE,)
    if not groups:
        return _estimate(traces, layouts, notes, gathered, extra, cluster, dp_size)
    per_rank, worst = {}, None
    for ranks, layouts in groups:  # the allocator replay (cuda reserved) only for the worst rank
        totals = _phase_totals(traces, layouts, gathered, extra, cluster)
        per_rank.update((r, totals[2]) for r in ranks)
        if worst is None or totals[2] > worst[1][2]:
            worst = (layouts, totals)
    est = _estimate(traces, worst[0], notes, gathered, extra, cluster, dp_size, totals=worst[1])
    return replace(est, per_rank_peak_allocated_bytes=tuple(per_rank[r] for r in range(dp_size)))


def _phase_totals(traces: TraceSet, layouts: list, gathered, extra: dict, cluster: Cluster):
    """(total per phase, breakdown per phase, peak allocated) of one rank from its layouts at the
    two traced depths (allocated includes the cuBLAS workspaces on cuda)."""
    cuda = cluster.device == "cuda"
    rounding = runtime.allocator_rounding_bytes(cluster.device)
    peaks = [phase_peaks(lay, rounding, with_host=not cuda) for lay in layouts]
    ext = extrapolate_peaks(layouts, peaks, traces.num_layers)
    total, breakdown = dict(ext.total), {ph: dict(b) for ph, b in ext.breakdown.items()}
    gathered_bytes = gathered[0] if gathered else 0
    for ph in ("forward", "backward"):
        total[ph] += gathered_bytes
        breakdown[ph]["parameters"] += gathered_bytes
    for ph, cats in extra.items():
        for cat, nbytes in cats.items():
            total[ph] += nbytes
            breakdown[ph][cat] += nbytes
    workspace = runtime.cublas_workspace_bytes(cluster.sm_arch) if cuda else 0
    return total, breakdown, max(total.values()) + workspace


def _estimate(traces: TraceSet, layouts: list, notes, gathered, extra: dict, cluster: Cluster,
              dp_size: int, totals=None) -> MemoryEstimate:
    """The estimate of one rank from its layouts at the two traced depths (`totals`: their
    `_phase_totals`, when already computed)."""
    cuda = cluster.device == "cuda"
    total, breakdown, _ = totals or _phase_totals(traces, layouts, gathered, extra, cluster)
    phase = max(PHASES, key=lambda ph: total[ph])
    host = extrapolate_layouts(layouts, [host_bytes(x) for x in layouts], traces.num_layers)
    bd = dict(breakdown[phase])
    if not cuda:
        peak = total[phase]
        bd["runtime"] = 0
        return MemoryEstimate(peak, peak, peak, host, bd, phase,
                              tuple(notes) + CPU_NOTES)
    workspace = runtime.cublas_workspace_bytes(cluster.sm_arch)
    allocated = total[phase] + workspace
    reserved = peak_reserved_bytes(layouts[-1], cluster.sm_arch, allocated, cluster.expandable_segments)
    outside = runtime.cuda_context_bytes(cluster.cuda_context_bytes) + runtime.nccl_bytes(dp_size)
    bd["runtime"] = workspace + outside
    expandable = (EXPANDABLE_NOTE,) if cluster.expandable_segments else ()
    return MemoryEstimate(allocated, reserved, reserved + outside, host, bd, phase,
                          tuple(notes) + GPU_NOTES + expandable)


FLASH_NOTE = ("GPU flash attention backward: its fp32 dq accumulator and, with grouped-query attention, "
              "K/V gradients expanded to every head (flash_api.cpp mha_bwd) are added to the backward peak.")
EXPANDABLE_NOTE = ("PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True here and the job inherits it: "
                   "the allocator replay grows one segment per pool by 2 MiB / 20 MiB pages.")
CPU_NOTES = (
    "CPU processes: peak live tensor bytes (what torch's MemTracker measures), no allocator "
    "rounding, no CUDA/NCCL terms; offloaded host storages are included in the peak (and "
    "also reported as host_bytes).",
)
GPU_NOTES = (
    "GPU: 512 B allocator rounding; peak reserved = peak allocated + the cache a caching-allocator "
    "replay of the step at the deeper traced depth holds above its live bytes (single stream, "
    "default settings); cuBLAS workspaces 2 x 8.125 MiB (32 MiB each on sm90+) in allocated.",
    "device total = reserved + CUDA context (hardware setting) + NCCL per process group "
    "(544 MiB for 2 ranks, 688 MiB for more: NVIDIA/nccl issue 964, one group assumed).",
    "breakdown: parameters..buffers at the allocated peak; runtime = cuBLAS + context + NCCL.",
)

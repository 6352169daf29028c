"""DeepSpeed's memory model entry points: the trace it needs and its `LayoutSet` (layouts in
layout.py for ZeRO 0-2 and zero3.py for ZeRO-3)."""
from __future__ import annotations

from launcher.backends.base import LayoutSet
from launcher.backends.deepspeed.emit import unsupported_reason
from launcher.backends.deepspeed.layout import ZeroSetup, gradient_partitions, norm_pieces, zero0_layout, zero12_layout
from launcher.backends.deepspeed.zero3 import (all_kept_gathered, full_depth_numels, gathered_numels,
                                               gathered_param_bytes, zero3_layout)
from launcher.errors import ConfigError
from launcher.memory.common import DTYPE_BYTES
from launcher.precision import FRAMEWORK
from launcher.steptrace import TraceSet
from launcher.types import Strategy, Workload


def trace_request(strategy: Strategy, workload: Workload) -> dict:
    """DeepSpeed bf16/fp16 runs a 16-bit model without autocast (engine.py
    `_configure_distributed_model` casts the module) and its optimizer memory is modelled from its
    source, so no optimizer is traced; bf16-true is a bf16 model with bf16 optimizer states (ZeRO
    1-3: bf16 master weights; ZeRO-0: the client optimizer steps the bf16 parameters themselves).
    ZeRO-3 replaces F.linear by a function that saves each Linear's input (trace.py `_zero3_linear`)."""
    problem = unsupported_reason(strategy, workload.precision)
    if problem:
        raise ConfigError(problem)
    return {"param_dtype": FRAMEWORK[workload.precision], "autocast_dtype": None,
            "optimizer": "none", **({"zero3_linear": True} if strategy.zero_stage == 3 else {})}


def memory(traces: TraceSet, strategy: Strategy, workload: Workload, knobs, dp: int, device: str) -> LayoutSet:
    """ZeRO 1-2 without offload over several ranks: one group per set of ranks with the same
    gradient partition; otherwise one layout pair for every rank (ZeRO-3 adds its gathered
    parameters, zero3.py `gathered_param_terms`)."""
    ds = knobs["deepspeed"]
    z = _zero_setup(traces, strategy, workload, ds, dp)
    groups = _rank_layouts(traces, strategy, workload, ds, dp)
    if groups:
        return LayoutSet(groups=tuple((tuple(r), tuple(lay)) for r, lay in groups), traces=traces,
                         notes=deepspeed_notes(z, None))
    build = {0: zero0_layout, 1: zero12_layout, 2: zero12_layout, 3: zero3_layout}[z.stage]
    layouts = tuple(build(t, z) for t in (traces.depth1, traces.depth2))
    gathered = None
    if z.stage == 3:  # all kept: on the per-depth curve (zero3.py gathered_param_terms)
        # when some are released, so is an embedding with `input_grads` (it is reused furthest
        # away): gathered at the start of forward and the end of backward, away from the peaks
        gathered = (0, True) if all_kept_gathered(traces.depth1, z) else gathered_param_bytes(
            full_depth_numels(traces.depth1, traces.num_layers, frozen_too=True,
                              numel=gathered_numels(traces.depth1)), z)
    return LayoutSet(groups=(((), layouts),), traces=traces, notes=deepspeed_notes(z, gathered), gathered=gathered)


def _zero_setup(traces: TraceSet, strategy: Strategy, workload: Workload, ds, dp: int) -> ZeroSetup:
    return ZeroSetup(stage=strategy.zero_stage, offload_optimizer=strategy.offload_optimizer,
                     offload_params=strategy.offload_params,
                     model_bytes=DTYPE_BYTES[FRAMEWORK[workload.precision]],
                     master_bytes=2 if workload.precision == "bf16-true" else 4,
                     optimizer=workload.state_optimizer, ds=ds, dp=dp, num_layers=traces.num_layers,
                     grad_accum_steps=workload.grad_accum_steps, input_grads=workload.gradient_checkpointing)


def _rank_layouts(traces: TraceSet, strategy: Strategy, workload: Workload, ds, dp: int) -> list:
    """[(ranks, [layout at depth 1, layout at depth 2])], one per set of ranks with the same
    gradient partition (deepspeed.py `gradient_partitions`), for ZeRO 1-2 without offload over
    more than one rank; [] for the others (every rank holds the same bytes)."""
    if strategy.backend != "deepspeed" or strategy.zero_stage not in (1, 2) or strategy.offload_optimizer or dp < 2:
        return []
    z = _zero_setup(traces, strategy, workload, ds, dp)
    depths = (traces.depth1, traces.depth2)
    pieces = norm_pieces(full_depth_numels(traces.depth2, traces.num_layers), dp)  # the step's norm
    groups: dict = {}
    for rank, key in enumerate(zip(*(gradient_partitions(t, z) for t in depths), pieces)):
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
            f"partly released and prefetched again, up to stage3_max_live_parameters="
            f"{z.ds.stage3_max_live_parameters} elements gathered at once ({gathered[0]:,} bytes, "
            "zero3.py gathered_param_bytes); added at full depth to the forward and backward peaks") + ".")
    return tuple(notes)

"""Per-rank peak memory of a parallel strategy, from a traced training step.

Method. `launcher.trace` records one real training step of the model at two depths under fake
tensors on the CPU (`StepTrace`: one row per storage with its allocation and free events). For a
strategy, each depth's trace becomes a `Layout`: the rows the framework keeps (with lifetimes
changed the way it changes them, e.g. gradients copied into buckets and freed when ready), plus
the storages the framework allocates itself (flat parameter buffers, master weights, optimizer
states, reduction buckets, gradient partitions, step temporaries), each citing the code that
allocates it (ddp.py, deepspeed.py, zero3.py). The step is rebuilt at the real depth from the two
depths' layouts (replay.py `full_depth_items`: the middle layer repeated, whole-model storages
grown) and its live-bytes curve is maximised per phase (forward, backward incl. the post-backward
reduction, optimizer step: `full_depth_peaks`). Where the layers cannot be told apart (no layer
bounds, depths 1 and 2) or storages live on the host, each phase is cut where the decoder layers
start and end (`Layout.segments`), each segment's maximum is extrapolated linearly to the real
depth and the largest is the phase's peak (`extrapolate_peaks`). The estimate is the largest
phase. The curve is the steady state from the second step on: optimizer states, created
lazily in the first step, are live during every later forward and backward.

Devices. cuda: allocations round to 512 B; peak reserved comes from replaying the layout's
allocation sequence, rebuilt at the real depth (twice, for the steady state), through a simulator
of the caching allocator (allocator.py, replay.py); a candidate fits on what the step needs (peak
allocated, the part of the cache an out-of-memory retry cannot release, context and NCCL); cuBLAS
workspaces are added to allocated and reserved, the CUDA context and NCCL buffers to the device
total (runtime.py). cpu (gloo processes): peak live tensor bytes, no rounding,
no runtime terms, and the offloaded host storages counted too (they are the same memory).

Ranks. All ranks of a data-parallel group hold the same bytes except under ZeRO 1-2, where each
rank's gradient partition holds the whole of the parameters its partition overlaps and is
allocated at the first reduction of one of them (deepspeed.py `gradient_partitions`): each
rank is estimated (`MemoryEstimate.per_rank_peak_allocated_bytes`), the worst is the headline.

Assumptions (also listed in each `MemoryEstimate.notes`): one parameter group; the
worker's torch optimizer (`adamw_torch` = foreach AdamW); DeepSpeed `grad_accum_dtype` and
`communication_data_type` unset; ZeRO-3 gathered parameters live from their module's forward to
their own backward when the reuse distance keeps them all (zero3.py `gathered_param_terms`),
else they are added at full depth to the forward and backward peaks. Before the step, a
backend may add a `setup` phase (LayoutSet.extra["setup"]: DDP's construction-time state
broadcast, launcher/backends/ddp/layout.py `construction_peak`), the estimate when it is the
largest. Building the model is the planner's (launcher/memory/host_build.py: on CPU processes the
host build's peak, the setup phase when larger). Not modelled: gradient-clipping norm
scalars, the loss scaler's small tensors, process-group internal scratch, side-stream late frees.
"""
from __future__ import annotations

from dataclasses import replace

from launcher.backends.base import LayoutSet
from launcher.backends.registry import backend_of
from launcher.lengths import VarlenRun
from launcher.steptrace import TraceSet, with_workspace
from launcher.types import Cluster, MemoryEstimate, Strategy, Workload

from launcher.memory import runtime
from launcher.memory.common import CATEGORIES, PHASES, extrapolate_layouts, extrapolate_peaks, host_bytes, phase_peaks
from launcher.memory.replay import full_depth_peaks, held_cache, varlen_held_cache


def trace_request(strategy: Strategy, workload: Workload) -> dict:
    """The `TraceKey` fields this strategy needs: how its backend runs the model
    (launcher/backends/<name>/ `trace_request`)."""
    return backend_of(strategy).trace_request(strategy, workload)


def layout_set(traces: TraceSet, strategy: Strategy, workload: Workload, knobs, dp_size: int,
               device: str) -> LayoutSet:
    """The backend's `LayoutSet` of this strategy (launcher/backends/<name>/ `memory`)."""
    return backend_of(strategy).memory(traces, strategy, workload, knobs, dp_size, device)


def estimate(traces: TraceSet, strategy: Strategy, workload: Workload, cluster: Cluster, knobs,
             dp_size: int, attention_workspace_bytes: int = 0, replay_memo=None,
             varlen: VarlenRun | None = None) -> MemoryEstimate:
    """Peak memory of the worst rank of `strategy` (module docstring: method and assumptions),
    with every rank's peak in `per_rank_peak_allocated_bytes` (by global rank, from the
    LayoutSet's groups) when ranks differ (ZeRO 1-2, pipeline stages).
    `knobs`: config group name -> its dataclass (the backend reads its own).
    `attention_workspace_bytes`: a GPU attention kernel's backward workspace per call
    (runtime.py `flash_attention_backward_bytes`): on cuda, the size of the workspace rows the
    trace holds after each fused attention backward's outputs (steptrace.py `with_workspace`), so it
    counts only while a layer's attention backward runs and goes through the allocator replay;
    added to the whole backward phase only for traces without such rows.
    `replay_memo` (replay.py `ReplayMemo`): allocator replay results kept on disk.
    `varlen` (launcher/lengths.py): on cuda, the cache is also replayed over micro-batches of
    varying length (replay.py `varlen_held_cache`) and the larger of the two is kept."""
    per_call = None
    if cluster.device == "cuda" and attention_workspace_bytes:
        per_call = with_workspace(traces, attention_workspace_bytes)
        if per_call is not None:
            traces = per_call
            if varlen is not None:
                short_ws = with_workspace(varlen.short_traces, varlen.attention_workspace_bytes)
                varlen = replace(varlen, short_traces=short_ws) if short_ws is not None else varlen
    ls = layout_set(traces, strategy, workload, knobs, dp_size, cluster.device)
    short = None
    if varlen is not None and cluster.device == "cuda":
        short = layout_set(varlen.short_traces, strategy, varlen.short, knobs, dp_size, cluster.device)
        short = short if len(short.groups) == len(ls.groups) else None
    traces, notes, gathered, extra = ls.traces, tuple(ls.notes), ls.gathered, dict(ls.extra)
    if varlen is not None and cluster.device == "cuda" and short is None:
        notes += (VARLEN_MISMATCH_NOTE.format(profile=varlen.profile, short=varlen.short.seq_len),)
    if cluster.device == "cuda" and attention_workspace_bytes:
        if per_call is None:  # no fused attention backward in the trace: at the backward peak
            extra = {**extra, "backward": dict(extra.get("backward", {}))}
            extra["backward"]["buffers"] = extra["backward"].get("buffers", 0) + attention_workspace_bytes
        notes = notes + (FLASH_NOTE if per_call is not None else FLASH_PHASE_NOTE,)
    communicators = backend_of(strategy).communicators(strategy, dp_size)
    nccl = runtime.communicators_bytes(
        communicators, nccl_release(cluster), cluster.nccl_channels, cluster.nccl_transport,
        cluster.gpus_per_node, p2p_read=cluster.sm_arch == 80, env=cluster.nccl_env) if cluster.device == "cuda" else 0
    if cluster.device == "cuda" and nccl:
        notes += (communicators_note(communicators, nccl, cluster),)
    nvls = nvls_bytes(communicators, cluster)
    if nvls:
        nccl += nvls
        notes += (NVLS_NOTE.format(mib=nvls / 2**20, version=cluster.nccl_version),)
    if len(ls.groups) == 1 and not ls.groups[0][0]:
        return _estimate(traces, list(ls.groups[0][1]), notes, gathered, extra, cluster, nccl,
                         replay_memo=replay_memo, varlen=_varlen(varlen, short, 0, workload))
    per_rank, worst = {}, None
    for g, (ranks, layouts) in enumerate(ls.groups):  # the allocator replay (cuda reserved) only for the worst rank
        totals = _phase_totals(traces, list(layouts), gathered, extra, cluster)
        per_rank.update((r, totals[2]) for r in ranks)
        if worst is None or totals[2] > worst[1][2]:
            worst = (list(layouts), totals, g)
    est = _estimate(traces, worst[0], notes, gathered, extra, cluster, nccl, totals=worst[1],
                    replay_memo=replay_memo, varlen=_varlen(varlen, short, worst[2], workload))
    return replace(est, per_rank_peak_allocated_bytes=tuple(per_rank[r] for r in sorted(per_rank)))


def _varlen(varlen: VarlenRun | None, short: LayoutSet | None, group: int, workload: Workload):
    """(short layouts of rank group `group`, their TraceSet, batch lengths, long and short tokens,
    profile name) for `_estimate`, or None."""
    if varlen is None or short is None:
        return None
    return (list(short.groups[group][1]), varlen.short_traces, varlen.batches, workload.seq_len,
            varlen.short.seq_len, varlen.profile)


def _phase_totals(traces: TraceSet, layouts: list, gathered, extra: dict, cluster: Cluster):
    """(total per phase, breakdown per phase, peak allocated) of one rank from its layouts at the
    two traced depths (allocated includes the cuBLAS workspaces on cuda)."""
    cuda = cluster.device == "cuda"
    rounding = runtime.allocator_rounding_bytes(cluster.device)
    ext = full_depth_peaks(layouts[0], layouts[-1], traces.num_layers, rounding, device_only=cuda)
    if ext is None:  # the two depths' peaks extrapolated per segment
        peaks = [phase_peaks(lay, rounding, with_host=not cuda) for lay in layouts]
        ext = extrapolate_peaks(layouts, peaks, traces.num_layers)
    total, breakdown = dict(ext.total), {ph: dict(b) for ph, b in ext.breakdown.items()}
    gathered_bytes = gathered[0] if gathered else 0
    for ph in ("forward", "backward"):
        total[ph] += gathered_bytes
        breakdown[ph]["parameters"] += gathered_bytes
    for ph, cats in extra.items():
        if ph not in total:  # a phase outside the step (`setup`): the extra bytes are all of it
            total[ph], breakdown[ph] = 0, dict.fromkeys(CATEGORIES, 0)
        for cat, nbytes in cats.items():
            total[ph] += nbytes
            breakdown[ph][cat] += nbytes
    workspace = runtime.cublas_workspace_bytes(cluster.sm_arch) if cuda else 0
    return total, breakdown, max(max(total[ph] for ph in PHASES) + workspace, total.get("setup", 0))


def _estimate(traces: TraceSet, layouts: list, notes, gathered, extra: dict, cluster: Cluster,
              nccl: int, totals=None, replay_memo=None, varlen=None) -> MemoryEstimate:
    """The estimate of one rank from its layouts at the two traced depths (`nccl`: the bytes of its
    NCCL communicators on a GPU; `totals`: their `_phase_totals`, when already computed; `varlen`:
    `_varlen`)."""
    cuda = cluster.device == "cuda"
    total, breakdown, _ = totals or _phase_totals(traces, layouts, gathered, extra, cluster)
    phase = max(PHASES, key=lambda ph: total[ph])
    setup = total.get("setup", 0)  # before the step (a backend's construction-time peak)
    host = extrapolate_layouts(layouts, [host_bytes(x) for x in layouts], traces.num_layers)
    bd = dict(breakdown[phase])
    if not cuda:
        if setup > total[phase]:
            phase, bd = "setup", dict(breakdown["setup"])
        peak = total[phase]
        bd["runtime"] = 0
        return MemoryEstimate(peak, peak, peak, host, bd, phase,
                              tuple(notes) + CPU_NOTES)
    workspace = runtime.cublas_workspace_bytes(cluster.sm_arch)
    allocated = total[phase] + workspace
    outside = runtime.cuda_context_bytes(cluster.cuda_context_bytes) + nccl
    # a step whose live bytes alone exceed the GPU cannot fit, whatever the cache: its replay runs
    # at the traced depth, which costs a tenth of the real depth's
    over = allocated + outside > cluster.memory_bytes
    held, needed = held_cache(layouts[-1], cluster.sm_arch, cluster.expandable_segments, replay_memo,
                              shallower=None if over else layouts[0], num_layers=traces.num_layers)
    if varlen is not None and not over:
        short, short_traces, batches, long_len, short_len, profile = varlen
        v = varlen_held_cache((layouts[0], layouts[-1], traces.num_layers, long_len),
                              (short[0], short[-1], short_traces.num_layers, short_len),
                              list(batches), cluster.sm_arch, cluster.expandable_segments, replay_memo,
                              capacity=cluster.memory_bytes - outside)
        if v is None:
            notes = tuple(notes) + (VARLEN_MISMATCH_NOTE.format(profile=profile, short=short_len),)
        else:
            notes = tuple(notes) + (varlen_note(profile, batches, v[0], held),)
            held, needed = max(held, v[0]), max(needed, v[1])
    reserved, needed = allocated + held, allocated + needed
    if setup > allocated:  # no matmul has run yet, so no cuBLAS workspace; its buckets are fresh
        phase, bd, workspace = "setup", dict(breakdown["setup"]), 0  # segments (reserved >= allocated)
        allocated = setup
        reserved, needed = max(reserved, setup), max(needed, setup)
    bd["runtime"] = workspace + outside
    expandable = (EXPANDABLE_NOTE,) if cluster.expandable_segments else ()
    return MemoryEstimate(allocated, reserved, reserved + outside, host, bd, phase,
                          tuple(notes) + GPU_NOTES + expandable + ((OVER_NOTE,) if over else ()),
                          needed_bytes=needed + outside)


def nvls_bytes(communicators, cluster: Cluster) -> int:
    """NVLS multicast buffers of every communicator a rank holds (runtime.py `nvls_bytes`) on a
    GPU system with NVLink SHARP: a communicator of n ranks spans min(n, GPUs per node) GPUs of
    each of its nodes, with its NVLS channels' device peers (`nvls_peer_bytes`); none with
    NCCL_NVLS_ENABLE=0 in the job's environment."""
    if cluster.device != "cuda" or not cluster.nvls or not cluster.nccl_env.nvls:
        return 0
    version, per_node = nccl_release(cluster), cluster.gpus_per_node
    out = 0
    for n in communicators:
        local = min(n, per_node)
        buffers = runtime.nvls_bytes(local, version, -(-n // local))
        out += buffers + (runtime.nvls_peer_bytes(version, cluster.nccl_env) if buffers else 0)
    return out


def nccl_release(cluster: Cluster) -> tuple[int, int]:
    """(major, minor) of the job's NCCL (`Cluster.nccl_version`; unset: runtime.py's default)."""
    return runtime.nccl_version(cluster.nccl_version or runtime.DEFAULT_NCCL_VERSION)


def communicators_note(communicators, nccl: int, cluster: Cluster | None = None) -> str:
    """The NCCL communicators a rank holds (the backend's `communicators`) and, given the cluster,
    the NCCL release, channels and transport their buffers assume, for the notes."""
    groups = [n for n in communicators if n > 1]
    env = "" if cluster is None else runtime.nccl_env_note(cluster.nccl_env)
    setup = "" if cluster is None else (
        f" (NCCL {cluster.nccl_version or runtime.DEFAULT_NCCL_VERSION}, {cluster.nccl_channels} channels over "
        f"{cluster.nccl_transport}: hardware.nccl_version, nccl_channels, nccl_transport{'; ' + env if env else ''})")
    return (f"NCCL: {len(groups)} communicator{'s' if len(groups) > 1 else ''} per rank "
            f"({', '.join(f'{n} ranks' for n in groups)}: the default process group, then any its framework "
            f"creates), {nccl / 2**20:.0f} MiB outside the allocator{setup}.")


def varlen_note(profile: str, batches, held_varlen: int, held_fixed: int) -> str:
    """What the replay over batches of varying length found, for the candidate's notes."""
    b = sorted(batches)
    return (f"variable-length batches (training.length_profile={profile}): {len(b)} micro-batches of "
            f"{b[0]}-{b[-1]} tokens (median {b[len(b) // 2]}, the last at the peak length) replayed through "
            f"the allocator leave {held_varlen / 2**30:.2f} GiB cached above live bytes, against "
            f"{held_fixed / 2**30:.2f} GiB for batches all at the peak length; reserved keeps the larger. "
            "Sizes are interpolated per storage between the steps traced at two lengths.")


VARLEN_MISMATCH_NOTE = ("variable-length batches (training.length_profile={profile}): the step traced at {short} "
                        "tokens allocates other storages than at the peak length, so the cache is replayed "
                        "at the peak length only.")
FLASH_NOTE = ("GPU flash attention backward: its fp32 dq accumulator and, with grouped-query attention, "
              "K/V gradients expanded to every head (flash_api.cpp mha_bwd) are allocated inside each layer's "
              "attention backward, after its gradients, and freed as it returns.")
FLASH_PHASE_NOTE = ("GPU flash attention backward: its fp32 dq accumulator and, with grouped-query attention, "
                    "K/V gradients expanded to every head (flash_api.cpp mha_bwd) are added to the backward "
                    "peak (the traced step ran attention as separate ops).")
NVLS_NOTE = ("NCCL {version} with NVLink SHARP (hardware.nvls): {mib:.0f} MiB of multicast buffers and their "
             "channels' device peers per rank over its communicators of more than 2 GPUs of a node, outside "
             "the allocator (nccl src/transport/nvls.cc, src/channel.cc; launcher/memory/runtime.py nvls_bytes, "
             "nvls_peer_bytes).")
OVER_NOTE = ("peak allocated + CUDA context + NCCL alone exceed the GPU: the allocator cache in reserved "
             "comes from a replay at the traced depth, not the real one.")
EXPANDABLE_NOTE = ("PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True here and the job inherits it: "
                   "the allocator replay grows one segment per pool by 2 MiB / 20 MiB pages.")
CPU_NOTES = (
    "CPU processes: peak live tensor bytes (what torch's MemTracker measures), no allocator "
    "rounding, no CUDA/NCCL terms; offloaded host storages are included in the peak (and "
    "also reported as host_bytes).",
)
GPU_NOTES = (
    "GPU: 512 B allocator rounding; peak reserved = peak allocated + the cache a caching-allocator "
    "replay of the step rebuilt at the real depth holds above its live bytes (default settings; "
    "a framework's side-stream buffers cached per stream where its layout names them: FSDP2); "
    "cuBLAS workspaces 2 x 8.125 MiB (32 MiB each on sm90+) in allocated.",
    "fits: judged on the memory the step needs, peak allocated + the part of that cache an "
    "out-of-memory retry cannot release (the allocator frees its unused cached segments before it "
    "reports out of memory, CUDACachingAllocator.cpp release_cached_blocks) + CUDA context + NCCL; "
    "device total is what nvidia-smi shows when memory is plentiful.",
    "device total = reserved + CUDA context (hardware setting) + NCCL per communicator "
    "(ring and tree buffers of 12 MiB per channel, the p2p pool and cuMem's 2 MiB allocations by NCCL "
    "release: launcher/memory/runtime.py nccl_bytes).",
    "breakdown: parameters..buffers at the allocated peak; runtime = cuBLAS + context + NCCL.",
)

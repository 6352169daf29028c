"""Communication of the ColossalAI plugins (`comm`) and the DDP or ZeRO strategy whose CPU host
terms each shares (`host_equivalent`)."""
from __future__ import annotations

from launcher.backends.base import CommInput, HostEquivalent, default_group
from launcher.backends.colossalai.emit import num_microbatches, overlap
from launcher.backends.ddp.comm import ddp_reduction_s
from launcher.collectives import bus_bandwidth_gbps, fully_sharded_comm_s, ring_time_s, tp_comm_s
from launcher.host_time import HostStyle, torch_ddp
from launcher.types import Strategy


def colossalai_host_style(strategy: Strategy, cai, ddp) -> HostStyle:
    """The data-parallel host mechanics of a ColossalAI plugin (launcher/host_time.py): TorchDDPPlugin
    and HybridParallelPlugin's DP dimension without ZeRO are torch DDP (hybrid_parallel_plugin.py
    wraps the shard in DDP); LowLevelZeroPlugin and the ZeRO DP dimension copy gradients into
    `reduce_bucket_size_in_m` buckets, all-reduce (stage 1) or reduce-scatter (stage 2; an in-place
    all-reduce on CPU processes, cpu.py `_InPlaceReduceScatter`) them and all-gather the updated
    partition (colossalai/zero/low_level/low_level_optim.py `_run_reduction`, `step`: one
    all-gather of the whole flat partition per bucket store), without DeepSpeed's flattening
    copies and 16-bit checks."""
    if strategy.name == "cai_ddp" or strategy.zero_stage == 0:
        return torch_ddp(ddp.bucket_cap_mb)
    bucket = int(cai.reduce_bucket_size_in_m * 1024 * 1024)
    return HostStyle("zero", strategy.zero_stage, reduce_bucket_size=bucket, allgather_bucket_size=bucket)


def comm(x: CommInput) -> tuple:
    """(compute_s, comm_s, exposed_s, bytes per communicated element) of a ColossalAI candidate.

    - cai_ddp: torch DDP (fp32 gradients under autocast), launcher/backends/ddp/comm.py.
    - cai_zero1/2 (LowLevelZero) and the DP dimension of cai_tp/cai_pp with zero_stage 1/2:
      gradient reduce(-scatter) plus parameter all-gather, as DeepSpeed ZeRO-1/2 (ZeRO paper
      arXiv:1910.02054 sec. 7); overlapped with backward only with overlap_communication.
    - cai_gemini: chunk all-gathers in forward and backward and a gradient reduce-scatter per
      micro-batch, as ZeRO-3 (launcher/collectives.py `fully_sharded_comm_s`); chunks are gathered whole, so the volume is the
      model's.
    - tensor parallelism (tp > 1): the traced FLOPs and parameter counts are already one
      shard's (launcher/tp_shard.py), so DP gradients and parameters are the counts as given
      (1/tp of the model's); `tp_comm_s` adds the per-layer activation all-reduces.
    - pipeline parallelism (p > 1): the micro-batches of one optimizer step (grad_accum, a
      multiple of num_microbatches m) are the pipeline's micro-batches; the traced FLOPs cover all
      layers, a stage runs 1/p of them and holds 1/p of the parameters, and each 1F1B flush of m
      micro-batches idles (p-1)/(m+p-1) of its time (the bubble; GPipe arXiv:1811.06965, 1F1B arXiv:2104.04473
      sec. 2.2): compute_s / p / (1 - bubble). Stage-to-stage activation sends are not modelled
      (b x s x hidden per micro-batch, small next to the all-reduces)."""
    strategy, workload, cluster, cai = x.strategy, x.workload, x.cluster, x.knobs["colossalai"]
    dp, accum, backward_s, compute_s = x.dp, x.accum, x.backward_s, x.compute_s
    pp = strategy.pp_size
    elem = 4 if workload.precision == "32-true" or strategy.name == "cai_ddp" else 2
    bus = bus_bandwidth_gbps(cluster)
    grads, params = x.trainable * elem / pp, x.num_params * elem / pp  # the counts are a tp shard's
    if strategy.name == "cai_ddp":
        comm, exposed = ddp_reduction_s(x, grads)
    elif strategy.name == "cai_gemini":
        comm, exposed = fully_sharded_comm_s(dp, bus, params, grads, accum, x.forward_s, backward_s, True)
    elif strategy.zero_stage in (1, 2):
        comm = ring_time_s(grads, dp, bus, "reduce_scatter") * (accum if strategy.zero_stage == 2 else 1)
        gather = ring_time_s(grads, dp, bus, "all_gather")
        exposed = (max(0.0, comm - backward_s * accum) if overlap(cai, cluster.device) else comm) + gather
        comm += gather
    else:
        comm = exposed = ring_time_s(grads, dp, bus, "all_reduce")
    tp_s = tp_comm_s(strategy, workload, cluster, x.spec, accum, elem)
    comm, exposed = comm + tp_s, exposed + tp_s
    if pp > 1:
        m = num_microbatches(cai, pp)
        bubble = (pp - 1) / (m + pp - 1)
        compute_s = compute_s / pp / (1 - bubble)
    return compute_s, comm, exposed, elem


def host_equivalent(x: CommInput):
    """Gemini does not run on CPU processes: no host-time model (None). The others share the
    host terms of `colossalai_host_style`, on the traced parameters (a tp shard's under
    tensor parallelism), plus the tensor-parallel all-reduces. A pipeline stage (pp > 1) does 1/p
    of every micro-batch's host work and holds 1/p of the parameters; on a CPU process its host
    work is its compute, so the 1F1B bubble stretches it as `comm` stretches the FLOP time:
    (m + p - 1) / m for m micro-batches per flush. Stage-to-stage sends are not modelled."""
    strategy, workload = x.strategy, x.workload
    if strategy.name == "cai_gemini":
        return None
    style = colossalai_host_style(strategy, x.knobs["colossalai"], x.knobs["ddp"])
    pp = strategy.pp_size
    m = num_microbatches(x.knobs["colossalai"], pp)
    idle = (m + pp - 1) / m
    tp_s = tp_comm_s(strategy, workload, x.cluster, x.spec, x.accum, 4 if workload.precision == "32-true" else 2)
    return HostEquivalent(style, extra_comm_s=tp_s * idle, stage_share=1 / pp, idle_factor=idle)


def communicators(strategy: Strategy, dp: int) -> tuple[int, ...]:
    """NCCL communicators of one rank (Backend.communicators). TorchDDPPlugin, LowLevelZeroPlugin
    and GeminiPlugin run on the default process group when there is no extra data-parallel or
    tensor axis (low_level_zero_plugin.py `_get_default_group()`, gemini_plugin.py: the zero group
    is the default one when it spans the world). HybridParallelPlugin (cai_tp, cai_pp) builds a
    ProcessGroupMesh whose `get_group_along_axis` creates a `dist.new_group` per axis
    (colossalai/cluster/process_group_mesh.py): its data-parallel and tensor-parallel groups, besides
    the default group of the worker's per-step collectives; pipeline stages send activations to
    their neighbours, which NCCL runs on a 2-rank communicator per pair of ranks (torch
    ProcessGroupNCCL's point-to-point communicators): two for a middle stage (the worst rank),
    one with two stages. Assumption: the pipeline group itself carries no collective."""
    if strategy.tp_size == 1 and strategy.pp_size == 1:
        return (dp,)
    pairs = min(2, strategy.pp_size - 1)
    return (default_group(strategy, dp), dp, strategy.tp_size, *([2] * pairs))

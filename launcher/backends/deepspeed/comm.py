"""Communication of DeepSpeed ZeRO per optimizer step (speed.py assumptions 4-6): ZeRO-0 one
gradient all-reduce after backward (engine.py `_backward_epilogue`, exposed); ZeRO-1/2 a bucketed
reduce-scatter (every micro-batch at stage 2, stage_1_and_2.py
`reduce_ready_partitions_and_remove_grads`) overlapped only with `overlap_comm`, then an exposed
parameter all-gather; ZeRO-3 gathers in forward and backward and reduce-scatters per micro-batch."""
from __future__ import annotations

from launcher.backends.base import CommInput, HostEquivalent
from launcher.backends.deepspeed.layout import no_retain_buckets
from launcher.collectives import bucketed_reduction_s, bus_bandwidth_gbps, fully_sharded_comm_s, ring_time_s
from launcher.host_time import HostStyle
from launcher.types import Strategy


def overlap_comm(strategy: Strategy, ds) -> bool:
    """DeepSpeed's effective overlap_comm: the configured value, else True only for stage 3
    (deepspeed/runtime/zero/config.py `overlap_comm_valid`)."""
    return ds.overlap_comm if ds.overlap_comm is not None else strategy.zero_stage == 3


def comm(x: CommInput) -> tuple:
    """The engine holds a 16-bit model and communicates in it (engine.py `communication_data_type`)."""
    s, ds = x.strategy, x.knobs["deepspeed"]
    elem = 4 if x.workload.precision == "32-true" else 2
    bus, grads = bus_bandwidth_gbps(x.cluster), x.trainable * elem
    if s.zero_stage == 3:
        raw, exposed = fully_sharded_comm_s(x.dp, bus, x.num_params * elem, grads, x.accum, x.forward_s,
                                            x.backward_s, overlap_comm(s, ds))
    elif s.zero_stage == 0:
        raw, exposed = bucketed_reduction_s(grads, x.dp, bus, "all_reduce", 1, ds.reduce_bucket_size * elem,
                                            False, x.backward_s)
    else:
        raw, exposed = bucketed_reduction_s(grads, x.dp, bus, "reduce_scatter", x.accum if s.zero_stage == 2 else 1,
                                            ds.reduce_bucket_size * elem, overlap_comm(s, ds), x.backward_s)
        gather_s = ring_time_s(grads, x.dp, bus, "all_gather")
        raw, exposed = raw + gather_s, exposed + gather_s
    return x.compute_s, raw, exposed, elem


def host_style(stage: int, ds) -> HostStyle:
    """DeepSpeed's data-parallel host mechanics (launcher/host_time.py, terms 4-6): ZeRO-0
    all-reduces flat buffers of up to `MEMORY_OPT_ALLREDUCE_SIZE` elements (engine.py
    `allreduce_no_retain`, layout.py `no_retain_buckets`); ZeRO 1-3 partition with
    `reduce_bucket_size` / `allgather_bucket_size`; every stage flattens and casts the partition
    and checks 16-bit gradients; ZeRO-3 hooks every module (parameter_offload.py)."""
    if stage == 0:
        return HostStyle("flat", flat_buckets=no_retain_buckets, sixteen_bit_checks=True)
    return HostStyle("zero", stage, reduce_bucket_size=ds.reduce_bucket_size,
                     allgather_bucket_size=ds.allgather_bucket_size, flattens=True, sixteen_bit_checks=True,
                     module_hooks=stage == 3)


def host_equivalent(x: CommInput) -> HostEquivalent:
    return HostEquivalent(host_style(x.strategy.zero_stage, x.knobs["deepspeed"]))


def communicators(strategy: Strategy, dp: int) -> tuple[int, ...]:
    """NCCL communicators of one rank (Backend.communicators): the default process group (the
    worker's per-step collectives, DeepSpeed's barriers) and its clone that every ZeRO collective
    runs on, deepspeed/utils/groups.py `_clone_world_group` (a `dist.new_group` over the world, kept
    because DeepSpeed calls `dist.get_global_rank` on its groups), the data-parallel group engine.py
    takes from `groups._get_data_parallel_group()`."""
    return (dp, dp)

"""Collective time on a ring, shared by every backend's communication model (speed.py module
docstring, assumptions 2, 3 and 5). Units: bytes, seconds, GB/s = 1e9 bytes/s."""
from __future__ import annotations

GB = 1e9

ZERO3_OVERLAP_FRACTION = 0.5
"""Share of fully-sharded communication that prefetching can hide behind compute (assumption)."""


def ring_time_s(num_bytes: float, num_ranks: int, bus_bandwidth_gbps: float, collective: str) -> float:
    """Ring collective time: all_reduce moves 2(n-1)/n x S per rank, reduce_scatter and
    all_gather (n-1)/n x S, at bus bandwidth busbw (nccl-tests doc/PERFORMANCE.md:
    busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for reduce-scatter / all-gather)."""
    if num_ranks <= 1 or num_bytes <= 0:
        return 0.0
    factor = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}[collective]
    return num_bytes * factor * (num_ranks - 1) / num_ranks / (bus_bandwidth_gbps * GB)


def bus_bandwidth_gbps(cluster) -> float:
    """Bottleneck bus bandwidth of a data-parallel ring over the whole cluster (assumption 3)."""
    if cluster.num_nodes <= 1:
        return cluster.intra_node_bandwidth_gbps
    return min(cluster.intra_node_bandwidth_gbps, cluster.inter_node_bandwidth_gbps)


def overlapped_exposed_s(comm_s: float, compute_s: float, last_bucket_s: float) -> float:
    """Communication left visible when it runs beside `compute_s` of compute: what does not fit,
    and never less than the last bucket, which is only ready when compute ends
    (arXiv:2006.15704 sec. 3.2.3)."""
    return min(comm_s, max(comm_s - compute_s, last_bucket_s))


def bucketed_reduction_s(grad_bytes: float, dp: int, bus_gbps: float, collective: str, num_reductions: int,
                         bucket_bytes: float, overlaps: bool, backward_s: float) -> tuple[float, float]:
    """(raw, exposed) seconds of a bucketed gradient reduction per optimizer step: `num_reductions`
    reductions of all gradients; when it `overlaps` backward, only what does not fit beside the
    backward and at least the last bucket stay exposed (assumptions 4 and 5)."""
    comm_s = ring_time_s(grad_bytes, dp, bus_gbps, collective)
    if not overlaps:
        return comm_s * num_reductions, comm_s * num_reductions
    last_s = ring_time_s(min(bucket_bytes, grad_bytes), dp, bus_gbps, collective)
    return comm_s * num_reductions, overlapped_exposed_s(comm_s, backward_s, last_s) * num_reductions


def fully_sharded_comm_s(dp_size: int, bus_gbps: float, param_bytes: float, grad_bytes: float, accum: int,
                         forward_s: float, backward_s: float, overlap_comm: bool) -> tuple[float, float]:
    """(raw, exposed) seconds per optimizer step of a fully sharded data-parallel step: every
    micro-batch all-gathers the parameters in forward and again in backward and reduce-scatters the
    gradients (ZeRO paper arXiv:1910.02054 sec. 7.2.2: 3 x (n-1)/n x S, 1.5x DDP). Prefetch hides
    up to ZERO3_OVERLAP_FRACTION of each phase's communication behind that phase's compute; the
    reduce-scatter runs on a side stream only with `overlap_comm` (deepspeed/runtime/zero/stage3.py,
    `reduce_and_partition_stream` in DeepSpeedZeroOptimizer_Stage3.__init__)."""
    gather_s = ring_time_s(param_bytes, dp_size, bus_gbps, "all_gather")
    scatter_s = ring_time_s(grad_bytes, dp_size, bus_gbps, "reduce_scatter")
    hidden_backward_s = gather_s + (scatter_s if overlap_comm else 0.0)
    exposed_s = (gather_s - min(ZERO3_OVERLAP_FRACTION * gather_s, forward_s)
                 + gather_s + scatter_s
                 - min(ZERO3_OVERLAP_FRACTION * hidden_backward_s, backward_s))
    return (2 * gather_s + scatter_s) * accum, exposed_s * accum


def tp_comm_s(strategy, workload, cluster, spec, accum: int, elem: int) -> float:
    """Tensor-parallel all-reduces per optimizer step: each decoder layer all-reduces b x s x hidden
    activations twice in forward (the g operators) and twice in backward (the f operators)
    (Megatron-LM, arXiv:1909.08053 sec. 3), on the intra-node link over tp ranks, not overlapped;
    each call also pays `collective_latency_s`."""
    if strategy.tp_size <= 1 or spec is None:
        return 0.0
    calls = 4 * spec.num_layers / strategy.pp_size * accum
    act_bytes = workload.micro_batch_size * workload.seq_len * spec.hidden_size * elem
    per_call = ring_time_s(act_bytes, strategy.tp_size, cluster.intra_node_bandwidth_gbps, "all_reduce")
    return calls * (per_call + cluster.collective_latency_s)


def fill_buckets(sizes, bucket_numel: float) -> list[list[int]]:
    """Indices of `sizes` (gradients in the order their hooks run) grouped by the reduce bucket
    that reduces them: a gradient that would overflow a non-empty bucket flushes it first, so a
    gradient larger than the bucket goes alone (stage_1_and_2.py
    `reduce_independent_p_g_buckets_and_remove_grads`: `bucket.elements + param.numel() >
    reduce_bucket_size`; stage3.py and ColossalAI low_level_optim.py `_add_to_bucket` alike)."""
    groups, elements = [], 0
    for k, n in enumerate(sizes):
        if not groups or (elements and elements + n > bucket_numel):
            groups.append([])
            elements = 0
        groups[-1].append(k)
        elements += n
    return groups

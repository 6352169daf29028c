"""Per-rank ZeRO-1/2 gradient partitions and ZeRO-3 gathered-parameter lifetimes on hand-built
traces, against what DeepSpeed 0.19 does (deepspeed/runtime/zero/stage_1_and_2.py
`get_partition_info`, `reduce_independent_p_g_buckets_and_remove_grads`, `copy_grads_in_partition`;
partitioned_param_coordinator.py `release_sub_module`), worked out by hand for each case."""
import numpy as np
import pytest

from launcher.config import DDPConfig, DeepSpeedConfig
from launcher.measure import memory_rows
from launcher.backends.registry import knobs as registry_knobs
from launcher.memory.estimate import estimate
from launcher.memory.common import category_curves
from launcher.backends.deepspeed.layout import (ZeroSetup, full_depth_flush_events, gradient_partitions, norm_pieces,
                                       grads_in_partition_numel, partition_mask, reduce_events,
                                       zero12_layout)
from launcher.backends.deepspeed.zero3 import zero3_layout
from launcher.steptrace import Kind, ParamTable, Role, StepTrace, TraceSet
from launcher.types import Cluster, MemoryEstimate, Strategy, Workload

ACT = 10_000  # bytes saved per layer in forward
CPU = Cluster("cpu", "cpu", 2, 1, 2**34, 2**34, {}, 0.5, 1, 1, 1, 1, 0, 0)
WL32 = Workload(8, 1, "32-true", "adamw_torch", False, "sdpa")


def tied_embedding_trace(num_layers: int, emb: int = 1000, layer: int = 100, act: int = ACT) -> StepTrace:
    """fp32 model [embedding (emb), one parameter per layer (layer numel)], like a BLOOM with tied
    embeddings: forward saves `act` bytes per layer; backward walks the layers in reverse, each
    layer's gradient ready when allocated, then frees its activation; the embedding's gradient
    (lm_head + embedding) is ready last. No optimizer traced (as for DeepSpeed)."""
    numel = [emb] + [layer] * num_layers
    rows, ready, n = [], {}, 0

    def alloc(nbytes, kind, param=-1):
        nonlocal n
        rows.append([nbytes, n, -1, kind, -1, param])
        n += 1
        return len(rows) - 1

    def free(row):
        nonlocal n
        rows[row][2] = n
        n += 1

    for i, k in enumerate(numel):
        alloc(4 * k, Kind.PARAM, i)
    fwd = n
    acts = [alloc(act, Kind.ACT) for _ in range(num_layers)]
    bwd = n
    grads = []
    for lay in reversed(range(num_layers)):
        grads.append(alloc(4 * layer, Kind.GRAD, 1 + lay))
        ready[grads[-1]] = rows[grads[-1]][1]
        free(acts[lay])
    bwd_layers_end = n
    grads.append(alloc(4 * emb, Kind.GRAD, 0))
    ready[grads[-1]] = rows[grads[-1]][1]
    free(alloc(8, Kind.ACT))
    opt = n
    for g in grads:
        free(g)
    end = n
    arr = np.array([[r[0], r[1], end if r[2] < 0 else r[2], r[3], -1, r[5]] for r in rows], dtype=np.int64)
    for g, ev in ready.items():
        arr[g, 4] = ev
    table = ParamTable(tuple(f"p{i}" for i in range(len(numel))), np.array(numel), np.full(len(numel), 4),
                       np.ones(len(numel), bool), np.array([Role.EMBEDDING] + [Role.LAYER] * num_layers, np.int8),
                       np.array([-1, *range(num_layers)]), np.full(len(numel), -1))
    phases = {"build": (0, fwd), "forward": (fwd, bwd), "backward": (bwd, opt), "optimizer": (opt, opt),
              "zero_grad": (opt, end)}
    bounds = {"forward": (fwd, fwd + num_layers), "backward": (bwd, bwd_layers_end)}
    return StepTrace(num_layers, 1, 8, table, arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3].astype(np.int8),
                     arr[:, 4], arr[:, 5], end, phases, layer_bounds=bounds)


def zero(stage: int, dp: int = 2, num_layers: int = 0, **ds) -> ZeroSetup:
    cfg = DeepSpeedConfig(**{"reduce_bucket_size": 150, "allgather_bucket_size": 150, **ds})
    return ZeroSetup(stage, False, False, 4, 4, "adamw_torch", cfg, dp, num_layers)


def test_partition_membership_follows_get_partition_info():
    # flat [0,12) [12,15) [15,20), dp=2: partitions [0,10) [10,20); rank 1 also holds the
    # embedding-like first parameter crossing its start (first_offset = 10)
    assert partition_mask([12, 3, 5], 2, 0) == [True, False, False]
    assert partition_mask([12, 3, 5], 2, 1) == [True, True, True]
    assert [grads_in_partition_numel([12, 3, 5], 2, r) for r in (0, 1)] == [12, 20]
    assert grads_in_partition_numel([12, 3, 5], 2) == 20  # worst rank
    # 10 elements padded to 12 (multiple of 2 x dp): partitions [0,6) [6,12)
    assert partition_mask([5, 5], 2, 0) == [True, True]
    assert partition_mask([5, 5], 2, 1) == [False, True]
    # 4 ranks of [0,3): rank 3 starts at 9 = the padding, it holds nothing
    assert [grads_in_partition_numel([5, 5], 4, r) for r in range(4)] == [5, 10, 5, 0]


def test_the_gradient_norm_converts_each_partition_piece_alone():
    # flat [0,1000) [1000,1100) [1100,1200), 2 partitions of 600: rank 0 holds 600 elements of the
    # first parameter, rank 1 its other 400 and two of 100
    assert norm_pieces([1000, 100, 100], 2) == [600, 400]
    # 4 partitions of 300: the first parameter fills three and a third of the fourth
    assert norm_pieces([1000, 100, 100], 4) == [300, 300, 300, 100]
    # 10 elements padded to 16 (multiple of 2 x dp), partitions of 4: rank 1 holds 1 + 3 elements,
    # rank 2 the last 2, rank 3's partition [12,16) is padding only
    assert norm_pieces([5, 5], 4) == [4, 3, 2, 0]


def test_bucket_flushes_happen_at_the_hook_that_overflows():
    t = tied_embedding_trace(2)  # ready order: p2 (100), p1 (100), p0 (1000)
    ready = {int(t.param[r]): int(t.ready[r]) for r in np.nonzero(t.kind == Kind.GRAD)[0]}
    got = reduce_events(t, 150)
    # p1's hook: 100 + 100 > 150 flushes [p2]; p0's hook: 100 + 1000 > 150 flushes [p1]; p0 (larger
    # than the bucket) waits for a later hook: none, so the epilogue reduces it
    assert got == {2: ready[1], 1: ready[0], 0: None}
    # a bucket holding everything: one flush, at the epilogue
    assert reduce_events(t, 10_000) == {2: None, 1: None, 0: None}


def test_real_layers_take_the_earliest_flush_of_their_traced_copies():
    t = tied_embedding_trace(2)
    ready = {int(t.param[r]): int(t.ready[r]) for r in np.nonzero(t.kind == Kind.GRAD)[0]}
    # real depth 4: [p0, layer x 4]; a real layer's parameter is reduced no later than the first
    # traced layer's (p2's flush, at p1's ready event)
    assert full_depth_flush_events(t, 4, 150) == [None] + [ready[1]] * 4


def test_each_rank_allocates_its_gradient_partition_at_its_own_first_flush():
    t = tied_embedding_trace(2)
    ready = {int(t.param[r]): int(t.ready[r]) for r in np.nonzero(t.kind == Kind.GRAD)[0]}
    # flat 1200, part 600: rank 0 = the embedding only, reduced at the epilogue; rank 1 = the
    # embedding's tail and both layers, first reduced when p1's hook flushes p2
    assert gradient_partitions(t, zero(2)) == [(1000, None), (1200, ready[1])]
    # stage 1 (no overlap_comm) reduces after backward: the epilogue on every rank
    assert gradient_partitions(t, zero(1)) == [(1000, None), (1200, None)]
    # real depth 10 (numel 2000, part 1000): rank 0 = the embedding, rank 1 = the layers
    assert gradient_partitions(t, zero(2, num_layers=10)) == [(1000, None), (1000, ready[1])]


def test_ranks_differ_only_by_their_gradient_partition_and_when_it_appears():
    t = tied_embedding_trace(2)
    z = zero(2)
    curves = [sum(category_curves(zero12_layout(t, z, r)).values()) for r in (0, 1)]
    layout = zero12_layout(t, z, 0)
    ready = {int(t.param[r]): int(t.ready[r]) for r in np.nonzero(t.kind == Kind.GRAD)[0]}
    flush1 = int(layout.ev(ready[1]))  # rank 1's first in-partition flush
    r0 = layout.reduce_ev(0)  # the epilogue
    norm, s0, s1 = (layout.step_ev(j) for j in range(3))  # the step's norm, flatten, partition dropped
    expected = np.zeros(layout.num_events, np.int64)
    expected[flush1:r0] = 4 * 1200  # only rank 1 holds its partition
    expected[r0:s1] = 4 * (1200 - 1000)  # both do, rank 1's is larger
    # the norm's fp64 copy of each partition's largest piece: flat [0, 1200), partitions of 600;
    # rank 0's is 600 embedding elements, rank 1's the other 400
    expected[norm:s0] += 8 * (400 - 600)
    assert np.array_equal(curves[1] - curves[0], expected)


def test_estimate_reports_each_rank_and_the_worst_as_headline():
    traces = TraceSet(tied_embedding_trace(1, act=8), tied_embedding_trace(2, act=8), 2)
    ds = DeepSpeedConfig(reduce_bucket_size=150, allgather_bucket_size=150)
    est = estimate(traces, Strategy("zero2", "deepspeed", 2), WL32, CPU, registry_knobs(deepspeed=ds, ddp=DDPConfig()), 2)
    r0, r1 = est.per_rank_peak_allocated_bytes
    assert est.peak_allocated_bytes == max(r0, r1) == r1
    # Elements (4 bytes) beyond what every rank holds all step (flat parameters, master, states): at
    # the end of backward rank 1 holds the embedding gradient (1000), its partition (1200) and the
    # bucket (150) = 2350, rank 0 only 1150 (its partition appears at the epilogue, once the
    # embedding gradient is freed). The step's norm adds an fp64 copy of the partition's largest
    # piece (rank 0: 600 embedding elements = 1200 fp32-sized ones, rank 1: 400 -> 800): 2200 and
    # 2000; then the flat gradient partition (600; the fp32 model's `.to(fp32)` returns it as is):
    # 1600 and 1800. Rank 1 peaks in backward, with the trace's 8-byte transient after the embedding
    # gradient, rank 0 at the norm.
    assert r1 - r0 == 4 * (2350 - 2200) + 8
    assert est.peak_phase == "backward"
    assert est.rank_peak_allocated_bytes(0) == r0
    ddp = estimate(traces, Strategy("ddp", "ddp"), WL32, CPU, registry_knobs(deepspeed=ds, ddp=DDPConfig()), 2)
    assert ddp.per_rank_peak_allocated_bytes == ()
    assert ddp.rank_peak_allocated_bytes(1) == ddp.peak_allocated_bytes


def test_zero3_keeps_each_gathered_parameter_until_its_own_backward():
    t = tied_embedding_trace(2)
    z = zero(3, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=10**9)
    layout = zero3_layout(t, z)
    ready = {int(t.param[r]): int(t.ready[r]) for r in np.nonzero(t.kind == Kind.GRAD)[0]}
    fwd, layers = t.phases["forward"][0], t.layer_bounds["forward"][0]
    got = sorted((x.nbytes, x.start, x.end) for x in layout.terms if x.name == "gathered_params")
    # embedding fetched when forward starts, layers where they start; each released after its
    # gradient is ready (the tied embedding last)
    expected = sorted([(4 * 1000, fwd, int(layout.ev(ready[0])) + 1),
                       (4 * 100, layers, int(layout.ev(ready[1])) + 1),
                       (4 * 100, layers, int(layout.ev(ready[2])) + 1)])
    assert got == expected


@pytest.mark.parametrize("ds", [{"stage3_param_persistence_threshold": 100},  # layers persistent
                                {"stage3_max_reuse_distance": 300}])  # the embedding released in forward
def test_zero3_gathered_terms_only_for_non_persistent_parameters_kept_to_backward(ds):
    t = tied_embedding_trace(2)
    layout = zero3_layout(t, zero(3, **{"stage3_param_persistence_threshold": 0, **ds}))
    got = [x.nbytes for x in layout.terms if x.name == "gathered_params"]
    assert got == ([4 * 1000] if ds.get("stage3_param_persistence_threshold") else [])


def test_measure_compares_each_rank_with_its_own_estimate():
    summary = {"measured_peak_allocated_bytes": [80, 100], "measured_peak_phase": ["backward"] * 2}
    rows = memory_rows(summary, {"peak_allocated_bytes": 100, "per_rank_peak_allocated_bytes": [80, 100]})
    assert [r["estimated_peak_bytes"] for r in rows] == [80, 100]
    assert [r["error_percent"] for r in rows] == [0.0, 0.0]
    rows = memory_rows(summary, {"peak_allocated_bytes": 100})
    assert [r["error_percent"] for r in rows] == [25.0, 0.0]
    assert MemoryEstimate(5, 5, 5, 0, {}, "backward").rank_peak_allocated_bytes(1) == 5


@pytest.mark.parametrize("overlap", [None, False])
def test_zero3_side_stream_buffers_follow_overlap_comm(overlap):
    """With overlap_comm (stage 3's default) the gathered parameters come from the all-gather
    stream and the reduce-scatter concatenations from reduce_and_partition_stream (allocator
    pools per stream); without it everything is on the default stream."""
    t = tied_embedding_trace(2)
    layout = zero3_layout(t, zero(3, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=10**9,
                                  overlap_comm=overlap))
    streams = {(x.name, x.stream) for x in layout.terms if x.name in ("gathered_params", "reduce_scatter_flat")}
    assert streams == ({("gathered_params", 1), ("reduce_scatter_flat", 2)} if overlap is None
                       else {("gathered_params", 0), ("reduce_scatter_flat", 0)})


@pytest.mark.parametrize("bucket,flat_numel,whole", [(10**6, 3 * (334 + 34 + 34), True),
                                                     (1001, 3 * (334 + 34), False),
                                                     (1000, 0, False)])
def test_zero3_first_prefetch_is_one_coalesced_all_gather(bucket, flat_numel, whole):
    """partitioned_param_coordinator.py `_fetch_sub_module_impl`: the outer module's fetch at the
    start of forward prefetches from the trace queue while the prefetched numel is below the
    bucket (so the parameter that crosses it is taken); partition_parameters.py
    `_all_gather_dtype` gathers several parameters into one flat tensor of world size x their
    partitions (ceil(numel / 3) each over 3 ranks), held until the batch's last parameter is
    fetched. One parameter alone (bucket 1000: the 1000-element embedding) goes through
    `_all_gather_sequential` and its buffer becomes the parameter: no flat buffer."""
    t = tied_embedding_trace(2)
    z = zero(3, dp=3, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=bucket)
    layout = zero3_layout(t, z)
    got = [(x.nbytes, x.start, x.end) for x in layout.terms if x.name == "allgather_flat_buffer"]
    fwd, layers_end = t.phases["forward"][0], t.layer_bounds["forward"][1]
    # the whole model in one batch: freed when the LM head (after the layers) is fetched
    assert got == ([] if not flat_numel else [(4 * flat_numel, fwd, (layers_end if whole else fwd) + 1)])

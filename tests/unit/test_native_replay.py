"""The compiled allocator replay (launcher/memory/_replay.c) against the Python simulator it
compiles (allocator.py `replay`): the same counters on random event streams that exercise every
rule (both pools, splitting, merging, streams, expandable segments, releasing cached segments at
a capacity, a key allocated twice, frees of keys never allocated, restarts of the peaks)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import launcher.memory.allocator as allocator
from launcher.memory.allocator import native_replay, replay, replay_arrays, replay_batches

MiB = 2**20
# any size, and multiples of 512 B and 512 KiB, which meet the rules' thresholds exactly (a block
# with 512 B or 1 MiB left, a 10 MiB request, a segment filled to its end)
SIZES = st.one_of(st.integers(0, 64 * MiB), st.integers(0, 4096).map(lambda k: k * 512),
                  st.integers(0, 64).map(lambda k: k * MiB // 2))


def test_the_compiled_replay_is_built():
    # scripts/setup installs the package with its extension; a build without a C compiler falls
    # back to the Python replay, which this suite would then not compare
    assert native_replay() is not None


@st.composite
def streams_of_events(draw):
    n = draw(st.integers(1, 300))
    keys = draw(st.integers(1, 40))
    events = []
    for _ in range(n):
        events.append((0, draw(st.sampled_from((1, 1, 1, -1, -1, 0))), draw(st.integers(-3, keys)), draw(SIZES),
                       draw(st.sampled_from((0, 0, 1, 2)))))
    return events


@settings(max_examples=300, deadline=None)
@given(events=streams_of_events(), expandable=st.booleans(),
       capacity=st.one_of(st.none(), st.integers(0, 400).map(lambda m: m * MiB)))
def test_compiled_and_python_replays_agree(events, expandable, capacity):
    python = replay(events, expandable, capacity)
    arrays = [np.array([e[f] for e in events], np.int64) for f in range(1, 5)]
    native = replay_arrays(*arrays, expandable_segments=expandable, capacity=capacity)
    assert native == (python.peak_reserved, python.peak_allocated, python.peak_needed, python.reserved,
                      python.allocated, python.segment_changes)


@st.composite
def batched_streams(draw):
    first = draw(streams_of_events())
    m = draw(st.integers(1, 60))
    batch = [(draw(st.sampled_from((1, 1, -1))), draw(st.integers(0, 30)), draw(st.sampled_from((0, 0, 1, 2))))
             for _ in range(m)]
    rows = draw(st.integers(1, 4))
    sizes = [[draw(SIZES) for _ in range(m)] for _ in range(rows)]
    sequence = draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=12))
    return first, batch, sizes, sequence


@settings(max_examples=200, deadline=None)
@given(case=batched_streams(), expandable=st.booleans(),
       capacity=st.one_of(st.none(), st.integers(0, 400).map(lambda m: m * MiB)))
def test_compiled_and_python_batch_replays_agree(case, expandable, capacity):
    first, batch, sizes, sequence = case
    first = tuple(np.array([e[f] for e in first], np.int64) for f in range(1, 5))
    batch = tuple(np.array([e[f] for e in batch], np.int64) for f in range(3))
    args = (first, batch, np.array(sizes, np.int64), sequence, expandable, capacity)
    native = replay_batches(*args)
    saved, allocator._NATIVE[:] = allocator._NATIVE[:], [None]  # the Python replay
    try:
        python = replay_batches(*args)
    finally:
        allocator._NATIVE[:] = saved
    assert native == python


@pytest.mark.parametrize("name", ["single", "fsdp2"])
@pytest.mark.parametrize("expandable", [False, True])
def test_a_step_rebuilt_at_depth_replays_alike(name, expandable):
    """A real layout's steady-state events rebuilt at depth 6 (FSDP2's on three streams)."""
    pytest.importorskip("transformers")
    from launcher.memory.replay import allocation_arrays, allocation_events, full_depth_items
    from tests.unit.test_full_depth_replay import DEPTH, STRATEGIES, _layouts, _traces

    wl, t = _traces(STRATEGIES[name], False)
    shallow, deep = _layouts(t, 2, 3, STRATEGIES[name], wl)
    full = full_depth_items(shallow, deep, DEPTH)
    python = replay(allocation_events(deep, 80, *full), expandable)
    native = replay_arrays(*allocation_arrays(deep, 80, *full)[1:], expandable_segments=expandable)
    assert native.peak_reserved > native.peak_allocated > 0
    assert native == (python.peak_reserved, python.peak_allocated, python.peak_needed, python.reserved,
                      python.allocated, python.segment_changes)

"""The caching-allocator simulator against cases computed by hand from the allocator's rules
(c10/cuda/CUDACachingAllocator.cpp, summarised in launcher/memory/allocator.py)."""
from launcher.memory.allocator import CachingAllocator, replay

MiB = 2**20


def test_small_request_reserves_a_2mib_segment_and_rounds_to_512():
    a = CachingAllocator()
    a.malloc(1000)
    assert (a.reserved, a.allocated) == (2 * MiB, 1024)


def test_small_requests_share_a_segment_until_it_is_full():
    a = CachingAllocator()
    for _ in range(2):
        a.malloc(600 * 1024)
    assert a.reserved == 2 * MiB  # 1200 KiB used, 848 KiB left in the segment
    a.malloc(900 * 1024)  # 848 KiB < 900 KiB: a second small segment
    assert a.reserved == 4 * MiB


def test_large_request_below_10mib_gets_a_20mib_segment():
    a = CachingAllocator()
    a.malloc(5 * MiB)
    assert a.reserved == 20 * MiB
    a.malloc(5 * MiB)  # 15 MiB free in that segment, split: no new segment
    assert a.reserved == 20 * MiB


def test_request_of_10mib_or_more_gets_its_size_rounded_to_2mib():
    a = CachingAllocator()
    a.malloc(15 * MiB)
    assert a.reserved == 16 * MiB
    a.malloc(15 * MiB + 1)
    assert a.reserved == 32 * MiB


def test_freed_block_is_reused_and_split_by_best_fit():
    a = CachingAllocator()
    x = a.malloc(12 * MiB)
    a.malloc(12 * MiB)
    a.free(x)
    a.malloc(8 * MiB)  # fits in the freed 12 MiB block: 4 MiB remain (> 1 MiB: split)
    assert a.reserved == 24 * MiB
    assert a.allocated == 20 * MiB
    a.malloc(4 * MiB)  # the 4 MiB remainder serves it exactly
    assert a.reserved == 24 * MiB


def test_large_block_with_at_most_1mib_left_is_handed_out_whole():
    a = CachingAllocator()
    x = a.malloc(12 * MiB)
    a.free(x)
    a.malloc(11 * MiB + 512 * 1024)  # 512 KiB would remain: no split
    assert a.allocated == 12 * MiB


def test_best_fit_prefers_the_smallest_sufficient_block():
    a = CachingAllocator()
    big, keep1, small, keep2 = a.malloc(30 * MiB), a.malloc(12 * MiB), a.malloc(14 * MiB), a.malloc(12 * MiB)
    a.free(big)
    a.free(small)
    a.malloc(13 * MiB)  # best fit is the 14 MiB block (1 MiB left: not split), not the 30 MiB one
    assert a.allocated == 12 * MiB + 12 * MiB + 14 * MiB
    a.malloc(30 * MiB)  # the 30 MiB block is still free
    assert a.reserved == (30 + 12 + 14 + 12) * MiB


def test_freed_neighbours_merge_so_a_larger_request_reuses_the_segment():
    a = CachingAllocator()
    x, y = a.malloc(3 * MiB), a.malloc(3 * MiB)  # one 20 MiB segment
    a.free(x)
    a.free(y)
    a.malloc(18 * MiB)  # the merged 20 MiB block serves it (2 MiB left, split)
    assert a.reserved == 20 * MiB


def test_small_and_large_pools_do_not_share_segments():
    a = CachingAllocator()
    x = a.malloc(5 * MiB)
    a.free(x)  # a free 20 MiB large block
    a.malloc(1000)  # small pool: needs its own 2 MiB segment
    assert a.reserved == 22 * MiB


def test_replay_tracks_peaks_and_never_releases():
    events = [(0, 1, "a", 12 * MiB), (1, 1, "b", 12 * MiB), (2, -1, "a", 0), (3, -1, "b", 0),
              (4, 1, "c", 1000)]
    a = replay(events)
    assert a.peak_allocated == 24 * MiB
    assert a.peak_reserved == 24 * MiB + 2 * MiB
    assert a.allocated == 1024


def test_expandable_segment_grows_by_20mib_pages_and_tiles_requests():
    a = CachingAllocator(expandable_segments=True)
    a.malloc(15 * MiB)  # one page of 20 MiB mapped; 5 MiB left at the end
    assert a.reserved == 20 * MiB
    a.malloc(15 * MiB)  # the 5 MiB free tail grows by one page (5 + 20 >= 15)
    assert a.reserved == 40 * MiB
    a.malloc(10 * MiB)  # 10 MiB left at the end: fits without mapping
    assert (a.reserved, a.allocated) == (40 * MiB, 40 * MiB)


def test_expandable_segment_reuses_freed_slivers_that_fragment_a_plain_segment():
    """Sizes that grow by a little each time (the batch N+1 case of the allocator's note). Plain
    segments: 12 MiB gets a 12 MiB segment, 13 does not fit in it and gets 14 (rounded to 2 MiB),
    14 reuses that one, 15 gets 16, 16 reuses it, 17 gets 18, 18 reuses it, 19 gets 20: 80 MiB
    cached for a 19 MiB peak. The expandable segment maps one 20 MiB page and every request fits in
    its free block."""
    plain, grown = CachingAllocator(), CachingAllocator(expandable_segments=True)
    for a in (plain, grown):
        for n in range(12, 20):
            a.free(a.malloc(n * MiB))
    assert plain.reserved == (12 + 14 + 16 + 18 + 20) * MiB
    assert grown.reserved == 20 * MiB


def test_expandable_segment_extends_a_free_tail_instead_of_a_new_segment():
    a = CachingAllocator(expandable_segments=True)
    a.malloc(30 * MiB)  # two pages: 40 MiB mapped, 10 MiB free at the end
    b = a.malloc(10 * MiB)  # the free tail serves it exactly
    a.free(b)
    a.malloc(25 * MiB)  # the 10 MiB free tail grows by one page to 30 MiB
    assert a.reserved == 60 * MiB


def test_expandable_small_pool_uses_2mib_pages():
    a = CachingAllocator(expandable_segments=True)
    for _ in range(3):
        a.malloc(900 * 1024)
    assert a.reserved == 4 * MiB  # 2700 KiB in 2 MiB pages


def test_a_block_freed_on_one_stream_does_not_serve_another():
    a = CachingAllocator()
    b = a.malloc(64 * MiB, stream=1)  # e.g. an all-gather output on a side stream
    a.free(b)
    a.malloc(64 * MiB)  # the default stream cannot take the side stream's cached block
    assert a.reserved == 128 * MiB
    a.malloc(64 * MiB, stream=1)  # the side stream reuses its own
    assert a.reserved == 128 * MiB


def test_expandable_segments_grow_one_segment_per_stream():
    a = CachingAllocator(expandable_segments=True)
    x = a.malloc(30 * MiB)
    a.free(x)
    a.malloc(30 * MiB, stream=2)  # a new segment for stream 2: 40 MiB of 20 MiB pages
    assert a.reserved == 80 * MiB
    a.malloc(30 * MiB)  # the default stream's segment already maps 40 MiB
    assert a.reserved == 80 * MiB
    events = [(0, 1, "x", 30 * MiB, 2), (1, -1, "x", 0, 2), (2, 1, "y", 30 * MiB, 0)]
    assert replay(events, expandable_segments=True).peak_reserved == 80 * MiB


def test_a_step_needs_only_what_an_out_of_memory_retry_cannot_release():
    """CUDACachingAllocator.cpp `release_cached_blocks` frees every cached block that is a whole
    segment before malloc reports out of memory: a freed 30 MiB segment is cached (reserved 70 MiB
    once a 40 MiB request gets its own segment) but not needed (40 MiB); a segment still split
    between a live and a free block is needed whole."""
    a = CachingAllocator()
    a.free(a.malloc(30 * MiB))
    a.malloc(40 * MiB)
    assert (a.peak_reserved, a.peak_needed) == (70 * MiB, 40 * MiB)
    b = CachingAllocator()
    big = b.malloc(30 * MiB)
    b.free(big)
    b.malloc(12 * MiB)  # best fit splits the cached 30 MiB segment: 18 MiB stay free inside it
    b.malloc(40 * MiB)
    assert (b.peak_reserved, b.peak_needed) == (70 * MiB, 70 * MiB)


def test_an_expandable_segment_needs_its_used_pages_only():
    """With expandable segments `release_cached_blocks` unmaps the whole pages no block uses: 60
    MiB mapped for three 20 MiB requests, the middle one freed, then 30 MiB more at the end."""
    a = CachingAllocator(expandable_segments=True)
    x = [a.malloc(20 * MiB) for _ in range(3)]
    a.free(x[1])
    a.malloc(30 * MiB)  # does not fit the 20 MiB hole: the segment grows by two 20 MiB pages
    assert (a.peak_reserved, a.peak_needed) == (100 * MiB, 80 * MiB)


def test_best_fit_ties_go_to_the_older_segment_at_any_offset():
    """Among free blocks of one size the older segment wins, then the lower offset, however far
    into its segment a block lies (the free list's integer keys, allocator.py `_SIZE_SHIFT`)."""
    a = CachingAllocator()
    x, y = a.malloc(20 * MiB), a.malloc(20 * MiB)  # two 20 MiB segments
    a.free(y)
    a.free(x)
    assert a.malloc(20 * MiB) is x
    a = CachingAllocator()
    whole = a.malloc((1 << 40) + 12 * MiB)  # segment 0: 1 TiB and 12 MiB
    newer = a.malloc(12 * MiB)  # segment 1
    a.free(whole)
    a.malloc(1 << 40)  # splits segment 0: 12 MiB stay free 1 TiB into it
    a.free(newer)
    tail = a.malloc(12 * MiB)
    assert (tail.seg, tail.offset) == (whole.seg, 1 << 40)


def test_a_restart_measures_the_peaks_from_there_with_the_cache_kept():
    # op 0: the model's initialization before it (a 100 MiB storage, freed), the step after it
    a = replay([(0, 1, "init", 100 * MiB), (1, -1, "init", 0), (2, 0, None, 0), (3, 1, "act", 30 * MiB)])
    assert (a.peak_allocated, a.peak_reserved) == (30 * MiB, 100 * MiB)  # the 30 MiB split from the cached segment
    # the cached segment is in use by the step now: an out-of-memory retry could not return it
    assert a.peak_needed == 100 * MiB
    b = replay([(0, 1, "init", 100 * MiB), (1, -1, "init", 0), (2, 0, None, 0), (3, 1, "act", 120 * MiB)])
    assert (b.peak_allocated, b.peak_reserved, b.peak_needed) == (120 * MiB, 220 * MiB, 120 * MiB)

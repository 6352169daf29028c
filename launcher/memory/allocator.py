"""A simulator of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, torch 2.x,
default settings), for the peak *reserved* bytes of an allocation/free sequence.

Rules (GPU_MEMORY.md, from the allocator source):
- `round_size`: requests round up to a multiple of 512 B (kMinBlockSize);
- requests <= 1 MiB (kSmallSize) use the small pool, others the large pool;
- `get_allocation_size`: a new small segment is 2 MiB (kSmallBuffer); a large request below
  10 MiB (kMinLargeAlloc) gets a 20 MiB segment (kLargeBuffer), bigger ones a segment rounded up to
  2 MiB (kRoundLarge);
- `get_free_block`: best fit (smallest free block of the pool that is large enough, then lowest
  address); with `max_split_size` unlimited (default) any cached block may serve;
- `should_split`: small pool if >= 512 B remain, large pool if more than 1 MiB remains (and the
  request is below `max_split_size`); otherwise the whole block is handed out;
- `free_block`: a freed block merges with free neighbours of its segment; segments are never
  returned (no `empty_cache`), so `peak_reserved` is what a run with memory to spare reports;
- out of memory: before failing, `malloc` frees every cached block that is a whole segment
  (`release_cached_blocks`; with expandable segments the unused pages), so a step needs only its
  peak of reserved minus those (`peak_needed`). Given the device's `capacity`, the simulator does
  the same when a new segment would take reserved past it (a run long enough to fill the GPU with
  cache: batches of varying length, replay.py `varlen_held_cache`).
With `expandable_segments:True` (PYTORCH_CUDA_ALLOC_CONF; "Note [Expandable Segments]" in the
same file) each pool is one segment per stream that grows by whole pages (2 MiB for the small pool,
20 MiB for the large one): a request no free block fits is placed at the segment's end, extending
the free block there (if any) by the pages it lacks, and reserved is the mapped pages; every block
is split when at least 512 B remain (`should_split` with expandable segments); best fit and
merging are as above.
Streams: every pool is per stream (`BlockPool` free lists are searched with the request's
stream, `get_free_block` matches `p.stream()`; with expandable segments there is one segment per
stream and pool): a block allocated on a side stream (a framework's all-gather or reduce-scatter
stream) returns to that stream's free list and never serves the default stream, nor the other
way round. A request names its stream; the default is 0.
Not modelled: `record_stream` delays (frameworks that allocate on their side streams keep their
buffers until the next collective instead, which the layouts model), `roundup_power2_divisions`,
garbage-collection thresholds.
"""
from __future__ import annotations

import ctypes
import importlib.util
import itertools
from bisect import bisect_left, insort
from typing import NamedTuple

import numpy as np

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def allocation_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("seg", "offset", "size", "free", "prev", "next", "pool")

    def __init__(self, seg, offset, size, pool):
        self.seg, self.offset, self.size, self.free = seg, offset, size, True
        self.pool = pool  # (stream, small pool?)
        self.prev = self.next = None


# A free block's place in its pool's sorted free list, as one integer ordered as (size, segment,
# offset): (size << _SIZE_SHIFT) | (segment << _SEG_SHIFT) | offset, written out in `_insert` and
# `_remove` (the replay's hot path). Best fit is the first key >= `size << _SIZE_SHIFT` (the smallest
# block large enough, then the lowest address). Offsets stay below 2**48 B (256 TiB) and segment ids
# below 2**32.
_SEG_SHIFT, _SIZE_SHIFT = 48, 80


class CachingAllocator:
    """Replays malloc/free; tracks allocated and reserved bytes and their peaks."""

    def __init__(self, expandable_segments: bool = False, capacity: int | None = None):
        self.expandable = expandable_segments
        self.capacity = capacity  # bytes the device can reserve: past them, cached segments are released
        self._head = {}  # expandable: pool -> the first block of its segment
        self._free = {}  # pool (stream, small) -> sorted integer keys of its free blocks
        self._blocks = {}  # pool -> key -> free block
        self._seg_ids = itertools.count()
        self.reserved = self.allocated = 0
        self.peak_reserved = self.peak_allocated = 0
        self.releasable = 0  # cached bytes an out-of-memory retry would return (`_releasable`)
        self.peak_needed = 0  # the peak of reserved minus `releasable`
        self.segment_changes = 0  # segments (or expandable pages) mapped or released so far

    def _releasable(self, b: _Block) -> int:
        """What `release_cached_blocks` (run when a cudaMalloc fails, before the allocator reports
        out of memory) returns of a free block: a whole segment (`release_block`), or with
        expandable segments the whole pages inside the block (`release_expandable_segment` unmaps
        unused pages)."""
        if self.expandable:
            page = SMALL_BUFFER if b.pool[1] else LARGE_BUFFER
            return (b.offset + b.size) // page * page - -(-b.offset // page) * page if b.size >= page else 0
        return b.size if b.prev is None and b.next is None else 0

    def _insert(self, b: _Block) -> None:
        b.free = True
        key = (b.size << _SIZE_SHIFT) | (b.seg << _SEG_SHIFT) | b.offset
        pool = b.pool
        keys = self._free.get(pool)
        if keys is None:
            keys = self._free[pool] = []
            self._blocks[pool] = {}
        insort(keys, key)
        self._blocks[pool][key] = b
        if self.expandable:
            self.releasable += self._releasable(b)
        elif b.prev is None and b.next is None:  # `_releasable` inline: a whole segment
            self.releasable += b.size

    def _remove(self, b: _Block) -> None:
        key = (b.size << _SIZE_SHIFT) | (b.seg << _SEG_SHIFT) | b.offset
        keys = self._free[b.pool]
        del keys[bisect_left(keys, key)]
        del self._blocks[b.pool][key]
        self.releasable -= self._releasable(b)
        b.free = False

    def malloc(self, nbytes: int, stream: int = 0) -> _Block:
        size = MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK  # round_size
        small = size <= SMALL_SIZE
        pool = (stream, small)
        keys = self._free.get(pool)
        i = bisect_left(keys, size << _SIZE_SHIFT) if keys else 0
        if keys and i < len(keys):
            block = self._blocks[pool].pop(keys.pop(i))
            if self.expandable:
                self.releasable -= self._releasable(block)
            elif block.prev is None and block.next is None:
                self.releasable -= block.size
            block.free = False
        elif self.expandable:
            block = self._grow(pool, size)
        else:
            seg_bytes = allocation_size(size)
            if self.capacity is not None and self.reserved + seg_bytes > self.capacity and self.releasable:
                self.release_cached_blocks()
            block = _Block(next(self._seg_ids), 0, seg_bytes, pool)
            block.free = False
            self.segment_changes += 1
            self.reserved += seg_bytes
            if self.reserved > self.peak_reserved:
                self.peak_reserved = self.reserved
        remaining = block.size - size
        if ((small or self.expandable) and remaining >= MIN_BLOCK) or (not small and remaining > SMALL_SIZE):
            rest = _Block(block.seg, block.offset + size, remaining, pool)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        if self.reserved - self.releasable > self.peak_needed:
            self.peak_needed = self.reserved - self.releasable
        return block

    def release_cached_blocks(self) -> None:
        """What a failed cudaMalloc triggers before the allocator retries it and, failing again,
        reports out of memory (CUDACachingAllocator.cpp `release_cached_blocks`, run with
        `max_split_size` unlimited, the default): every cached block that is a whole segment is
        returned to the driver, in every pool. Segments with expandable segments are not released
        here (the simulator keeps their pages)."""
        if self.expandable:
            return
        for pool, keys in self._free.items():
            blocks = self._blocks[pool]
            whole = [k for k in keys if blocks[k].prev is None and blocks[k].next is None]
            for k in whole:
                b = blocks.pop(k)
                self.reserved -= b.size
                self.releasable -= b.size
            if whole:
                self.segment_changes += 1
                gone = set(whole)
                keys[:] = [k for k in keys if k not in gone]

    def _grow(self, pool: tuple, size: int) -> _Block:
        """Map pages at the end of the pool's one segment for `size` bytes: the free block at the
        end (if any) grows by the missing pages, else a new block starts there."""
        small = pool[1]
        page = SMALL_BUFFER if small else LARGE_BUFFER
        tail = self._head.get(pool)  # merging keeps a segment's first block (it absorbs, never is absorbed)
        while tail is not None and tail.next is not None:
            tail = tail.next
        if tail is not None and tail.free:
            self._remove(tail)
            added = -(-(size - tail.size) // page) * page
            tail.size += added
            block = tail
        else:
            added = -(-size // page) * page
            seg = tail.seg if tail is not None else next(self._seg_ids)
            block = _Block(seg, (tail.offset + tail.size) if tail else 0, added, pool)
            block.free = False
            block.prev = tail
            if tail is not None:
                tail.next = block
            else:
                self._head[pool] = block
        self.reserved += added
        self.segment_changes += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def free(self, block: _Block) -> None:
        self.allocated -= block.size
        for nb in (block.prev, block.next):
            if nb is not None and nb.free:
                self._remove(nb)
                if nb is block.prev:
                    nb.size += block.size
                    nb.next = block.next
                    if block.next is not None:
                        block.next.prev = nb
                    block = nb
                else:
                    block.size += nb.size
                    block.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = block
        self._insert(block)

    def restart_peaks(self) -> None:
        """The peaks start again from the bytes held now: a step's peaks after the model's
        initialization, whose cached segments stay (replay.py `init_events`)."""
        self.peak_reserved, self.peak_allocated = self.reserved, self.allocated
        self.peak_needed = self.reserved - self.releasable


def replay(events, expandable_segments: bool = False, capacity: int | None = None,
           alloc: CachingAllocator | None = None) -> CachingAllocator:
    """Replay `(time, op, key, nbytes)` or `(time, op, key, nbytes, stream)` tuples in order: op +1
    allocates `nbytes` for `key` on `stream` (default 0), -1 frees `key` (unknown keys are
    ignored), 0 restarts the peaks (`CachingAllocator.restart_peaks`). `capacity`: the device's bytes (`CachingAllocator`). `alloc`: replay into this
    allocator instead of a new one (an `events` generator may then read its state: each event is
    replayed before the next is drawn)."""
    alloc = alloc if alloc is not None else CachingAllocator(expandable_segments, capacity)
    malloc, free, live = alloc.malloc, alloc.free, {}
    pop = live.pop
    for e in events:
        if e[1] > 0:
            live[e[2]] = malloc(e[3], e[4] if len(e) > 4 else 0)
        elif e[1] == 0:
            alloc.restart_peaks()
        else:
            block = pop(e[2], None)
            if block is not None:
                free(block)
    return alloc


class Replayed(NamedTuple):
    """What a replay ends with (`CachingAllocator`'s counters of the same names)."""

    peak_reserved: int
    peak_allocated: int
    peak_needed: int
    reserved: int
    allocated: int
    segment_changes: int


_NATIVE: list = []  # [the compiled library, or None], loaded once


def native_replay():
    """The compiled replay (`_replay.c`, built with the package as the optional extension
    `launcher.memory._replay`), or None when it was not built (no C compiler at install time)."""
    if not _NATIVE:
        lib = None
        spec = importlib.util.find_spec("launcher.memory._replay")
        if spec is not None and spec.origin:
            lib = ctypes.CDLL(spec.origin)
            i64, i32, p = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
            tail = [i64, i32, i32, i64, p]  # keys, streams, expandable, capacity, out
            lib.replay.argtypes = [i64, p, p, p, p] + tail
            lib.replay_batches.argtypes = [i64, p, p, p, p, i64, p, p, p, p, i64, p, i64] + tail
            lib.replay.restype = lib.replay_batches.restype = ctypes.c_int
        _NATIVE.append(lib)
    return _NATIVE[0]


def _replayed(a: CachingAllocator) -> Replayed:
    return Replayed(a.peak_reserved, a.peak_allocated, a.peak_needed, a.reserved, a.allocated, a.segment_changes)


def _call(fn, *args) -> Replayed:
    out = np.zeros(6, np.int64)
    if fn(*args, out.ctypes.data):
        raise MemoryError("the allocator replay ran out of host memory")
    return Replayed(*(int(x) for x in out))


def _dense(values, dtype) -> tuple[int, np.ndarray]:
    """(count, index of each value among the distinct values): keys and streams as 0..count-1."""
    distinct, index = np.unique(np.asarray(values, np.int64), return_inverse=True)
    return len(distinct), np.ascontiguousarray(index, dtype)


def _settings(expandable_segments: bool, capacity: int | None) -> tuple[int, int]:
    return int(expandable_segments), -1 if capacity is None else int(capacity)


def replay_arrays(op, key, nbytes, stream, expandable_segments: bool = False,
                  capacity: int | None = None) -> Replayed:
    """`replay` of events given as arrays (op, key, nbytes, stream per event; the same rules and
    results), run by the compiled replay when it is built (`native_replay`: about 20x faster on a
    12,000-event step), else by `replay`."""
    lib = native_replay()
    if lib is None:
        return _replayed(replay(zip(itertools.repeat(0), op.tolist(), key.tolist(), nbytes.tolist(),
                                    stream.tolist()), expandable_segments, capacity))
    num_keys, dense_key = _dense(key, np.int64)
    num_streams, dense_stream = _dense(stream, np.int32)
    arrays = (np.ascontiguousarray(op, np.int8), dense_key, np.ascontiguousarray(nbytes, np.int64), dense_stream)
    return _call(lib.replay, len(op), *(a.ctypes.data for a in arrays), num_keys, num_streams,
                 *_settings(expandable_segments, capacity))


def replay_batches(first: tuple, batch: tuple, sizes: np.ndarray, sequence, expandable_segments: bool = False,
                   capacity: int | None = None) -> Replayed:
    """Replay the events `first` (arrays op, key, nbytes, stream), then one batch per entry of
    `sequence`: the events of `batch` (arrays op, key, stream) with the bytes of row
    `sizes[entry]` (an array of one row per batch shape), a zero-byte allocation left out (its free
    is then ignored: an empty tensor allocates nothing).

    A batch is skipped when one of the same row was replayed since the allocator last mapped or
    released a segment (`segment_changes`): a batch that frees all it allocates, with freed blocks
    merging with their free neighbours, starts from the same cached segments, makes the same
    requests and reaches the same peaks. Compiled when built (`native_replay`), else in Python."""
    op, key, stream = batch
    sequence = np.asarray(sequence, np.int64)
    lib = native_replay()
    if lib is None:
        alloc = CachingAllocator(expandable_segments, capacity)
        ops, keys, streams = op.tolist(), key.tolist(), stream.tolist()

        def events():
            yield from zip(itertools.repeat(0), *(a.tolist() for a in first))
            last = {}  # row -> segment_changes when it was last replayed (the count only grows)
            for row in sequence.tolist():
                if last.get(row) == alloc.segment_changes:  # `replay` has replayed the previous batch
                    continue
                last[row] = alloc.segment_changes
                for o, k, nb, st in zip(ops, keys, sizes[row].tolist(), streams):
                    if nb or o < 0:
                        yield 0, o, k, nb, st
        return _replayed(replay(events(), alloc=alloc))
    n0 = len(first[0])
    num_keys, keys = _dense(np.concatenate([first[1], key]), np.int64)
    num_streams, streams = _dense(np.concatenate([first[3], stream]), np.int32)
    head = (np.ascontiguousarray(first[0], np.int8), keys[:n0], np.ascontiguousarray(first[2], np.int64),
            streams[:n0])
    body = (np.ascontiguousarray(op, np.int8), np.ascontiguousarray(keys[n0:]),
            np.ascontiguousarray(sizes, np.int64), np.ascontiguousarray(streams[n0:]))
    return _call(lib.replay_batches, n0, *(a.ctypes.data for a in head), len(op), *(a.ctypes.data for a in body),
                 len(sequence), sequence.ctypes.data, len(sizes), num_keys, num_streams,
                 *_settings(expandable_segments, capacity))

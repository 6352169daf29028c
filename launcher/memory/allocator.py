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
  returned (no `empty_cache`, no out-of-memory retry).
With `expandable_segments:True` (PYTORCH_CUDA_ALLOC_CONF; "Note [Expandable Segments]" in the
same file) each pool is one segment per stream that grows by whole pages (2 MiB for the small pool,
20 MiB for the large one): a request no free block fits is placed at the segment's end, extending
the free block there (if any) by the pages it lacks, and reserved is the mapped pages; every block
is split when at least 512 B remain (`should_split` with expandable segments); best fit and
merging are as above.
Not modelled: streams (blocks used on a side stream are freed late), `roundup_power2_divisions`,
garbage-collection thresholds.
"""
from __future__ import annotations

import bisect
import itertools

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
    __slots__ = ("seg", "offset", "size", "free", "prev", "next", "small")

    def __init__(self, seg, offset, size, small):
        self.seg, self.offset, self.size, self.free, self.small = seg, offset, size, True, small
        self.prev = self.next = None

    def key(self):
        return (self.size, self.seg, self.offset)


class CachingAllocator:
    """Replays malloc/free; tracks allocated and reserved bytes and their peaks."""

    def __init__(self, expandable_segments: bool = False):
        self.expandable = expandable_segments
        self._head = {True: None, False: None}  # expandable: the first block of each pool's segment
        self._free = {True: [], False: []}  # small? -> sorted keys
        self._blocks = {}  # key -> block, free blocks only
        self._seg_ids = itertools.count()
        self.reserved = self.allocated = 0
        self.peak_reserved = self.peak_allocated = 0

    def _insert(self, small: bool, b: _Block) -> None:
        b.free = True
        bisect.insort(self._free[small], b.key())
        self._blocks[b.key()] = b

    def _remove(self, small: bool, b: _Block) -> None:
        keys = self._free[small]
        del keys[bisect.bisect_left(keys, b.key())]
        del self._blocks[b.key()]
        b.free = False

    def malloc(self, nbytes: int) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        keys = self._free[small]
        i = bisect.bisect_left(keys, (size, -1, -1))
        if i < len(keys):
            block = self._blocks[keys[i]]
            self._remove(small, block)
        elif self.expandable:
            block = self._grow(small, size)
        else:
            seg_bytes = allocation_size(size)
            block = _Block(next(self._seg_ids), 0, seg_bytes, small)
            block.free = False
            self.reserved += seg_bytes
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        remaining = block.size - size
        if ((small or self.expandable) and remaining >= MIN_BLOCK) or (not small and remaining > SMALL_SIZE):
            rest = _Block(block.seg, block.offset + size, remaining, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(small, rest)
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def _grow(self, small: bool, size: int) -> _Block:
        """Map pages at the end of the pool's one segment for `size` bytes: the free block at the
        end (if any) grows by the missing pages, else a new block starts there."""
        page = SMALL_BUFFER if small else LARGE_BUFFER
        tail = self._head[small]  # merging keeps a segment's first block (it absorbs, never is absorbed)
        while tail is not None and tail.next is not None:
            tail = tail.next
        if tail is not None and tail.free:
            self._remove(small, tail)
            added = -(-(size - tail.size) // page) * page
            tail.size += added
            block = tail
        else:
            added = -(-size // page) * page
            block = _Block(0, (tail.offset + tail.size) if tail else 0, added, small)
            block.free = False
            block.prev = tail
            if tail is not None:
                tail.next = block
            else:
                self._head[small] = block
        self.reserved += added
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def free(self, block: _Block) -> None:
        small = block.small
        self.allocated -= block.size
        for nb in (block.prev, block.next):
            if nb is not None and nb.free:
                self._remove(small, nb)
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
        self._insert(small, block)


def replay(events, expandable_segments: bool = False) -> CachingAllocator:
    """Replay `(time, op, key, nbytes)` tuples in order: op +1 allocates `nbytes` for `key`, -1
    frees `key` (unknown keys are ignored)."""
    alloc = CachingAllocator(expandable_segments)
    live = {}
    for _, op, key, nbytes in events:
        if op > 0:
            live[key] = alloc.malloc(nbytes)
        elif key in live:
            alloc.free(live.pop(key))
    return alloc

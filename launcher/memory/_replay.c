/* The caching-allocator simulator of allocator.py (`CachingAllocator`, `replay`), compiled: the same
 * rules, event for event, for the replays a plan runs (replay.py `held_cache`). allocator.py is the
 * reference and documents every rule with its source (c10/cuda/CUDACachingAllocator.cpp);
 * tests/unit/test_native_replay.py checks that both give the same result on random event streams.
 *
 * Entry points: `replay` and `replay_batches`, as allocator.py's functions of the same names.
 * Input: events (op: +1 allocate `size` bytes for `key` on stream `stream`, -1 free `key`, 0 restart the
 * peaks from the current bytes: allocator.py `restart_peaks`), keys and
 * streams renumbered densely by the caller (0 <= key < num_keys, 0 <= stream < num_streams).
 * Output: out[0..5] = peak_reserved, peak_allocated, peak_needed, reserved, allocated, segment_changes.
 * Returns 0, or -1 when memory runs out on the host. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MIN_BLOCK 512LL
#define SMALL_SIZE (1LL << 20)
#define SMALL_BUFFER (2LL << 20)
#define LARGE_BUFFER (20LL << 20)
#define MIN_LARGE_ALLOC (10LL << 20)
#define ROUND_LARGE (2LL << 20)

typedef struct {
    int64_t seg, offset, size;
    int64_t prev, next; /* block indices, -1: none */
    int32_t pool;
    int8_t free;
} Block;

typedef struct { int64_t size, seg, offset, block; } Entry; /* a free block, ordered by (size, seg, offset) */

typedef struct {
    Entry *e;
    int64_t n, cap;
    int64_t head; /* expandable: the first block of the pool's segment, -1: none */
} FreeList;

typedef struct {
    Block *b;
    int64_t n, cap;
    FreeList *pools;
    int num_pools, expandable;
    int64_t capacity; /* < 0: unlimited */
    int64_t seg_ids, reserved, allocated, peak_reserved, peak_allocated, releasable, peak_needed, segment_changes;
    int failed;
} Alloc;

static int64_t ceil_to(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

static int64_t new_block(Alloc *a, int64_t seg, int64_t offset, int64_t size, int32_t pool) {
    if (a->n == a->cap) {
        int64_t cap = a->cap ? 2 * a->cap : 1024;
        Block *b = realloc(a->b, cap * sizeof(Block));
        if (!b) { a->failed = 1; return -1; }
        a->b = b, a->cap = cap;
    }
    Block *x = &a->b[a->n];
    x->seg = seg, x->offset = offset, x->size = size, x->pool = pool, x->free = 1, x->prev = x->next = -1;
    return a->n++;
}

static int less(const Entry *e, int64_t size, int64_t seg, int64_t offset) {
    if (e->size != size) return e->size < size;
    if (e->seg != seg) return e->seg < seg;
    return e->offset < offset;
}

static int64_t lower_bound(const FreeList *f, int64_t size, int64_t seg, int64_t offset) {
    int64_t lo = 0, hi = f->n;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (less(&f->e[mid], size, seg, offset)) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static int64_t releasable_of(const Alloc *a, const Block *b) {
    if (a->expandable) {
        int64_t page = (b->pool & 1) ? SMALL_BUFFER : LARGE_BUFFER; /* pool = 2 * stream + small */
        if (b->size < page) return 0;
        return (b->offset + b->size) / page * page - ceil_to(b->offset, page);
    }
    return (b->prev < 0 && b->next < 0) ? b->size : 0;
}

static void insert(Alloc *a, int64_t i) {
    Block *b = &a->b[i];
    FreeList *f = &a->pools[b->pool];
    b->free = 1;
    if (f->n == f->cap) {
        int64_t cap = f->cap ? 2 * f->cap : 64;
        Entry *e = realloc(f->e, cap * sizeof(Entry));
        if (!e) { a->failed = 1; return; }
        f->e = e, f->cap = cap;
    }
    int64_t at = lower_bound(f, b->size, b->seg, b->offset);
    memmove(&f->e[at + 1], &f->e[at], (f->n - at) * sizeof(Entry));
    f->e[at] = (Entry){b->size, b->seg, b->offset, i};
    f->n++;
    a->releasable += releasable_of(a, b);
}

static void take(FreeList *f, int64_t at) {
    memmove(&f->e[at], &f->e[at + 1], (f->n - at - 1) * sizeof(Entry));
    f->n--;
}

static void remove_free(Alloc *a, int64_t i) {
    Block *b = &a->b[i];
    FreeList *f = &a->pools[b->pool];
    take(f, lower_bound(f, b->size, b->seg, b->offset));
    a->releasable -= releasable_of(a, b);
    b->free = 0;
}

static void release_cached_blocks(Alloc *a) {
    if (a->expandable) return;
    for (int p = 0; p < a->num_pools; p++) {
        FreeList *f = &a->pools[p];
        int64_t kept = 0, whole = 0;
        for (int64_t j = 0; j < f->n; j++) {
            Block *b = &a->b[f->e[j].block];
            if (b->prev < 0 && b->next < 0) {
                a->reserved -= b->size, a->releasable -= b->size, whole++;
                b->free = 0; /* returned to the driver: no longer a block of the pool */
            } else {
                f->e[kept++] = f->e[j];
            }
        }
        f->n = kept;
        if (whole) a->segment_changes++;
    }
}

static int64_t grow(Alloc *a, int32_t pool, int64_t size) {
    int64_t page = (pool & 1) ? SMALL_BUFFER : LARGE_BUFFER, added, block;
    int64_t tail = a->pools[pool].head;
    while (tail >= 0 && a->b[tail].next >= 0) tail = a->b[tail].next;
    if (tail >= 0 && a->b[tail].free) {
        remove_free(a, tail);
        added = ceil_to(size - a->b[tail].size, page);
        a->b[tail].size += added;
        block = tail;
    } else {
        added = ceil_to(size, page);
        int64_t seg = tail >= 0 ? a->b[tail].seg : a->seg_ids++;
        int64_t offset = tail >= 0 ? a->b[tail].offset + a->b[tail].size : 0;
        block = new_block(a, seg, offset, added, pool);
        if (block < 0) return -1;
        a->b[block].free = 0;
        a->b[block].prev = tail;
        if (tail >= 0) a->b[tail].next = block; else a->pools[pool].head = block;
    }
    a->reserved += added;
    a->segment_changes++;
    if (a->reserved > a->peak_reserved) a->peak_reserved = a->reserved;
    return block;
}

static int64_t alloc_block(Alloc *a, int64_t nbytes, int32_t stream) {
    int64_t size = nbytes < MIN_BLOCK ? MIN_BLOCK : ceil_to(nbytes, MIN_BLOCK);
    int small = size <= SMALL_SIZE;
    int32_t pool = stream * 2 + small;
    FreeList *f = &a->pools[pool];
    int64_t at = lower_bound(f, size, 0, 0), block;
    if (at < f->n) {
        block = f->e[at].block;
        take(f, at);
        a->releasable -= releasable_of(a, &a->b[block]);
        a->b[block].free = 0;
    } else if (a->expandable) {
        block = grow(a, pool, size);
        if (block < 0) return -1;
    } else {
        int64_t seg_bytes = small ? SMALL_BUFFER : size < MIN_LARGE_ALLOC ? LARGE_BUFFER : ceil_to(size, ROUND_LARGE);
        if (a->capacity >= 0 && a->reserved + seg_bytes > a->capacity && a->releasable) release_cached_blocks(a);
        block = new_block(a, a->seg_ids++, 0, seg_bytes, pool);
        if (block < 0) return -1;
        a->b[block].free = 0;
        a->segment_changes++;
        a->reserved += seg_bytes;
        if (a->reserved > a->peak_reserved) a->peak_reserved = a->reserved;
    }
    int64_t remaining = a->b[block].size - size;
    if (((small || a->expandable) && remaining >= MIN_BLOCK) || (!small && remaining > SMALL_SIZE)) {
        int64_t rest = new_block(a, a->b[block].seg, a->b[block].offset + size, remaining, pool);
        if (rest < 0) return -1;
        Block *b = &a->b[block], *r = &a->b[rest];
        r->prev = block, r->next = b->next;
        if (b->next >= 0) a->b[b->next].prev = rest;
        b->next = rest, b->size = size;
        insert(a, rest);
    }
    a->allocated += a->b[block].size;
    if (a->allocated > a->peak_allocated) a->peak_allocated = a->allocated;
    if (a->reserved - a->releasable > a->peak_needed) a->peak_needed = a->reserved - a->releasable;
    return block;
}

static void free_block(Alloc *a, int64_t i) {
    a->allocated -= a->b[i].size;
    int64_t neighbours[2] = {a->b[i].prev, a->b[i].next};
    for (int k = 0; k < 2; k++) {
        int64_t nb = neighbours[k];
        if (nb < 0 || !a->b[nb].free) continue;
        remove_free(a, nb);
        if (k == 0) { /* the previous block absorbs this one */
            a->b[nb].size += a->b[i].size;
            a->b[nb].next = a->b[i].next;
            if (a->b[i].next >= 0) a->b[a->b[i].next].prev = nb;
            i = nb;
        } else { /* this block absorbs the next one */
            a->b[i].size += a->b[nb].size;
            a->b[i].next = a->b[nb].next;
            if (a->b[nb].next >= 0) a->b[a->b[nb].next].prev = i;
        }
    }
    insert(a, i);
}

static int start(Alloc *a, int64_t **live, int64_t num_keys, int32_t num_streams, int32_t expandable,
                 int64_t capacity) {
    memset(a, 0, sizeof *a);
    a->expandable = expandable, a->capacity = capacity, a->num_pools = 2 * num_streams;
    a->pools = calloc(a->num_pools ? a->num_pools : 1, sizeof(FreeList));
    *live = malloc((num_keys ? num_keys : 1) * sizeof(int64_t));
    if (!a->pools || !*live) return -1;
    for (int p = 0; p < a->num_pools; p++) a->pools[p].head = -1;
    for (int64_t k = 0; k < num_keys; k++) (*live)[k] = -1;
    return 0;
}

static void event(Alloc *a, int64_t *live, int8_t op, int64_t key, int64_t size, int32_t stream) {
    if (op > 0) {
        live[key] = alloc_block(a, size, stream);
    } else if (op == 0) {
        a->peak_reserved = a->reserved, a->peak_allocated = a->allocated;
        a->peak_needed = a->reserved - a->releasable;
    } else if (live[key] >= 0) {
        free_block(a, live[key]);
        live[key] = -1;
    }
}

static int finish(Alloc *a, int64_t *live, int64_t *out) {
    out[0] = a->peak_reserved, out[1] = a->peak_allocated, out[2] = a->peak_needed;
    out[3] = a->reserved, out[4] = a->allocated, out[5] = a->segment_changes;
    if (a->pools)
        for (int p = 0; p < a->num_pools; p++) free(a->pools[p].e);
    free(a->pools), free(a->b), free(live);
    return a->failed ? -1 : 0;
}

/* allocator.py `replay` */
int replay(int64_t n, const int8_t *op, const int64_t *key, const int64_t *size, const int32_t *stream,
           int64_t num_keys, int32_t num_streams, int32_t expandable, int64_t capacity, int64_t *out) {
    Alloc a;
    int64_t *live = NULL;
    if (start(&a, &live, num_keys, num_streams, expandable, capacity)) { a.failed = 1; return finish(&a, live, out); }
    for (int64_t j = 0; j < n && !a.failed; j++) event(&a, live, op[j], key[j], size[j], stream[j]);
    return finish(&a, live, out);
}

/* allocator.py `replay_batches`: the n0 first events, then per entry of `sequence` (an index into
 * the rows of `sizes`, num_lengths x m) the m batch events at that row's sizes, skipping a batch
 * whose row was replayed since the last segment change, and a batch's zero-byte allocations. */
int replay_batches(int64_t n0, const int8_t *op0, const int64_t *key0, const int64_t *size0, const int32_t *stream0,
                   int64_t m, const int8_t *op, const int64_t *key, const int64_t *sizes, const int32_t *stream,
                   int64_t num_batches, const int64_t *sequence, int64_t num_lengths,
                   int64_t num_keys, int32_t num_streams, int32_t expandable, int64_t capacity, int64_t *out) {
    Alloc a;
    int64_t *live = NULL;
    int failed = start(&a, &live, num_keys, num_streams, expandable, capacity);
    int64_t *last = malloc((num_lengths ? num_lengths : 1) * sizeof(int64_t));
    if (failed || !last) {
        free(last);
        a.failed = 1;
        return finish(&a, live, out);
    }
    for (int64_t j = 0; j < n0 && !a.failed; j++) event(&a, live, op0[j], key0[j], size0[j], stream0[j]);
    for (int64_t l = 0; l < num_lengths; l++) last[l] = -1;
    for (int64_t i = 0; i < num_batches && !a.failed; i++) {
        int64_t row = sequence[i];
        if (last[row] == a.segment_changes) continue; /* replayed since the last segment change */
        last[row] = a.segment_changes;
        const int64_t *sz = sizes + row * m;
        for (int64_t j = 0; j < m && !a.failed; j++)
            if (sz[j] || op[j] < 0) event(&a, live, op[j], key[j], sz[j], stream[j]);
    }
    free(last);
    return finish(&a, live, out);
}

"""ColossalAI Gemini (GeminiPlugin, ColossalAI 0.5.0): chunk-size search, chunk packing and the
per-rank bytes of its chunks. Paths below are under colossalai/zero/gemini/.

Gemini stores parameters in chunks (chunk/chunk.py `Chunk`): contiguous buffers of `chunk_size`
elements, each sharded over the data-parallel ranks (shard = chunk_size / dp) unless the chunk is
`keep_gathered`. The 16-bit parameters live in 'fp16_param' chunks, the fp32 master copies in
'fp32_param' chunks of the same layout (gemini_ddp.py `_preprocess_param`: `fp32_p = p.clone()
.float()`, registered in group 'fp32_param'). Gradients reuse the 16-bit chunks
(`reuse_fp16_chunk=True`, chunk/utils.py `init_chunk_manager`): backward copies each gradient
into its parameter's slot and reduce-scatters the chunk, so no separate gradient storage exists.
A chunk is gathered (full `chunk_size` elements) while an operator uses one of its parameters
(gemini_hook.py `GeminiZeROHook.pre_op`), and released after.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MEGA = 1024**2
DEFAULT_SEARCH_INTERVAL = 1024  # chunk/utils.py init_chunk_manager: hidden_dim or 1024


def unused_elements(sizes: list[int], chunk_size: int) -> int:
    """chunk/search_utils.py `_get_unused_byte`: packing `sizes` in order into chunks of
    `chunk_size`, the elements left empty (a tensor that does not fit closes the chunk)."""
    acc, left = 0, 0
    for s in sizes:
        if s > left:
            acc += left
            left = chunk_size
        left -= s
    return left + acc


def unused_elements_many(sizes: list[int], chunk_sizes: np.ndarray) -> np.ndarray:
    """`unused_elements` for many candidate chunk sizes at once (the same packing, vectorised
    over the candidates so a 32 M-element search range costs milliseconds)."""
    chunk_sizes = np.asarray(chunk_sizes, dtype=np.int64)
    acc = np.zeros_like(chunk_sizes)
    left = np.zeros_like(chunk_sizes)
    for s in sizes:
        closes = s > left
        acc += np.where(closes, left, 0)
        left = np.where(closes, chunk_sizes, left) - s
    return left + acc


def filter_extra_large(sizes: list[int]) -> list[int]:
    """search_utils.py `_filter_exlarge_params`: drop sizes above mean + 3 std (population std,
    numpy default) from the search; such tensors (typically the embedding and the LM head) get a
    chunk of their own."""
    if not sizes:
        return sizes
    arr = np.array(sizes, dtype=np.float64)
    upper = arr.mean() + 3 * arr.std()
    return [s for s in sizes if s <= upper]


@dataclass(frozen=True)
class ChunkSearch:
    chunk_size: int  # elements
    keep_gathered: bool  # whole model in one unsharded chunk
    wasted_elements: int


def search_chunk_size(sizes: list[int], dp: int, search_range_m: float = 32,
                      min_chunk_size_m: float = 32, hidden_dim: int | None = None) -> ChunkSearch:
    """search_utils.py `search_chunk_configuration` for one data-parallel degree `dp`
    (filter_exlarge_params=True, as GeminiDDP calls it): a model smaller than the minimum chunk is
    one kept-gathered chunk; otherwise the chunk size with the least waste in
    [start, start + search_range] stepping by the search interval, start = the largest (filtered)
    tensor or the minimum chunk rounded up to the interval, then rounded up to a multiple of dp."""
    interval = hidden_dim or DEFAULT_SEARCH_INTERVAL
    search_range, min_chunk = round(search_range_m * MEGA), round(min_chunk_size_m * MEGA)
    total = sum(sizes)
    if total < min_chunk:
        return ChunkSearch(total, True, 0)
    kept = filter_extra_large(sizes)
    start = int(math.ceil(max([min_chunk, *kept]) / interval) * interval)
    candidates = np.arange(start, start + search_range + 1, interval, dtype=np.int64)
    wastes = unused_elements_many(kept, candidates)
    i = int(np.argmin(wastes))  # the first of equal minima, as the sequential search keeps it
    best, best_waste = int(candidates[i]), int(wastes[i])
    best += -best % dp
    return ChunkSearch(best, False, int(best_waste))


def pack_chunks(sizes: list[int], chunk_size: int, dp: int) -> list[int]:
    """chunk/manager.py `ChunkManager.register_tensor`: tensors appended in order to the last
    chunk; one that does not fit closes it and opens a new chunk of `chunk_size`, or of its own
    numel rounded up to a multiple of dp when larger. Returns each chunk's size in elements."""
    chunks: list[int] = []
    used = 0
    for n in sizes:
        if chunks and used + n <= chunks[-1]:
            used += n
            continue
        size = chunk_size if n <= chunk_size else n + (-n % dp)
        chunks.append(size)
        used = n
    return chunks


@dataclass(frozen=True)
class GeminiBytes:
    """Per-rank bytes of Gemini's storages (static placement)."""

    param_shards: int  # 16-bit parameter (and gradient) chunk shards on the device
    master_shards: int  # fp32 master chunk shards on the device
    optimizer_states: int  # Adam exp_avg + exp_avg_sq on the device
    gathered: int  # chunks gathered at once during compute (the two largest)
    host: int  # offloaded shards (master/states or parameters) in host memory
    num_chunks: int
    chunk_size: int


def gemini_bytes(sizes: list[int], dp: int, model_bytes: int, search: ChunkSearch,
                 shard_param_frac: float = 1.0, offload_optim_frac: float = 0.0,
                 offload_param_frac: float = 0.0, state_factor: int = 2) -> GeminiBytes:
    """Bytes per rank. Chunks are sharded over dp (kept-gathered chunks are not); the first
    `shard_param_frac` of the chunks are sharded, the rest stay replicated
    (placement_policy.py `StaticPlacementPolicy`: `shard_param_frac`, `offload_param_frac`,
    `offload_optim_frac` select chunks by fraction of the total size, in order). fp32 master and
    optimizer states follow the fp32 chunks; Adam keeps 2 fp32 states per master element
    (gemini_optimizer.py over HybridAdam or a torch Adam). Gathered: an operator touches at most
    the chunks holding its parameters; assumed the two largest chunks (a parameter set spanning
    a chunk boundary)."""
    chunks = [search.chunk_size] if search.keep_gathered else pack_chunks(sizes, search.chunk_size, dp)
    total = sum(chunks)
    shard_div = 1 if search.keep_gathered else dp
    sharded_numel = int(total * shard_param_frac) if shard_div > 1 else 0
    per_rank_params = sharded_numel // shard_div + (total - sharded_numel)
    per_rank_fp32 = total // shard_div
    param_off = int(per_rank_params * offload_param_frac)
    optim_off = int(per_rank_fp32 * offload_optim_frac)
    largest = sorted(chunks, reverse=True)[:2]
    gathered = 0 if search.keep_gathered else model_bytes * sum(largest)
    return GeminiBytes(
        param_shards=model_bytes * (per_rank_params - param_off),
        master_shards=4 * (per_rank_fp32 - optim_off),
        optimizer_states=4 * state_factor * (per_rank_fp32 - optim_off),
        gathered=gathered,
        host=model_bytes * param_off + 4 * (1 + state_factor) * optim_off,
        num_chunks=len(chunks), chunk_size=search.chunk_size)

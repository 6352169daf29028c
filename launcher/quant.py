"""Bytes held by quantized weights (bitsandbytes 4-bit and LLM.int8) and by memory-saving optimizer
states (bitsandbytes 8-bit Adam/AdamW, transformers' Adafactor).

Pure arithmetic: no torch import. Each function names the library source whose tensors it counts
(paths relative to site-packages, bitsandbytes 0.50 and transformers 5.23)."""
from __future__ import annotations

import math
from typing import Iterable, Sequence

FP32_BYTES = 4
# bitsandbytes/functional.py get_4bit_type: 16 fp32 code values (nf4, fp4).
FOUR_BIT_CODE_ENTRIES = 16
# bitsandbytes/functional.py create_dynamic_map: 256 fp32 code values (8-bit dynamic map).
DYNAMIC_MAP_ENTRIES = 256
FOUR_BIT_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
# bitsandbytes/functional.py quantize_4bit: `quantize_blockwise(_absmax - offset, blocksize=256)`.
DOUBLE_QUANT_BLOCKSIZE = 256
# bitsandbytes/optim/optimizer.py Optimizer2State/Optimizer1State.init_state.
OPTIM_8BIT_BLOCKSIZE = 256
MIN_8BIT_SIZE = 4096
# bitsandbytes/optim/optimizer.py Optimizer8bit.get_state_buffer: `if not self.is_paged or p.numel() < 1e5`.
PAGED_MIN_NUMEL = 100_000


def _num_blocks(numel: int, blocksize: int) -> int:
    return -(-numel // blocksize)


def four_bit_weight_bytes(numel: int, blocksize: int = 64, double_quant: bool = True,
                          double_quant_blocksize: int = DOUBLE_QUANT_BLOCKSIZE,
                          quant_type: str = "nf4") -> dict:
    """Bytes of one weight quantized by `bitsandbytes.functional.quantize_4bit` (what `Params4bit`
    keeps: the packed weight plus every tensor of its `QuantState`), with uint8 quant_storage.

    Source: bitsandbytes/functional.py quantize_4bit, get_4bit_type, quantize_blockwise, QuantState;
    bitsandbytes/backends/cuda/ops.py quantize_4bit (same sizes as backends/default/ops.py):
    - packed weight: ceil(numel / 2) uint8 (two 4-bit codes per byte);
    - absmax: one fp32 per block of `blocksize` elements (last block partial);
    - code: the 16-entry fp32 nf4/fp4 table;
    - double quantization (`compress_statistics=True`): absmax becomes uint8 per block, quantized in
      blocks of 256 by quantize_blockwise, which stores a second-level fp32 absmax per 256 blocks,
      its own copy of the 256-entry fp32 dynamic map, and the fp32 scalar `offset` (absmax mean).
    nf4 and fp4 differ only in the code values, not in sizes."""
    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    if blocksize not in FOUR_BIT_BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {FOUR_BIT_BLOCKSIZES}, got {blocksize}")
    num_blocks = _num_blocks(numel, blocksize)
    out = {
        "packed_weight_bytes": (numel + 1) // 2,
        "code_bytes": FOUR_BIT_CODE_ENTRIES * FP32_BYTES,
        "absmax_bytes": num_blocks * (1 if double_quant else FP32_BYTES),
        "nested_absmax_bytes": 0,
        "nested_code_bytes": 0,
        "offset_bytes": 0,
    }
    if double_quant:
        out["nested_absmax_bytes"] = _num_blocks(num_blocks, double_quant_blocksize) * FP32_BYTES
        out["nested_code_bytes"] = DYNAMIC_MAP_ENTRIES * FP32_BYTES
        out["offset_bytes"] = FP32_BYTES
    out["total_bytes"] = sum(out.values())
    return out


def nf4_weight_bytes(numel: int, blocksize: int = 64, double_quant: bool = True,
                     double_quant_blocksize: int = DOUBLE_QUANT_BLOCKSIZE) -> dict:
    """NF4 (QLoRA, arXiv:2305.14314) storage of one weight; see `four_bit_weight_bytes`."""
    return four_bit_weight_bytes(numel, blocksize, double_quant, double_quant_blocksize, "nf4")


def fp4_weight_bytes(numel: int, blocksize: int = 64, double_quant: bool = True,
                     double_quant_blocksize: int = DOUBLE_QUANT_BLOCKSIZE) -> dict:
    """FP4 storage of one weight; same layout as NF4 (see `four_bit_weight_bytes`)."""
    return four_bit_weight_bytes(numel, blocksize, double_quant, double_quant_blocksize, "fp4")


def int8_weight_bytes(out_features: int, in_features: int) -> dict:
    """LLM.int8 (arXiv:2208.07339) storage of one Linear weight [out, in] as `Int8Params` keeps it.

    Source: bitsandbytes/nn/modules.py Int8Params._quantize (`CB, SCB, _ = int8_vectorwise_quant(B)`;
    `self.data = CB`), bitsandbytes/_ops.py int8_vectorwise_quant fake: int8 [out, in] plus one fp32
    row scale (SCB) per output row. Outlier columns are found per input at run time, not stored."""
    out = {"int8_weight_bytes": out_features * in_features, "row_scale_bytes": out_features * FP32_BYTES}
    out["total_bytes"] = sum(out.values())
    return out


def adamw_8bit_state_bytes(param_numels: Iterable[int], min_8bit_size: int = MIN_8BIT_SIZE,
                           num_states: int = 2, paged: bool = False) -> dict:
    """Optimizer state of bitsandbytes' 8-bit blockwise optimizers (AdamW8bit/Adam8bit: 2 states;
    1-state ones such as Lion8bit or SGD with momentum: num_states=1), after the first step.

    Source: bitsandbytes/optim/optimizer.py Optimizer2State.init_state (Optimizer1State likewise):
    - numel < min_8bit_size (default 4096): fp32 states, 4 bytes x numel each;
    - otherwise uint8 states (1 byte x numel each) plus, per state, one fp32 absmax per block of 256;
    - the signed ('dynamic', state1) and unsigned ('udynamic', state2) 256-entry fp32 maps are one
      tensor per optimizer shared by every parameter (`state["qmap1"] = self.name2qmap["dynamic"]`).
    Paged (PagedAdamW8bit, `is_paged=True`): same bytes. Optimizer8bit.get_state_buffer puts the state1/
    state2 of parameters with numel >= 1e5 in CUDA unified memory (functional.get_paged:
    cget_managed_ptr, i.e. cudaMallocManaged), outside PyTorch's caching allocator: they live on the GPU
    while used, the driver may evict them to host RAM under memory pressure, and
    `torch.cuda.memory_allocated` does not count them (`paged_bytes`, part of `total_bytes`); absmax
    and qmaps are ordinary device tensors."""
    totals = dict.fromkeys(("fp32_state_bytes", "uint8_state_bytes", "absmax_bytes", "qmap_bytes",
                            "paged_bytes"), 0)
    any_8bit = False
    for numel in param_numels:
        if numel < min_8bit_size:
            state_bytes = num_states * numel * FP32_BYTES
            totals["fp32_state_bytes"] += state_bytes
        else:
            any_8bit = True
            state_bytes = num_states * numel
            totals["uint8_state_bytes"] += state_bytes
            totals["absmax_bytes"] += num_states * _num_blocks(numel, OPTIM_8BIT_BLOCKSIZE) * FP32_BYTES
        if paged and numel >= PAGED_MIN_NUMEL:
            totals["paged_bytes"] += state_bytes
    totals["qmap_bytes"] = num_states * DYNAMIC_MAP_ENTRIES * FP32_BYTES if any_8bit else 0
    totals["total_bytes"] = sum(v for k, v in totals.items() if k != "paged_bytes")
    return totals


def adamw_32bit_state_bytes(param_numels: Iterable[int], paged: bool = False) -> dict:
    """Optimizer state of bitsandbytes' 32-bit AdamW (PagedAdamW32bit, AdamW32bit) after the first
    step: exp_avg and exp_avg_sq in fp32 whatever the parameter's dtype (bitsandbytes/optim/
    optimizer.py Optimizer2State.init_state, `optim_bits == 32`: `get_state_buffer(p, dtype=
    torch.float32)` twice; `step` is a Python int), updated in place by `optimizer_update_32bit`.
    Paged: the states of parameters with numel >= 1e5 are in CUDA unified memory (`paged_bytes`),
    as in `adamw_8bit_state_bytes`."""
    totals = {"fp32_state_bytes": 0, "paged_bytes": 0}
    for numel in param_numels:
        totals["fp32_state_bytes"] += 2 * numel * FP32_BYTES
        if paged and numel >= PAGED_MIN_NUMEL:
            totals["paged_bytes"] += 2 * numel * FP32_BYTES
    totals["total_bytes"] = totals["fp32_state_bytes"]
    return totals


def adafactor_state_bytes(param_shapes: Iterable[Sequence[int]], beta1: float | None = None,
                          dtype_bytes: int = FP32_BYTES) -> dict:
    """State of transformers' Adafactor (Shazeer & Stern, arXiv:1804.04235) after the first step.

    Source: transformers/optimization.py Adafactor._get_options and step: a parameter with >= 2 dims
    is factored into `exp_avg_sq_row` (shape[:-1]) and `exp_avg_sq_col` (shape[:-2] + shape[-1:]);
    others keep a full `exp_avg_sq`; `exp_avg` (full size) only when beta1 is set. States take the
    gradient's dtype after `grad.float()` for fp16/bf16 gradients, hence 4 bytes by default.
    `RMS` is a 0-dim fp32 tensor per parameter (`_rms(p_data_fp32)`: the parameter upcast to fp32);
    `step` is a Python int."""
    first = second = num_params = 0
    for shape in param_shapes:
        num_params += 1
        shape = tuple(int(d) for d in shape)
        numel = math.prod(shape)
        if beta1 is not None:
            first += numel
        if len(shape) >= 2:
            second += math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]
        else:
            second += numel
    out = {"exp_avg_bytes": first * dtype_bytes, "second_moment_bytes": second * dtype_bytes,
           "rms_bytes": num_params * FP32_BYTES}
    out["total_bytes"] = sum(out.values())
    return out

"""GPU memory the trace cannot show: allocator rounding, cuBLAS workspaces, the CUDA context and
NCCL buffers. Sources are summarised in the project's GPU memory notes (GPU_MEMORY.md) and named
in each docstring. None of these apply to CPU processes (gloo, no CUDA runtime).
"""
from __future__ import annotations

MIB = 2**20
ALLOCATOR_ROUNDING_BYTES = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize


def allocator_rounding_bytes(device: str) -> int:
    """Every CUDA caching-allocator block is a multiple of 512 B (`round_size`, kMinBlockSize), and
    `max_memory_allocated` counts the rounded sizes. CPU tensors are not rounded (1)."""
    return ALLOCATOR_ROUNDING_BYTES if device == "cuda" else 1


def cublas_workspace_bytes(sm_arch: int) -> int:
    """cuBLAS workspaces allocated through the caching allocator (aten/src/ATen/cuda/
    CublasHandlePool.cpp `getChosenWorkspaceSize`): the default CUBLAS_WORKSPACE_CONFIG
    ':4096:2:16:8' is 4096 KiB x 2 + 16 KiB x 8 = 8.125 MiB (8,519,680 B measured on an A10G,
    pytorch issue 95668), 32 MiB on sm90 and newer. Assumption: two (handle, stream) pairs per
    training process (the main stream and autograd's backward thread) - inferred, not documented."""
    per_workspace = 32 * MIB if sm_arch >= 90 else 4096 * 1024 * 2 + 16 * 1024 * 8
    return 2 * per_workspace


def cublas_workspace_allocations(sm_arch: int) -> list[int]:
    """The workspace requests the allocator sees (two, see `cublas_workspace_bytes`)."""
    return [cublas_workspace_bytes(sm_arch) // 2] * 2


def cuda_context_bytes(cuda_context: int) -> int:
    """CUDA context + loaded kernels after the first step, outside the allocator: a per-hardware
    setting (conf/hardware/*.yaml `cuda_context_bytes`; 274 MiB lazy-loaded in PyTorch PR 86509,
    0.3-1 GiB typical), to be calibrated on a real GPU as nvidia-smi minus memory_reserved()."""
    return int(cuda_context)


def nccl_bytes(num_ranks: int) -> int:
    """NCCL communicator buffers, outside the allocator. Measured per process group on 4xA100 NVLink
    (NVIDIA/nccl issue 964): 544 MiB with 2 ranks, 688 MiB with more. Assumption: the same figures
    for every GPU type and NCCL version, MiB as nvidia-smi reports, one communicator per process
    group (several: `communicators_bytes`), none with a single rank (no collective runs). NVLS on
    H100 (about +256 MiB) is not modelled."""
    if num_ranks <= 1:
        return 0
    return 544 * MIB if num_ranks == 2 else 688 * MIB


def communicators_bytes(communicators) -> int:
    """NCCL buffers of every communicator a rank holds, given as their rank counts (a backend's
    `communicators`: the default process group and each group its framework creates; issue 864 of
    NVIDIA/nccl reports about 6 GB with three or more), each at `nccl_bytes`."""
    return sum(nccl_bytes(n) for n in communicators)


def flash_attention_backward_bytes(batch: int, seq_len: int, num_heads: int, num_kv_heads: int,
                                   head_dim: int, elem_bytes: int = 2) -> int:
    """Workspace FlashAttention-2's backward allocates for one attention call on a GPU, besides its
    outputs (flash-attention csrc/flash_attn/flash_api.cpp `mha_bwd`, vendored by PyTorch's SDPA
    flash backend in aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp):
    - dq_accum: fp32 [batch, seqlen_q rounded up to 128, heads, head_dim rounded up to 32];
    - softmax_d: fp32 [batch, heads, seqlen_q rounded up to 128];
    - with grouped-query attention (kv heads < heads) dk_expanded and dv_expanded: [batch, seqlen_k,
      heads, head_dim] in the input dtype, summed over each group afterwards.
    A CPU trace does not see them (they live inside the kernel call); they exist during one
    layer's attention backward at a time."""
    s_rounded = -(-seq_len // 128) * 128
    d_rounded = -(-head_dim // 32) * 32 if head_dim <= 192 else 256
    out = batch * s_rounded * num_heads * d_rounded * 4 + batch * num_heads * s_rounded * 4
    if num_kv_heads < num_heads:
        out += 2 * batch * seq_len * num_heads * head_dim * elem_bytes
    return out

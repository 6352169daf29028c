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
    group (several: `communicators_bytes`), none with a single rank (no collective runs). NVLS
    buffers on NVSwitch nodes come on top (`nvls_bytes`)."""
    if num_ranks <= 1:
        return 0
    return 544 * MIB if num_ranks == 2 else 688 * MIB


NVLS_CHANNELS = 16  # NCCL_NVLS_NCHANNELS default (2.17-2.24), NVLS_NCHANNELS_SM90 on Hopper (2.25+)
NVLS_MULTICAST_GRANULARITY = 512 * MIB  # assumption: see nvls_bytes
NVLS_ALLOC_GRANULARITY = 2 * MIB  # cuMemCreate's recommended granularity on the device


def nccl_version(text: str) -> tuple[int, int]:
    """(major, minor) of an NCCL version 'major.minor[.patch]'; ValueError if it is not one, or if it
    is older than 2.4 (a bare '2.20' given on Hydra's command line is read as the number 2.2)."""
    parts = str(text).split(".")
    if not (2 <= len(parts) <= 3 and all(p.isdigit() for p in parts)):
        raise ValueError(f"'{text}' is not an NCCL version major.minor.patch, e.g. 2.27.5")
    version = (int(parts[0]), int(parts[1]))
    if version < (2, 4):
        raise ValueError(f"'{text}' predates every torch 1.x/2.x NCCL; write it with its patch, e.g. 2.20.5 "
                         "(a bare 2.20 is read as the number 2.2)")
    return version


def nvls_bytes(local_ranks: int, version: tuple[int, int], num_nodes: int = 1) -> int:
    """Device memory NCCL binds to NVLink SHARP multicast objects for one communicator with
    `local_ranks` GPUs on each node, on an NVSwitch system with multicast (H100/H200 SXM), outside
    the allocator. Sources, NVIDIA/nccl src/transport/nvls.cc of each release:
    - `ncclNvlsInit`: NVLS only with more than 2 GPUs (`gpuCount <= 2` returns), from 2.17; 2.20
      also turns it off for a communicator across nodes (`comm->nNodes > 1`);
    - the buffers: `nChannels * 2 * (buffSize + memSize) * nHeads` bytes, with nChannels 16
      (NCCL_NVLS_NCHANNELS; NVLS_NCHANNELS_SM90 from 2.25) and one head per GPU of the node (graph/
      search.cc: intra-node NVLS "pull[s] evenly from all GPUs"; across nodes a head per NIC, at
      most as many: an upper bound); buffSize the 4 MiB NCCL_BUFFSIZE and memSize 2 MiB
      (NVLS_MEM_ALIGN_SIZE) up to 2.20; 2.21 takes buffSize = NCCL_NVLS_CHUNKSIZE 128 KiB x
      NCCL_STEPS 8 = 1 MiB; 2.22 drops memSize into a separate credit buffer of a few KiB;
    - every GPU of the multicast team backs the object with its own physical memory (CUDA
      programming guide, Multicast Support), made by `cuMemCreate` at the size aligned up to the
      multicast granularity (CU_MULTICAST_GRANULARITY_RECOMMENDED) up to 2.25, and to the
      allocation granularity (2 MiB) from 2.26 (`nvlsAllocateMem`: `ucsize` aligned to `ucgran`);
    - when: at communicator init up to 2.21; from 2.22 at the first NVLS collective
      (NCCL_RUNTIME_CONNECT=1), which a training step's large all-reduce, reduce-scatter or
      all-gather on such a node makes, so it is counted for every communicator.
    Assumption: a multicast granularity of 512 MiB, the smallest consistent with NCCL 2.19.3 logging
    a 1 GiB bind for 4 GPUs, whose computed size is 768 MiB (NVIDIA/nccl-tests issue 216). With 8
    GPUs this gives 1536 MiB per communicator up to 2.20, 1 GiB for 2.21, 512 MiB for 2.22-2.25
    and 258 MiB from 2.26 (about 256 MiB is logged on 8 x H100 with recent releases, the
    project's GPU memory notes). The credit buffer is aligned to 2 MiB (up to 2.25 it takes the
    minimum multicast granularity, assumed 2 MiB)."""
    if local_ranks <= 2 or version < (2, 17) or (version[:2] == (2, 20) and num_nodes > 1):
        return 0
    channels, heads = NVLS_CHANNELS, local_ranks
    if version < (2, 21):
        data, credit = channels * 2 * (4 * MIB + 2 * MIB) * heads, 0
    elif version < (2, 22):
        data, credit = channels * 2 * (1 * MIB + 2 * MIB) * heads, 0
    else:
        data, credit = channels * 2 * 1 * MIB * heads, channels * 2 * 64 * heads
    gran = NVLS_MULTICAST_GRANULARITY if version < (2, 26) else NVLS_ALLOC_GRANULARITY
    up = lambda n, g: -(-n // g) * g  # noqa: E731
    return up(data, gran) + up(credit, NVLS_ALLOC_GRANULARITY)


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

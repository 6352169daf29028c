"""GPU memory the trace cannot show: allocator rounding, cuBLAS workspaces, the CUDA context and
NCCL buffers. Sources are summarised in the project's GPU memory notes (GPU_MEMORY.md) and named
in each docstring. None of these apply to CPU processes (gloo, no CUDA runtime).
"""
from __future__ import annotations

from dataclasses import dataclass

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


NCCL_TRANSPORTS = ("nvlink", "pcie", "shm")
DEFAULT_NCCL_VERSION = "2.27"  # assumption: the series recent torch CUDA wheels pin (nvidia-nccl-cu12 2.27.x)
CUDA_IPC_MIN = 2 * MIB  # include/comm.h: P2P buffers are rounded up to it
CUMEM_GRANULARITY = 2 * MIB  # cuMemGetAllocationGranularity(MINIMUM) on NVIDIA GPUs, as CUDA_IPC_MIN
LL_BUFFSIZE = 8 * 512 * 8 * 16  # init.cc DEFAULT_LL_BUFFSIZE: LL lines/thread x threads x NCCL_STEPS x 16 B = 512 KiB
LL128_BUFFSIZE = 120 * 640 * 8 * 8  # DEFAULT_LL128_BUFFSIZE: elements/thread x threads x NCCL_STEPS x 8 B = 4.6875 MiB
SIMPLE_BUFFSIZE = 4 * MIB  # DEFAULT_BUFFSIZE, NCCL_BUFFSIZE
CONNECTION_HEADER = 4096  # include/comm.h ncclSendMem / ncclRecvMem: padded to MEM_ALIGN


@dataclass(frozen=True)
class NcclEnv:
    """The NCCL environment variables of the job (it inherits the planner's environment) that change
    how much device memory a communicator holds; None or the default = NCCL's own default."""

    buffsize: int | None = None  # NCCL_BUFFSIZE: the Simple protocol's buffer per connection
    cumem: bool | None = None  # NCCL_CUMEM_ENABLE (2.18+; auto-enabled from 2.19)
    runtime_connect: bool = True  # NCCL_RUNTIME_CONNECT (2.22+)
    min_channels: int | None = None  # NCCL_MIN_NCHANNELS
    max_channels: int | None = None  # NCCL_MAX_NCHANNELS
    nvls: bool = True  # NCCL_NVLS_ENABLE=0 turns NVLink SHARP off
    p2p: bool = True  # NCCL_P2P_DISABLE=1 or NCCL_P2P_LEVEL=LOC: peer-to-peer off, shm instead


def nccl_env(environ) -> NcclEnv:
    """The memory-relevant NCCL settings in `environ` (a mapping such as os.environ). A value NCCL
    could not parse as an integer leaves its default, as NCCL does (misc/param.cc, `ncclLoadParam`:
    'Invalid value ... using default')."""
    def number(key):
        try:
            return int(str(environ[key]).strip(), 0)
        except (KeyError, ValueError):
            return None

    cumem, runtime, nvls, p2p_off = (number(k) for k in ("NCCL_CUMEM_ENABLE", "NCCL_RUNTIME_CONNECT",
                                                            "NCCL_NVLS_ENABLE", "NCCL_P2P_DISABLE"))
    buffsize, low, high = (number(k) for k in ("NCCL_BUFFSIZE", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"))
    level = str(environ.get("NCCL_P2P_LEVEL", "")).strip().upper()
    return NcclEnv(buffsize=buffsize if buffsize and buffsize > 0 else None,
                   cumem=None if cumem is None or cumem < 0 else bool(cumem),
                   runtime_connect=runtime != 0, min_channels=low if low and low > 0 else None,
                   max_channels=high if high and high > 0 else None, nvls=nvls != 0,
                   p2p=not (p2p_off or level in ("LOC", "0")))


def nccl_env_note(env: NcclEnv) -> str:
    """The NCCL settings a plan took from the environment, for its notes ('' with none)."""
    default = NcclEnv()
    names = {"buffsize": "NCCL_BUFFSIZE", "cumem": "NCCL_CUMEM_ENABLE", "runtime_connect": "NCCL_RUNTIME_CONNECT",
             "min_channels": "NCCL_MIN_NCHANNELS", "max_channels": "NCCL_MAX_NCHANNELS", "nvls": "NCCL_NVLS_ENABLE",
             "p2p": "NCCL_P2P_DISABLE/NCCL_P2P_LEVEL"}
    changed = [f"{names[k]} ({'on' if v is True else 'off' if v is False else v})"
               for k, v in vars(env).items() if v != getattr(default, k)]
    return "from the environment the job inherits: " + ", ".join(changed) if changed else ""


def _up(n: int, g: int) -> int:
    return -(-n // g) * g


def _cumem(version: tuple[int, int], env: NcclEnv) -> bool:
    """Whether NCCL allocates through cuMem: NCCL_CUMEM_ENABLE exists from 2.18 and is auto-enabled
    from 2.19 (NCCL environment variables documentation)."""
    return version >= (2, 18) and (env.cumem if env.cumem is not None else version >= (2, 19))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def nccl_bytes(num_ranks: int, version: tuple[int, int] = (2, 27), channels: int = 24,
               transport: str = "nvlink", num_nodes: int = 1, chain_head: bool = False,
               p2p_read: bool = False, env: NcclEnv = NcclEnv()) -> int:
    """Device memory one NCCL communicator of `num_ranks` ranks holds on the worst-off rank, outside
    the caching allocator, from NVIDIA/nccl's source (src/ of each release tag):
    - ring: every channel connects one send and one receive (`ncclTransportRingConnect`). Over
      the P2P transport (NVLink or PCIe peer-to-peer) the receiver allocates a 4 KiB header and the
      LL 512 KiB, LL128 4.6875 MiB and Simple 4 MiB (NCCL_BUFFSIZE) buffers, the sender a 4 KiB
      header, each rounded up to CUDA_IPC_MIN 2 MiB: 10 + 2 MiB (transport/p2p.cc p2pRecvSetup/
      p2pSendSetup, include/comm.h CUDA_IPC_MIN, init.cc DEFAULT_*BUFFSIZE); with P2P read
      (`p2p_read`: GPUs of compute capability 8.0 over NVLink, graph/paths.cc p2pGetInfo) the
      Simple buffer moves to the sender: 6 + 6 MiB. The shm transport (GPUs without peer-to-peer,
      such as GeForce cards) keeps its buffers in host memory;
    - tree: with 3 or more ranks the chain of each channel (`ncclTransportTreeConnect`) adds the
      connections the ring did not make: a middle rank of the chain sends to its parent and
      receives from its child besides its ring pair (12 MiB per channel); the chain head (with
      `chain_head`) adds one connection. From 2.22 (runtime connect) the tree connects only once a
      collective picks the tree algorithm; it is counted anyway, an upper bound;
    - a pool of p2p buffers set up at init (`ncclProxyMsgSharedInit` in init.cc, from 2.12;
      transport/net.cc `sharedNetBuffersInit`, allocated on the GPU): p2p channels (the channel
      count rounded up to a power of two, graph/paths.cc `ncclTopoComputeP2pChannels`) x 2 x the
      Simple buffer / 4 (SENDRECV_SLICEFACTOR) in 2.12-2.13, x 16 x the 128 KiB p2p net chunk in
      2.14-2.15, x NCCL_SHARED_STEPS 16 x the p2p chunk from 2.16 (512 KiB within an NVLink node,
      128 KiB over PCIe or across nodes, at most the Simple buffer / NCCL_STEPS: init.cc
      P2pNvlChunkSize/P2pPciChunkSize/P2pNetChunkSize). From 2.22, with cuMem, connections are made
      at the first operation that needs them (NCCL_RUNTIME_CONNECT=1) and a step of collectives
      never sets the pool up;
    - cuMem (NCCL_CUMEM_ENABLE: available from 2.18, auto-enabled from 2.19, NCCL environment
      variables documentation): every device allocation is its own cuMemCreate rounded up to the 2
      MiB granularity (include/alloc.h `ncclCuMemAlloc`), so the three small per-channel arrays
      `initChannel` allocates for every p2p channel (channel.cc: devPeers of the shared resources
      and of the channel, devRingUserRanks) and the device communicator (init.cc
      devCommAndChans) take 2 MiB each.
    `channels` is the collective channel count NCCL's search gives (execution channels, twice the
    search channels: NVIDIA/nccl issue 1041; NCCL_MIN/MAX_NCHANNELS clamp it, graph/connect.cc
    ncclTopoPostset) and `transport` the link ('nvlink', 'pcie', 'shm'), both per hardware profile;
    `env` the job's NCCL environment variables (`nccl_env`). Measured check: NVIDIA/nccl issue 964
    (4 x A100 NVLink, NCCL 2.18 or older; its channel count is not logged, 24 is what NCCL logs for
    A100s on NVSwitch) read 544 MiB for a communicator of 2 ranks and 688 MiB for more on rank 0
    (the chain head): 24 x 12 + 32 x 16 x 512 KiB = 544 MiB, + 24 x 6 = 688 MiB. A communicator
    across nodes is counted with the same channels and per-channel buffers (assumption: NCCL's
    network transport allocates comparable receive buffers and uses no more channels than within
    a node); NVLS buffers come on top (`nvls_bytes`). No collective runs with a single rank: 0."""
    if num_ranks <= 1:
        return 0
    if transport not in NCCL_TRANSPORTS:
        raise ValueError(f"'{transport}' is not an NCCL transport; use one of {', '.join(NCCL_TRANSPORTS)}")
    if env.max_channels:
        channels = min(channels, env.max_channels)
    if env.min_channels:
        channels = max(channels, env.min_channels)
    simple = env.buffsize or SIMPLE_BUFFSIZE
    p2p = transport != "shm" and env.p2p
    read = p2p_read and transport == "nvlink"
    recv = _up(CONNECTION_HEADER + LL_BUFFSIZE + LL128_BUFFSIZE + (0 if read else simple), CUDA_IPC_MIN)
    send = _up(CONNECTION_HEADER + (simple if read else 0), CUDA_IPC_MIN)
    out = channels * (recv + send) if p2p else 0  # ring
    if num_ranks >= 3 and p2p:  # tree
        out += channels * (max(recv, send) if chain_head else recv + send)
    p2p_channels = _next_pow2(channels)
    cumem = _cumem(version, env)
    if version >= (2, 12) and not (cumem and version >= (2, 22) and env.runtime_connect):
        if version < (2, 14):
            out += p2p_channels * 2 * simple // 4
        elif version < (2, 16):
            out += p2p_channels * 16 * 128 * 1024
        else:
            chunk = 512 * 1024 if transport == "nvlink" and num_nodes == 1 else 128 * 1024
            out += p2p_channels * 16 * min(chunk, simple // 8)
    if cumem:
        out += (3 * p2p_channels + 1) * CUMEM_GRANULARITY
    return out


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
    return _up(data, gran) + _up(credit, NVLS_ALLOC_GRANULARITY)


def nvls_peer_bytes(version: tuple[int, int], env: NcclEnv = NcclEnv()) -> int:
    """Beside `nvls_bytes`, each NVLS channel of a communicator allocates its device peers
    (channel.cc `initNvlsChannel`: `ncclCudaCallocAsync(&channel->nvlsDevPeers, localRanks)`), a
    few hundred bytes that cuMem (auto-enabled from 2.19, see `nccl_bytes`) rounds up to 2 MiB:
    NVLS_CHANNELS x 2 MiB per communicator with NVLS buffers."""
    return NVLS_CHANNELS * CUMEM_GRANULARITY if _cumem(version, env) else 0


def communicators_bytes(communicators, version: tuple[int, int] = (2, 27), channels: int = 24,
                       transport: str = "nvlink", gpus_per_node: int | None = None, p2p_read: bool = False,
                       env: NcclEnv = NcclEnv()) -> int:
    """NCCL buffers of every communicator a rank holds, given as their rank counts (a backend's
    `communicators`: the default process group and each group its framework creates; issue 864 of
    NVIDIA/nccl reports about 6 GB with three or more), each at `nccl_bytes`; a communicator of
    more ranks than `gpus_per_node` spans nodes."""
    per_node = gpus_per_node or max(communicators, default=1)
    return sum(nccl_bytes(n, version, channels, transport, -(-n // per_node), p2p_read=p2p_read, env=env)
               for n in communicators)


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

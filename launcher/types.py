"""Small typed values passed between the planning layers. Pure data; no torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from launcher.memory.runtime import NcclEnv


@dataclass(frozen=True)
class Workload:
    """What one training step does, independent of the parallel strategy."""

    seq_len: int
    micro_batch_size: int
    precision: str  # Lightning name: 32-true | 16-mixed | bf16-mixed | bf16-true | 16-true
    optimizer: str  # HF optim name
    gradient_checkpointing: bool
    attn_implementation: str  # eager | sdpa | flash_attention_2
    checkpoint_policy: str = "full"  # with gradient_checkpointing: full | reentrant | selective_op (launcher/checkpointing.py)
    kernels: str = "torch"  # torch | liger | liger:<kernel>,... (training.liger_kernel[s]; launcher/liger.py)
    causal_lm_loss: str = "model"  # model | fp32_shift_copy | shift_copy (training.causal_lm_loss)
    optimizer_in_backward: bool = False  # each parameter stepped in its gradient hook (training.optimizer_in_backward)
    zero_grad_set_to_none: bool = True  # False: gradients kept (zeroed) across steps (training.zero_grad_set_to_none)
    sgd_momentum: float = 0.9  # training.sgd_momentum (with optimizer sgd; 0 = no momentum buffers)
    grad_accum_steps: int = 1  # micro-batches per optimizer step (the memory layouts; traces do not depend on it)
    built_on_device: bool = False  # training.built_on_device (a layout's initialization replay; not the trace)
    keep_outputs: bool = False  # the loop keeps each step's outputs until the next forward returns (training.keep_outputs)
    use_cache: bool = False  # the forward builds transformers 4's cache of keys and values (training.use_cache)
    rotary_cache: bool = False  # per-layer cos/sin tables over every position (training.rotary_cache)
    cuda: bool = False  # a GPU plan: CUDA's kernels and autocast policy traced where they differ (launcher/trace.py `cuda_fields`)

    @property
    def state_optimizer(self) -> str:
        """The optimizer as its states are laid out: `sgd_plain` for SGD without momentum (no state),
        else the HF name."""
        return "sgd_plain" if self.optimizer == "sgd" and not self.sgd_momentum else self.optimizer


@dataclass(frozen=True)
class Cluster:
    """The devices a plan runs on."""

    hardware: str  # profile name
    device: str  # 'cuda' or 'cpu'
    num_gpus: int  # total over all nodes
    num_nodes: int
    memory_bytes: int  # per device
    host_memory_bytes: int  # per node
    peak_tflops: dict  # dtype -> dense TFLOP/s per device
    matmul_efficiency: float
    memory_bandwidth_gbps: float
    intra_node_bandwidth_gbps: float
    inter_node_bandwidth_gbps: float
    host_link_bandwidth_gbps: float
    sm_arch: int
    cuda_context_bytes: int
    op_overhead_s: float = 5.0e-6  # host time per dispatched op (HardwareConfig.op_overhead_s)
    collective_latency_s: float = 2.0e-5  # fixed time per collective call
    all_gather_bandwidth_gbps: Optional[float] = None  # None = intra_node_bandwidth_gbps
    elementwise_gelems_per_s: Optional[float] = None  # fresh elementwise output elements, 1e9/s; None = memory bandwidth / 12
    framework_overhead_s: dict = field(default_factory=dict)  # strategy -> [per step s, per param tensor s]
    collective_gbps: dict = field(default_factory=dict)  # 'all_reduce_fp32'... -> {message MiB: bus GB/s}
    attention_tflops: dict = field(default_factory=dict)  # dtype -> fused attention TFLOP/s; {} = peak x efficiency
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF expandable_segments:True in the job's environment
    nvls: bool = False  # NVLink SHARP across the node's NVSwitch (HardwareConfig.nvls)
    nccl_version: Optional[str] = None  # the job's NCCL on a GPU (hardware.py job_nccl_version); None = runtime.py DEFAULT_NCCL_VERSION
    nccl_channels: int = 24  # NCCL's collective channels between the node's GPUs (HardwareConfig.nccl_channels)
    nccl_transport: str = "nvlink"  # how NCCL links the node's GPUs: nvlink | pcie | shm (HardwareConfig.nccl_transport)
    nccl_env: NcclEnv = field(default_factory=NcclEnv)  # the job's NCCL_* environment variables (runtime.py nccl_env)

    @property
    def gpus_per_node(self) -> int:
        return self.num_gpus // self.num_nodes


@dataclass(frozen=True)
class Strategy:
    """One way to lay a model out over the devices. `name` is the user-facing strategy name."""

    name: str  # ddp | zero0 | zero1 | zero2 | zero3 | zero2_offload | zero3_offload | cai_*
    backend: str  # 'ddp' (torch) | 'deepspeed' | 'colossalai'
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    tp_size: int = 1
    pp_size: int = 1


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device memory of one candidate on its worst rank, in bytes."""

    peak_allocated_bytes: int  # what torch.cuda.max_memory_allocated reports (CPU: peak live tensor bytes)
    peak_reserved_bytes: int  # what torch.cuda.max_memory_reserved reports (CPU: = allocated)
    device_total_bytes: int  # what nvidia-smi shows: reserved + CUDA context + NCCL (CPU: = allocated)
    host_bytes: int  # host RAM per rank for offloaded states (0 without offload)
    breakdown: dict  # parameters, gradients, optimizer_states, activations, buffers, runtime -> bytes at the peak
    peak_phase: str  # forward | backward | optimizer | setup (before the step: DDP's state broadcast, the build on CPU)
    notes: tuple = ()  # assumptions stated for this estimate
    # every data-parallel rank's peak allocated (the headline is their maximum) when ranks differ
    # (ZeRO 1-2: each rank's gradient partition); empty: every rank = peak_allocated_bytes
    per_rank_peak_allocated_bytes: tuple = ()
    # the device memory the step needs to run (GPU): peak allocated + the cache an out-of-memory
    # retry cannot release + CUDA context + NCCL; 0: the device total (CPU, hand-built estimates)
    needed_bytes: int = 0

    @property
    def oom_bytes(self) -> int:
        """What decides whether the step fits the device: `needed_bytes`, else the device total."""
        return self.needed_bytes or self.device_total_bytes

    def rank_peak_allocated_bytes(self, rank: int) -> int:
        """Peak allocated bytes of data-parallel `rank`."""
        per_rank = self.per_rank_peak_allocated_bytes
        return per_rank[rank] if rank < len(per_rank) else self.peak_allocated_bytes


@dataclass(frozen=True)
class SpeedEstimate:
    compute_s: float  # per optimizer step, all micro-batches
    comm_s: float  # exposed (not overlapped) communication per optimizer step
    step_s: float
    tokens_per_s: float  # over the whole cluster
    breakdown: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    micro_batch_size: int
    grad_accum_steps: int
    memory: MemoryEstimate
    speed: SpeedEstimate
    fits: bool
    reason: str  # why it fits / does not fit / lost
    trains: str = "full"  # 'full' fine-tuning or 'adapters' (PEFT)
    peft: Optional[dict] = None  # launcher.peft.LoraSettings.to_dict() when trains == 'adapters'
    gradient_checkpointing: bool = False  # this candidate recomputes activations in backward
    num_trainable_params: int = 0


@dataclass(frozen=True)
class Plan:
    model: dict  # name, num_params, num_layers, ...
    hardware: str
    gpus: int
    nodes: int
    candidates: tuple  # ranked fastest first
    chosen: Optional[int]
    notes: tuple = ()

"""Typed schemas for every configuration group. Values live in `conf/`; documentation of each
field lives here, under the field. No DictConfig travels past `app.main`: it converts the composed
config with `OmegaConf.to_object` into `LauncherConfig` and everything downstream is plain data.

Closed sets are Enums (OmegaConf matches members by *name*, so the member names are the exact
strings a user types, e.g. `training.precision=bf16-mixed`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


def _enum(name: str, members: list[str], doc: str) -> type[Enum]:
    e = Enum(name, {m: m for m in members})  # type: ignore[misc]
    e.__doc__ = doc
    return e


Precision = _enum(
    "Precision",
    ["32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true"],
    "Lightning's precision names. '*-mixed': fp32 weights, 16-bit compute (torch autocast for "
    "torch backends; for DeepSpeed/ColossalAI the framework's 16-bit model + fp32 master copy). "
    "'*-true': every tensor in that dtype.",
)
Optimizer = _enum(
    "Optimizer",
    ["adamw_torch", "adamw_torch_fused", "adamw_torch_foreach", "sgd"],
    "HF TrainingArguments `optim` names. adamw_torch = torch.optim.AdamW with its default "
    "implementation (foreach on this torch when all tensors are on one device); "
    "adamw_torch_fused = fused=True; adamw_torch_foreach = foreach=True; sgd = torch.optim.SGD "
    "(momentum 0.9).",
)
Attention = _enum(
    "Attention", ["eager", "sdpa", "flash_attention_2"], "transformers' attn_implementation."
)
StrategyName = _enum(
    "StrategyName",
    ["auto", "ddp", "zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"],
    "auto = plan every candidate. ddp = torch DistributedDataParallel. zero0..zero3 = DeepSpeed "
    "ZeRO stage 0..3; *_offload = ZeRO-Offload of optimizer states (and for stage 3 "
    "parameters) to host memory.",
)
Mode = _enum(
    "Mode",
    ["auto", "plan", "run", "measure"],
    "auto = run when local GPUs are found, else plan. plan = estimate and write the run "
    "directory without training. run = plan then start torchrun. measure = run a few steps and "
    "report measured peak memory next to the estimate.",
)
Report = _enum("Report", ["table", "json"], "How the plan is printed on stdout.")
Init = _enum(
    "Init",
    ["random", "pretrained"],
    "random = weights initialised from the config (tests, demos, memory measurement); "
    "pretrained = load weights from model.pretrained_path or the local HF cache.",
)


@dataclass
class ModelConfig:
    """A decoder LLM architecture, as the values of its Hugging Face `config.json`."""

    name: str = MISSING
    """Catalogue name (the file name under conf/model/), or 'custom'."""
    source: str = ""
    """Where the config.json values come from (URL of the model card's config.json)."""
    hf_config: Dict[str, Any] = field(default_factory=dict)
    """The config.json values; `model_type` selects the transformers architecture."""
    config_path: Optional[str] = None
    """Path to a config.json (or a directory holding one); with model=custom this replaces hf_config."""
    pretrained_path: Optional[str] = None
    """Local directory with weights and tokenizer for init=pretrained (never downloaded)."""
    tokenizer_path: Optional[str] = None
    """Local tokenizer directory. null = pretrained_path, else the project's byte-level tokenizer."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the model directory. Only honoured from the command line."""


@dataclass
class HardwareConfig:
    """One accelerator type. Every number is per device and cites its source in the YAML."""

    name: str = MISSING
    source: str = ""
    """Datasheet(s) the numbers come from."""
    device: str = "cuda"
    """'cuda' for GPUs; 'cpu' for CPU processes (no CUDA runtime terms, gloo)."""
    memory_bytes: int = MISSING
    """Usable device memory as the driver reports it (nvidia-smi total)."""
    host_memory_bytes: int = 256 * 2**30
    """Host RAM per node available for offload."""
    peak_tflops: Dict[str, float] = field(default_factory=dict)
    """Dense peak TFLOP/s by compute dtype: keys fp32, tf32, fp16, bf16 (no sparsity)."""
    matmul_efficiency: float = 0.5
    """Fraction of peak a transformer training step achieves in matmuls (model FLOPs utilisation)."""
    memory_bandwidth_gbps: float = MISSING
    """HBM bandwidth, GB/s."""
    intra_node_bandwidth_gbps: float = MISSING
    """Achievable per-GPU bus bandwidth for collectives inside a node (NVLink / PCIe), GB/s."""
    inter_node_bandwidth_gbps: float = 25.0
    """Achievable per-node network bandwidth (InfiniBand / Ethernet), GB/s."""
    host_link_bandwidth_gbps: float = 25.0
    """Host <-> device copy bandwidth (PCIe), GB/s, for offload."""
    sm_arch: int = 80
    """CUDA compute capability x10 (70 V100, 80 A100, 89 Ada, 90 Hopper); selects cuBLAS workspace."""
    cuda_context_bytes: int = 768 * 2**20
    """CUDA context + loaded kernels after the first training step (outside the allocator)."""


@dataclass
class TrainingConfig:
    """What is trained and how; every field that changes memory is used by the estimator."""

    seq_len: int = 1024
    """Tokens per example (padded/packed to this length)."""
    micro_batch_size: Optional[int] = None
    """Examples per GPU per forward. null = search the largest that fits."""
    global_batch_size: Optional[int] = None
    """Examples per optimizer step over all GPUs. null = micro_batch_size x data-parallel size."""
    precision: Precision = Precision["bf16-mixed"]  # type: ignore[valid-type]
    optimizer: Optimizer = Optimizer["adamw_torch"]  # type: ignore[valid-type]
    gradient_checkpointing: bool = False
    """True reduces activation memory (recomputes each layer in backward, ~+33% compute)."""
    attn_implementation: Attention = Attention["sdpa"]  # type: ignore[valid-type]
    learning_rate: float = 2.0e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Gradient clipping (0 = off)."""
    warmup_steps: int = 0
    max_steps: int = 30
    """Optimizer steps of a run."""
    seed: int = 1234


@dataclass
class DataConfig:
    path: str = "demo"
    """'demo' = the small corpus shipped with launcher; else a .jsonl/.txt file or a saved HF datasets directory."""
    text_key: str = "text"
    """Field holding the text in JSONL / datasets rows."""


@dataclass
class DeepSpeedConfig:
    """DeepSpeed knobs that change memory. The estimator and the emitted ds_config.json read the
    same values. Defaults are DeepSpeed 0.19's code defaults (deepspeed/runtime/zero/config.py);
    bucket sizes are in elements."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: Optional[bool] = None
    """null = DeepSpeed's default (True for stage 3, False otherwise)."""
    contiguous_gradients: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_param_persistence_threshold: int = 100_000
    sub_group_size: int = 1_000_000_000
    offload_pin_memory: bool = True


@dataclass
class DDPConfig:
    """torch DistributedDataParallel settings (torch/nn/parallel/distributed.py)."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    """True: gradients live in DDP's flat buckets (no second copy of the gradients)."""
    static_graph: bool = False


@dataclass
class PlannerConfig:
    safety_margin: float = 0.05
    """Fraction of device memory kept free when deciding that a candidate fits."""
    max_micro_batch_size: int = 64
    """Largest micro-batch the search tries."""


@dataclass
class LaunchConfig:
    kind: str = "torchrun"
    master_port: int = 29517
    max_restarts: int = 0


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Save every N optimizer steps (0 = only at the end)."""
    keep: int = 2
    """Checkpoints kept (older ones are deleted after a newer one is complete)."""


@dataclass
class LauncherConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    gpus: int = 1
    """Total number of GPUs (or CPU processes with hardware=cpu) over all nodes."""
    nodes: int = 1
    strategy: StrategyName = StrategyName["auto"]  # type: ignore[valid-type]
    mode: Mode = Mode["auto"]  # type: ignore[valid-type]
    report: Report = Report["table"]  # type: ignore[valid-type]
    init: Init = Init["random"]  # type: ignore[valid-type]
    resume: bool = False
    """Continue from the latest complete checkpoint in run_dir."""
    run_dir: Optional[str] = None
    """Set by the app to Hydra's output directory."""
    cache_dir: Optional[str] = None
    """Where traces are cached. null = ~/.cache/launcher."""


def register_schema() -> None:
    """Make `launcher_schema` (the typed base of conf/config.yaml) known to Hydra."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="launcher_schema", node=LauncherConfig)


register_schema()

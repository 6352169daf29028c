"""The contract between the planner and the per-rank worker: `run.json` in the run directory.

The app writes it; `python -m launcher.worker RUN_DIR/run.json` (started by torchrun on every rank)
reads it. Plain JSON so the worker never needs Hydra, and a run can be re-launched by hand.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional


@dataclass
class RunSpec:
    run_dir: str
    backend: str  # 'ddp' | 'deepspeed' | 'colossalai'
    strategy: str  # strategy name, e.g. 'zero2'
    model_name: str
    hf_config: dict  # config.json values the model is built from
    init: str = "random"  # 'random' | 'pretrained'
    pretrained_path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    trust_remote_code: bool = False
    device: str = "cpu"  # 'cpu' (gloo) | 'cuda' (nccl)
    precision: str = "32-true"
    optimizer: str = "adamw_torch"
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False
    checkpoint_policy: str = "full"
    liger_kernel: bool = False
    liger_kernels: tuple = ()  # those of Liger's kernels to apply (launcher/liger.py KERNELS); () = all
    seq_len: int = 128
    micro_batch_size: int = 1
    grad_accum_steps: int = 1
    max_steps: int = 30
    learning_rate: float = 2e-4
    weight_decay: float = 0.0
    sgd_momentum: float = 0.9
    max_grad_norm: float = 1.0
    optimizer_in_backward: bool = False  # one optimizer per parameter, stepped in its gradient hook
    zero_grad_set_to_none: bool = True  # False: the gradients are zeroed in place and kept across steps
    warmup_steps: int = 0
    seed: int = 1234
    data_path: str = "demo"
    text_key: str = "text"
    framework_config: dict = field(default_factory=dict)  # ds_config / DDP kwargs / ColossalAI plugin kwargs
    measure_memory: bool = True
    checkpoint_every: int = 0
    checkpoint_keep: int = 2
    resume: bool = False
    log_every: int = 1
    estimate: dict = field(default_factory=dict)  # estimated per-rank peak (bytes) for the summary
    peft: dict = field(default_factory=dict)  # launcher.peft.LoraSettings.to_dict(); {} = full fine-tuning

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "RunSpec":
        data: dict[str, Any] = json.loads(Path(path).read_text())
        return cls(**data)

"""The worker's torch optimizer and learning-rate schedule, shared by every backend. Optimizer
names are HF TrainingArguments' `optim` names."""
from __future__ import annotations

from launcher.backends.base import OPTIMIZERS
from launcher.errors import ConfigError


def make_optimizer(name: str, params, learning_rate: float, weight_decay: float):
    """adamw_torch, adamw_torch_foreach: AdamW with foreach=True (one multi-tensor kernel per
    group, on every device); adamw_torch_fused: AdamW(fused=True); sgd: SGD with momentum 0.9; adamw_bnb_8bit /
    paged_adamw_8bit: bitsandbytes.optim.AdamW8bit / PagedAdamW8bit; adafactor: transformers'
    Adafactor with HF Trainer's optim="adafactor" settings (scale_parameter=False,
    relative_step=False: the learning rate is the given one)."""
    import torch

    params = [p for p in params if p.requires_grad]
    if name in ("adamw_torch", "adamw_torch_foreach"):
        return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, foreach=True)
    if name == "adamw_torch_fused":
        return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, fused=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=learning_rate, momentum=0.9, weight_decay=weight_decay)
    if name in ("adamw_bnb_8bit", "paged_adamw_8bit"):
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if name.startswith("paged") else bnb.optim.AdamW8bit
        return cls(params, lr=learning_rate, weight_decay=weight_decay)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=learning_rate, weight_decay=weight_decay, scale_parameter=False,
                         relative_step=False, warmup_init=False)
    raise ConfigError(f"optimizer={name!r} is not supported by the worker; use one of {', '.join(OPTIMIZERS)}")


def lr_factor(step: int, warmup_steps: int) -> float:
    """Linear warmup from 1/(warmup+1) to 1 over `warmup_steps` optimizer steps, then constant."""
    return min(1.0, (step + 1) / (warmup_steps + 1)) if warmup_steps > 0 else 1.0


def make_scheduler(optimizer, warmup_steps: int):
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup_steps))

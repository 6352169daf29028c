"""DeepSpeed configs that stand on their own, for the tools users already run.

`ds_config.json` (launcher/backends/deepspeed/emit.py) is what the worker hands DeepSpeed together with
its own client optimizer. A user who calls `deepspeed.initialize(model=..., config=...)`, or hands
the file to HF Trainer, Accelerate, Axolotl or LLaMA-Factory, brings no optimizer: DeepSpeed
builds it from the config's `optimizer` block (deepspeed/runtime/engine.py
`_configure_basic_optimizer`) and its learning-rate schedule from `scheduler`.

- `standalone_config`: `ds_config.json` plus `optimizer` and `scheduler` blocks with the plan's
  values. AdamW is written with `"torch_adam": true`, so DeepSpeed builds `torch.optim.AdamW`
  (engine.py `get_optimizer_configuration`) instead of compiling FusedAdam or DeepSpeedCPUAdam:
  the optimizer the worker trains with (foreach, or fused for adamw_torch_fused). `sgd` becomes `torch.optim.SGD` (engine.py falls back
  to `getattr(torch.optim, type)`). The schedule is DeepSpeed's `WarmupLR`, linear to the
  learning rate over `training.warmup_steps`, then constant: the worker's schedule.
- `hf_trainer_config`: the same file with HF Trainer's "auto" values where Trainer fills them
  from its `TrainingArguments` (transformers/integrations/deepspeed.py
  `HfTrainerDeepSpeedConfig.trainer_config_process`): batch sizes, gradient clipping, optimizer
  and scheduler hyper-parameters and the fp16/bf16 switches. The ZeRO knobs the memory estimate
  read stay as planned.
"""
from __future__ import annotations

from typing import Optional

from launcher.config import TrainingConfig

ADAM_BETAS = [0.9, 0.999]
ADAM_EPS = 1e-8
"""torch.optim.AdamW's defaults, which the worker's optimizer uses."""

AUTO_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
             "gradient_clipping")
"""Top-level keys HF Trainer fills from TrainingArguments when they say "auto"."""


def _name(value) -> str:
    return getattr(value, "name", value)


def unsupported_optimizer(training: TrainingConfig) -> Optional[str]:
    """Why DeepSpeed cannot build this optimizer from a config block, or None."""
    name = _name(training.optimizer)
    if name.startswith("adamw_torch") or name == "sgd":
        return None
    return (f"training.optimizer={name} has no DeepSpeed optimizer block (DeepSpeed builds Adam, "
            "AdamW, Lamb, Lion, Adagrad, MuAdam and torch.optim classes); the stand-alone config "
            "is written for training.optimizer=adamw_torch or sgd")


def optimizer_block(training: TrainingConfig) -> dict:
    """DeepSpeed's `optimizer` section for the plan's optimizer (module docstring)."""
    reason = unsupported_optimizer(training)
    if reason:
        raise ValueError(reason)
    name = _name(training.optimizer)
    lr, wd = float(training.learning_rate), float(training.weight_decay)
    if name == "sgd":
        return {"type": "SGD", "params": {"lr": lr, "momentum": float(training.sgd_momentum), "weight_decay": wd}}
    params = {"lr": lr, "betas": list(ADAM_BETAS), "eps": ADAM_EPS, "weight_decay": wd, "torch_adam": True}
    if name in ("adamw_torch", "adamw_torch_foreach"):
        params["foreach"] = True
    if name == "adamw_torch_fused":
        params["fused"] = True
    return {"type": "AdamW", "params": params}


def scheduler_block(training: TrainingConfig) -> dict:
    """DeepSpeed's WarmupLR, linear from lr / (warmup_steps + 1), the worker's first rate
    (launcher/worker/backends.py lr_factor), to lr over warmup_steps scheduler steps, then
    constant. WarmupLR sets its minimum at construction and again at its first step (iteration
    0; deepspeed/runtime/lr_schedules.py), so it rises one optimizer step later than the worker's
    schedule. It needs at least one warm-up step: without warm-up min = max, a constant rate."""
    lr, steps = float(training.learning_rate), int(training.warmup_steps)
    return {"type": "WarmupLR", "params": {
        "warmup_min_lr": lr / (steps + 1), "warmup_max_lr": lr,
        "warmup_num_steps": max(1, steps), "warmup_type": "linear"}}


def standalone_config(ds_config: dict, training: TrainingConfig) -> dict:
    """`ds_config` (launcher/backends/deepspeed/emit.py) with optimizer and scheduler blocks."""
    return {**ds_config, "optimizer": optimizer_block(training), "scheduler": scheduler_block(training)}


def hf_trainer_config(ds_config: dict, training: TrainingConfig) -> dict:
    """`standalone_config` with "auto" wherever HF Trainer fills the value from TrainingArguments."""
    config = standalone_config(ds_config, training)
    config.update({key: "auto" for key in AUTO_KEYS if key in config})
    opt = config["optimizer"]
    opt["params"] = {k: ("auto" if k in ("lr", "betas", "eps", "weight_decay") else v)
                     for k, v in opt["params"].items()}
    config["scheduler"] = {"type": "WarmupLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "warmup_type": "linear"}}
    for half in ("fp16", "bf16"):
        section = config.get(half)
        if section and section.get("enabled") is True and not section.get("bf16_master_weights_and_grads"):
            config[half] = {**section, "enabled": "auto"}
    return config

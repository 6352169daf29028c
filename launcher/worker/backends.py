"""Training backends: torch DDP and DeepSpeed, behind one small interface.

    backend.micro_step(input_ids, last)  forward + backward of one micro-batch -> loss (detached)
    backend.optimizer_step()             clip, step, schedule, zero grads
    backend.lr, backend.save(dir, rank), backend.load(dir)
    backend.load_neutral(dir)             optimizer and scheduler from the layout-neutral form
                                          (launcher/worker/layout.py; the weights are loaded
                                          into the model before it is wrapped)

Both use a torch optimizer (`torch.optim.AdamW` / `SGD`). With DeepSpeed this is deliberate:
its own FusedAdam / DeepSpeedCPUAdam are C++ ops compiled on first use (~150 s on CPU), and
ZeRO wraps any torch optimizer just as well ("zero_allow_untested_optimizer": true), so a torch
optimizer keeps start-up fast and the optimizer identical across backends. Optimizer names are
HF TrainingArguments' `optim` names.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from launcher.errors import ConfigError

OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adamw_bnb_8bit", "paged_adamw_8bit", "adafactor")
DDP_KWARGS = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters",
              "broadcast_buffers")
DS_TAG = "deepspeed"
SINGLE = "single"  # the strategy that runs one process without a data-parallel wrapper


def make_optimizer(name: str, params, learning_rate: float, weight_decay: float):
    """adamw_torch: AdamW with foreach=True (one multi-tensor kernel per group, on every device);
    adamw_torch_fused: AdamW(fused=True); sgd: SGD with momentum 0.9; adamw_bnb_8bit /
    paged_adamw_8bit: bitsandbytes.optim.AdamW8bit / PagedAdamW8bit; adafactor: transformers'
    Adafactor with HF Trainer's optim="adafactor" settings (scale_parameter=False,
    relative_step=False: the learning rate is the given one)."""
    import torch

    params = [p for p in params if p.requires_grad]
    if name == "adamw_torch":
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


def _check_ddp_kwargs(framework_config: dict) -> None:
    """Every key must be a keyword argument of the installed torch's DistributedDataParallel."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    allowed = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}
    unknown = sorted(set(framework_config) - allowed)
    if unknown:
        raise ConfigError(f"framework_config keys {unknown} are not DistributedDataParallel arguments; "
                          f"use {', '.join(DDP_KWARGS)}")


class DDPBackend:
    """torch DistributedDataParallel; strategy `single`: the same loop on one process with the model
    not wrapped (no gradient buckets), as HF Trainer and torchtune train on one GPU."""

    def __init__(self, model, spec, env, plan, meter) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        _check_ddp_kwargs(spec.framework_config)
        device_ids = [env.local_rank] if env.device == "cuda" else None
        self.module = model
        self.model = (model if spec.strategy == SINGLE else
                      DistributedDataParallel(model, device_ids=device_ids, **spec.framework_config))
        self.optimizer = make_optimizer(spec.optimizer, model.parameters(), spec.learning_rate, spec.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, spec.warmup_steps)
        self.scaler = torch.amp.GradScaler("cuda") if plan.grad_scaler else None
        self._autocast_dtype = getattr(torch, plan.autocast_dtype) if plan.autocast_dtype else None
        self._device_type = env.device
        self._spec, self._meter = spec, meter

    def _autocast(self):
        import torch

        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=self._autocast_dtype)

    def micro_step(self, input_ids, last: bool):
        sync = contextlib.nullcontext() if last or self.model is self.module else self.model.no_sync()
        with sync:
            with self._meter.phase("forward"), self._autocast():
                loss = self.model(input_ids=input_ids, labels=input_ids).loss
            scaled = loss / self._spec.grad_accum_steps
            with self._meter.phase("backward"):
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        return loss.detach().float()

    def optimizer_step(self) -> None:
        import torch

        with self._meter.phase("optimizer"):
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            if self._spec.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self._spec.max_grad_norm)
            if self.scaler:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def _states(self) -> dict:
        states = {"model": self.module, "optimizer": self.optimizer, "scheduler": self.scheduler}
        if self.scaler:
            states["scaler"] = self.scaler
        return states

    def save(self, directory: Path, rank: int) -> None:
        import torch

        if rank == 0:  # DDP keeps model and optimizer state identical on every rank
            for name, obj in self._states().items():
                torch.save(obj.state_dict(), directory / f"{name}.pt")

    def load(self, directory: Path) -> None:
        import torch

        device = next(self.model.parameters()).device
        for name, obj in self._states().items():
            obj.load_state_dict(torch.load(directory / f"{name}.pt", map_location=device, weights_only=True))
        self._meter.track_external(self.module, self.optimizer)

    def load_neutral(self, directory: Path) -> None:
        from launcher.worker import layout

        self.optimizer.load_state_dict(layout.neutral_optimizer(directory))
        self.scheduler.load_state_dict(layout.neutral_scheduler(directory))
        self._meter.track_external(self.module, self.optimizer)


def deepspeed_config(spec, world_size: int) -> dict:
    """The run's ds_config with the batch keys filled from the spec and checked against it."""
    config = dict(spec.framework_config)
    expected = {
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "gradient_accumulation_steps": spec.grad_accum_steps,
        "train_batch_size": spec.micro_batch_size * spec.grad_accum_steps * world_size,
    }
    problems = [f"ds_config {key}={config[key]} but the run has {value}"
                for key, value in expected.items() if key in config and config[key] != value]
    for section in ("optimizer", "scheduler"):
        if section in config:
            problems.append(f"ds_config has an {section!r} section; the worker passes a torch "
                            f"optimizer and scheduler, remove it")
    problems += _precision_problems(spec, config)
    if problems:
        raise ConfigError(*problems)
    config.update(expected)
    config.setdefault("gradient_clipping", spec.max_grad_norm)
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("steps_per_print", 10 ** 9)
    return config


def ds_strategy(spec, config: dict):
    """The `Strategy` a ds_config describes (stage and offload from its zero_optimization)."""
    from launcher.types import Strategy

    zero = config.get("zero_optimization", {})
    off = lambda key: zero.get(key, {}).get("device", "none") not in ("none", None)  # noqa: E731
    return Strategy(getattr(spec, "strategy", "deepspeed"), "deepspeed", int(zero.get("stage", 0)),
                    offload_optimizer=off("offload_optimizer"), offload_params=off("offload_param"))


def _precision_problems(spec, config: dict) -> list[str]:
    """The planner's and emitter's rule (launcher/emit/deepspeed.py `unsupported_reason`), and the
    bf16/fp16 sections the emitter writes for this precision (`expected_half_sections`)."""
    from launcher.emit.deepspeed import expected_half_sections, unsupported_reason

    strategy = ds_strategy(spec, config)
    reason = unsupported_reason(strategy, spec.precision, getattr(spec, "device", None))
    if reason:
        return [reason]
    wanted = expected_half_sections(strategy, spec.precision)
    return [f"precision={spec.precision} with ZeRO-{strategy.zero_stage} but ds_config "
            f"{section}.enabled={enabled}; expected {wanted[section]}"
            for section in ("bf16", "fp16")
            if (enabled := bool(config.get(section, {}).get("enabled", False))) != wanted[section]]


def _true_dtype_model(model, spec, config: dict):
    """bf16-true at ZeRO-0 enables no bf16 mode in ds_config, so DeepSpeed does not cast the model
    (engine.py `_configure_distributed_model`): hand it over in bf16, as the emitter assumes."""
    import torch

    if spec.precision == "bf16-true" and not config.get("bf16", {}).get("enabled", False):
        return model.to(torch.bfloat16)
    return model


class DeepSpeedBackend:
    def __init__(self, model, spec, env, plan, meter) -> None:
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        config = deepspeed_config(spec, env.world_size)
        model = _true_dtype_model(model, spec, config)
        optimizer = make_optimizer(spec.optimizer, model.parameters(), spec.learning_rate, spec.weight_decay)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config,
            lr_scheduler=lambda opt: make_scheduler(opt, spec.warmup_steps))
        self._base_optimizer = optimizer
        self._meter = meter

    def micro_step(self, input_ids, last: bool):
        with self._meter.phase("forward"):
            loss = self.engine(input_ids=input_ids, labels=input_ids).loss
        with self._meter.phase("backward"):
            self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself
        if not last:
            self.engine.step()  # only advances DeepSpeed's micro-step counter
        return loss.detach().float()

    def optimizer_step(self) -> None:
        with self._meter.phase("optimizer"):
            self.engine.step()  # boundary: clip, step, scheduler, zero grads

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def save(self, directory: Path, rank: int) -> None:
        self.engine.save_checkpoint(str(directory), tag=DS_TAG, save_latest=False)

    def load(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(directory), tag=DS_TAG)
        if path is None:
            raise ConfigError(f"DeepSpeed could not load the checkpoint in {directory}")
        self._meter.track_external(self.engine.module, self._base_optimizer)

    def load_neutral(self, directory: Path) -> None:
        """ZeRO-0 holds the torch optimizer whole; ZeRO 1-3 take each parameter's full moments
        through DeepSpeed's `safe_set_full_optimizer_state` after the flat partitions' torch
        states exist (ZeRO 1/2 create them lazily at the first step)."""
        import torch
        from deepspeed.utils import safe_set_full_optimizer_state

        from launcher.worker import layout

        saved = layout.neutral_optimizer(directory)
        self.scheduler.load_state_dict(layout.neutral_scheduler(directory))
        if self.engine.zero_optimization_stage() == 0:
            self._base_optimizer.load_state_dict(saved)
        else:
            step = next(iter(saved["state"].values()))["step"]
            zero = self.engine.optimizer
            flats = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
            for flat in flats:
                state = self._base_optimizer.state[flat]
                state["step"] = torch.tensor(float(step))
                for key in ("exp_avg", "exp_avg_sq"):
                    state.setdefault(key, torch.zeros_like(flat))
            if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
                zero._hp_optimizer_states_linked = False
                zero._lazy_init_hp_params_optimizer_state()
            params = [p for p in self.engine.module.parameters() if p.requires_grad]
            for index, param in enumerate(params):
                for key in ("exp_avg", "exp_avg_sq"):
                    safe_set_full_optimizer_state(param, saved["state"][index][key].to(param.device), key)
        self._meter.track_external(self.engine.module, self._base_optimizer)


def _colossalai_backend(model, spec, env, plan, meter):
    """ColossalAI is optional: imported only when a run uses it (launcher/worker/colossalai_backend.py)."""
    from launcher.worker.colossalai_backend import ColossalAIBackend

    return ColossalAIBackend(model, spec, env, plan, meter)


BACKENDS = {"ddp": DDPBackend, "deepspeed": DeepSpeedBackend, "colossalai": _colossalai_backend}


def check_backend(spec, world_size: int) -> None:
    """Reject a backend, optimizer or framework_config the worker cannot run, before any
    process group exists."""
    if spec.backend not in BACKENDS:
        raise ConfigError(f"backend={spec.backend!r} is not supported by the worker yet; "
                          f"use one of {', '.join(BACKENDS)}")
    if spec.optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer={spec.optimizer!r} is not supported by the worker; "
                          f"use one of {', '.join(OPTIMIZERS)}")
    quant = (getattr(spec, "peft", None) or {}).get("quant_type")
    if quant and spec.device != "cuda":
        raise ConfigError(f"QLoRA ({quant} base) needs bitsandbytes' GPU kernels; device={spec.device} "
                          "has none: use peft=lora on CPU")
    if str(quant).startswith("gptq"):
        raise ConfigError(f"peft.quant_type={quant}: a GPTQ base is planned only; the worker quantizes with "
                          "bitsandbytes (use peft.quant_type=nf4)")
    if quant and spec.backend != "ddp":
        raise ConfigError(f"QLoRA runs with torch DDP only, not backend={spec.backend}")
    if getattr(spec, "strategy", None) == SINGLE and world_size != 1:
        raise ConfigError(f"strategy=single runs one process, not {world_size}; use strategy=ddp for several")
    if spec.backend == "ddp":
        _check_ddp_kwargs(spec.framework_config)
    elif spec.backend == "colossalai":
        from launcher.worker.colossalai_backend import check_plugin_config

        check_plugin_config(spec.framework_config)
    else:
        deepspeed_config(spec, world_size)


def make_backend(model, spec, env, plan, meter):
    check_backend(spec, env.world_size)
    return BACKENDS[spec.backend](model, spec, env, plan, meter)

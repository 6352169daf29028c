"""Worker hook of torch DistributedDataParallel (and `single`: one process, the model not wrapped)."""
from __future__ import annotations

import contextlib
from pathlib import Path

from launcher.errors import ConfigError
from launcher.worker.optim import OptimizerInBackward, make_optimizer, make_scheduler
from launcher.worker import layout

SINGLE = "single"  # the strategy that runs one process without a data-parallel wrapper

DDP_KWARGS = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters",
              "broadcast_buffers")


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
        self._in_backward = getattr(spec, "optimizer_in_backward", False)
        if self._in_backward:  # stepped in each parameter's gradient hook (one process, strategy single)
            self.optimizer = OptimizerInBackward(spec.optimizer, model.parameters(), spec.learning_rate,
                                                 spec.weight_decay, spec.warmup_steps, spec.sgd_momentum)
            self.scheduler = self.optimizer.scheduler
        else:
            self.optimizer = make_optimizer(spec.optimizer, model.parameters(), spec.learning_rate,
                                            spec.weight_decay, spec.sgd_momentum)
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

        if self._in_backward:  # the parameters were stepped and their gradients freed in backward
            self.scheduler.step()
            return
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
            # false: torch 1.x's default, the gradients zeroed in place and kept (training.zero_grad_set_to_none)
            self.optimizer.zero_grad(set_to_none=self._spec.zero_grad_set_to_none)
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
                state = layout.model_state(obj) if name == "model" else obj.state_dict()
                torch.save(state, directory / f"{name}.pt")

    def load(self, directory: Path) -> None:
        import torch

        device = next(self.model.parameters()).device
        for name, obj in self._states().items():
            state = torch.load(directory / f"{name}.pt", map_location=device, weights_only=True)
            if name == "model":
                layout.load_model_state(obj, state)
            else:
                obj.load_state_dict(state)
        self._meter.track_external(self.module, self.optimizer)

    def load_neutral(self, directory: Path) -> None:
        self.optimizer.load_state_dict(layout.neutral_optimizer(directory))
        self.scheduler.load_state_dict(layout.neutral_scheduler(directory))
        self._meter.track_external(self.module, self.optimizer)


def check_config(spec, world_size: int) -> None:
    """The run's ddp_config.json: DistributedDataParallel keyword arguments only."""
    _check_ddp_kwargs(spec.framework_config)

"""Worker hook of DeepSpeed: the run's ds_config checked against the run, then
`deepspeed.initialize` with the worker's torch optimizer (launcher/worker/backends.py)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from launcher.errors import ConfigError
from launcher.backends.deepspeed.checkpoint import DS_TAG
from launcher.worker.optim import make_optimizer, make_scheduler
from launcher.types import Strategy
from launcher.backends.deepspeed.emit import expected_half_sections, unsupported_reason
from launcher.worker import layout
from launcher.worker.model import quantized_base


def join(seed: int, device: str) -> None:
    """Join the process group through `deepspeed.init_distributed` (gloo on CPU processes, nccl on
    GPUs), with DeepSpeed's shared-memory comm op disabled: that op is C++ compiled on first use
    (~60 s) and gloo does the same job here. The seed is the worker's (`seed_everything`)."""
    os.environ.setdefault("DS_BUILD_OPS", "0")
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")


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
    zero = config.get("zero_optimization", {})
    off = lambda key: zero.get(key, {}).get("device", "none") not in ("none", None)  # noqa: E731
    return Strategy(getattr(spec, "strategy", "deepspeed"), "deepspeed", int(zero.get("stage", 0)),
                    offload_optimizer=off("offload_optimizer"), offload_params=off("offload_param"))


def _precision_problems(spec, config: dict) -> list[str]:
    """The planner's and emitter's rule (launcher/backends/deepspeed/emit.py `unsupported_reason`), and the
    bf16/fp16 sections the emitter writes for this precision (`expected_half_sections`)."""
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


def partitions_on_host(spec) -> bool:
    """ZeRO-3 of a model that is not quantized (`quantized_base`): the worker hands DeepSpeed the
    model as built on the host and partitions it from there (`_partition_on_host`)."""
    stage = int(spec.framework_config.get("zero_optimization", {}).get("stage", 0))
    return stage == 3 and not quantized_base(spec)


def _partition_on_host(model, config: dict, device):
    """ZeRO-3's partitioning of the host-built model, one parameter at a time: `zero.Init(module=)`
    moves each parameter to the device, broadcasts it from rank 0 and keeps this rank's partition
    (deepspeed/runtime/zero/partition_parameters.py `_convert_to_zero_parameters`; DeepSpeed's
    documented way to "partition an already-allocated model in CPU memory"). The engine makes the
    same call itself (parameter_offload.py `_convert_to_zero_parameters`), but only after moving the
    whole module to the device (engine.py `_configure_distributed_model`), which a model larger
    than one GPU does not survive. Partitioned first, the module counts as built under zero.Init:
    the engine neither moves it nor casts its parameters to its 16-bit dtype
    (`_cast_module_mixed_precision` casts only a module not built under zero.Init), so both are
    done here first: parameters a transformers class keeps in fp32 (`_keep_in_fp32_modules`)
    would otherwise be partitioned in fp32 beside 16-bit ones, which ZeRO-3's flat groups refuse.
    The engine's buffer pass still runs."""
    import deepspeed
    from deepspeed.runtime.engine import CASTABLE_DTYPES
    import torch

    half = (torch.bfloat16 if config.get("bf16", {}).get("enabled") else
            torch.float16 if config.get("fp16", {}).get("enabled") else None)
    if half is not None:  # as the engine's _cast_module_mixed_precision does for a module it will move
        for p in model.parameters():
            if p.dtype in CASTABLE_DTYPES and p.dtype != half:
                p.data = p.data.to(half)
    deepspeed.zero.Init(module=model, config_dict_or_path=config)
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)
    return model


class DeepSpeedBackend:
    MOVES_MODEL = staticmethod(partitions_on_host)  # launcher/worker/backends.py `moves_model`

    def __init__(self, model, spec, env, plan, meter) -> None:
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        config = deepspeed_config(spec, env.world_size)
        model = _true_dtype_model(model, spec, config)
        if partitions_on_host(spec):
            model = _partition_on_host(model, config, env.torch_device())
        optimizer = make_optimizer(spec.optimizer, model.parameters(), spec.learning_rate, spec.weight_decay,
                                   spec.sgd_momentum)
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
        # QLoRA's frozen 4-bit weights save QuantState entries no strict load takes back
        # (layout.load_model_state); HF Trainer loads every PEFT model non-strictly for the same reason
        strict = not layout.four_bit_weights(self.engine.module)
        path, _ = self.engine.load_checkpoint(str(directory), tag=DS_TAG, load_module_strict=strict)
        if path is None:
            raise ConfigError(f"DeepSpeed could not load the checkpoint in {directory}")
        self._meter.track_external(self.engine.module, self._base_optimizer)

    def load_neutral(self, directory: Path) -> None:
        """ZeRO-0 holds the torch optimizer whole; ZeRO 1-3 take each parameter's full moments
        through DeepSpeed's `safe_set_full_optimizer_state` after the flat partitions' torch
        states exist (ZeRO 1/2 create them lazily at the first step)."""
        import torch
        from deepspeed.utils import safe_set_full_optimizer_state

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


def check_config(spec, world_size: int) -> None:
    """The run's ds_config.json, checked against the run (`deepspeed_config`)."""
    deepspeed_config(spec, world_size)

"""ds_config.json for a DeepSpeed candidate: a pure function of the chosen candidate.

Every ZeRO knob is copied from the same `DeepSpeedConfig` object the memory and speed estimators
read; nothing here re-derives a default.

Optimizer: the worker hands DeepSpeed a client `torch.optim.AdamW`, so DeepSpeed's FusedAdam and
DeepSpeedCPUAdam C++ extensions are never compiled (building them takes minutes and needs a
compiler on every node). ZeRO accepts a client optimizer outside its tested list only with
`"zero_allow_untested_optimizer": true` (deepspeed/runtime/engine.py
`_do_optimizer_sanity_check`), and ZeRO-Offload accepts one that is not DeepSpeedCPUAdam only
with `"zero_force_ds_cpu_optimizer": false` (engine.py `_configure_optimizer`). The host step is
then torch's AdamW on CPU tensors, slower than DeepSpeedCPUAdam; launcher/speed.py models that.

Precision (DeepSpeed 0.19, deepspeed/runtime/precision_config.py and engine.py):
- 32-true: no fp16/bf16 section; DeepSpeed trains and communicates in fp32.
- bf16-mixed: `bf16.enabled`: DeepSpeed casts the model to bf16 and keeps fp32 master weights
  and optimizer states in its ZeRO optimizer.
- 16-mixed: `fp16.enabled` with dynamic loss scaling (`loss_scale` 0) and DeepSpeed's default
  scaler settings written out.
- bf16-true (every tensor in bf16):
  - ZeRO 1-3 without offload: `bf16_master_weights_and_grads` + `bf16_optimizer_states` keep
    master weights, gradients and optimizer states in bf16. With offload DeepSpeed requires
    DeepSpeedCPUAdam for that (stage_1_and_2.py `_enforce_cpu_offload`, stage3.py
    `_enforce_optimizer_offload`): unsupported here.
  - ZeRO-0: bf16 mode would wrap the optimizer with fp32 master copies (engine.py
    `_configure_fp16_optimizer`), so no bf16 section is written: the worker builds the model
    in bf16, the engine leaves its dtype alone (`_configure_distributed_model` casts only when
    fp16/bf16 is enabled) and steps the client optimizer directly; `communication_data_type`
    keeps the all-reduce in bf16 (it defaults to fp32 when bf16 is disabled).
- 16-true: unsupported. ZeRO 1-3 need `fp16_master_weights_and_grads`, which DeepSpeed allows
  only with DeepSpeedCPUAdam offload; ZeRO-0 would train fp16 parameters with no loss scaling.
- fp16 on CPU processes: DeepSpeed's CPU accelerator has fp16 only with oneDNN fp16 kernels, so
  16-mixed is refused for a CPU cluster (`unsupported_reason` gives every rule).
"""
from __future__ import annotations

from typing import Optional

from launcher.config import DeepSpeedConfig, TrainingConfig
from launcher.backends.deepspeed.rules import rules
from launcher.errors import ConfigError
from launcher.types import Strategy

STEPS_PER_PRINT = 1_000_000_000
"""DeepSpeed's own progress line every N steps; the worker logs instead."""

FP16_DYNAMIC_LOSS_SCALE = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}
"""DeepSpeedFP16Config's defaults (deepspeed/runtime/precision_config.py): loss_scale 0 = dynamic."""


def _precision_name(training: TrainingConfig) -> str:
    precision = training.precision
    return getattr(precision, "value", precision)


def unsupported_reason(strategy: Strategy, precision: str, device: Optional[str] = None) -> Optional[str]:
    """Why DeepSpeed cannot run this strategy at this precision with the worker's torch optimizer
    on `device` ('cuda' | 'cpu'; None: not known, the GPU's rules), or None: the capability table
    (launcher/backends/deepspeed/rules.py) the planner, the memory model and the worker apply."""
    table = rules(strategy)
    if precision in table.precisions[device or "cuda"]:
        return None
    return f"strategy={strategy.name} with precision={precision}: {table.why.get(precision, 'not supported')}"


def expected_half_sections(strategy: Strategy, precision: str) -> dict:
    """{'bf16': enabled, 'fp16': enabled} as `precision_section` writes them: what a ds_config
    for this run must say (the worker checks it)."""
    section = precision_section(strategy, precision)
    return {name: bool(section.get(name, {}).get("enabled", False)) for name in ("bf16", "fp16")}


def precision_section(strategy: Strategy, precision: str) -> dict:
    """The fp16 / bf16 keys of ds_config.json for a Lightning precision name (module docstring)."""
    reason = unsupported_reason(strategy, precision)
    if reason:
        raise ConfigError(reason)
    if precision == "bf16-mixed":
        return {"bf16": {"enabled": True}}
    if precision == "16-mixed":
        return {"fp16": {"enabled": True, **FP16_DYNAMIC_LOSS_SCALE}}
    if precision == "bf16-true" and strategy.zero_stage > 0:
        return {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                         "bf16_optimizer_states": True}}
    if precision == "bf16-true":
        return {"communication_data_type": "bf16"}
    if precision == "32-true":
        return {}
    raise ConfigError(f"unknown precision {precision!r}")


def zero_section(strategy: Strategy, ds: DeepSpeedConfig) -> dict:
    """`zero_optimization`: the stage and the knobs that stage reads
    (deepspeed/runtime/zero/config.py DeepSpeedZeroConfig). Stage 0 reads none of them."""
    section: dict = {"stage": strategy.zero_stage}
    if strategy.zero_stage == 0:
        return section
    section["reduce_bucket_size"] = ds.reduce_bucket_size
    section["allgather_bucket_size"] = ds.allgather_bucket_size
    section["contiguous_gradients"] = ds.contiguous_gradients
    if ds.overlap_comm is not None:
        section["overlap_comm"] = ds.overlap_comm
    if strategy.zero_stage == 3:
        section.update({
            "stage3_prefetch_bucket_size": ds.stage3_prefetch_bucket_size,
            "stage3_max_live_parameters": ds.stage3_max_live_parameters,
            "stage3_max_reuse_distance": ds.stage3_max_reuse_distance,
            "stage3_param_persistence_threshold": ds.stage3_param_persistence_threshold,
            "sub_group_size": ds.sub_group_size,
        })
    if strategy.offload_optimizer:
        section["offload_optimizer"] = {"device": "cpu", "pin_memory": ds.offload_pin_memory}
    if strategy.offload_params:
        section["offload_param"] = {"device": "cpu", "pin_memory": ds.offload_pin_memory}
    return section


def deepspeed_config(strategy: Strategy, training: TrainingConfig, ds: DeepSpeedConfig,
                     micro_batch_size: int, grad_accum_steps: int, dp_size: int) -> dict:
    """The ds_config.json dict. train_batch_size = micro x accum x dp, the identity DeepSpeed
    asserts (deepspeed/runtime/config.py `_batch_assertion`)."""
    if strategy.backend != "deepspeed":
        raise ValueError(f"strategy {strategy.name!r} is not a DeepSpeed strategy")
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": micro_batch_size * grad_accum_steps * dp_size,
        "gradient_clipping": float(training.max_grad_norm),
        **precision_section(strategy, _precision_name(training)),
        "zero_optimization": zero_section(strategy, ds),
        "zero_allow_untested_optimizer": True,
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    if strategy.offload_optimizer or strategy.offload_params:
        config["zero_force_ds_cpu_optimizer"] = False
    return config

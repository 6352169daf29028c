"""Configs of an FSDP1 candidate that users can reuse: pure functions.

- `plan_config`: the wrapping as JSON (`fsdp1_plan.json`, also run.json's `framework_config`,
  which the worker applies as written: worker.py): the `FullyShardedDataParallel` arguments.
- `accelerate_config`: Accelerate's `ClusterConfig` for `accelerate launch --config_file` with
  `distributed_type: FSDP` and `fsdp_version: 1` (accelerate/utils/dataclasses.py
  `FullyShardedDataParallelPlugin`; the keys under `fsdp_config` are its fields with the `fsdp_`
  prefix accelerate/commands/launch.py adds).
"""
from __future__ import annotations

from launcher.backends.base import Exported, export_candidate
from launcher.backends.fsdp2.emit import decoder_layer_class
from launcher.checkpointing import accelerate_fsdp_note
from launcher.types import Strategy

from .rules import mixed_precision, sharding_strategy

PLAN_FILE = "fsdp1_plan.json"
ACCELERATE_FILE = "accelerate_fsdp1_config.yaml"


def plan_config(strategy: Strategy, precision: str, num_processes: int) -> dict:
    """The FullyShardedDataParallel arguments the worker passes: one unit per decoder block
    (`ModuleWrapPolicy`) and the root; `MixedPrecision` as FSDP2's policy (bf16 parameters, fp32
    gradient reduction under bf16-mixed)."""
    return {
        "world": num_processes,
        "auto_wrap": "decoder_layers",  # ModuleWrapPolicy over the model's _no_split_modules classes
        "sharding_strategy": sharding_strategy(strategy),
        "use_orig_params": True,
        "limit_all_gathers": True,
        "backward_prefetch": "BACKWARD_PRE",
        "forward_prefetch": False,
        "mixed_precision": mixed_precision(precision),
    }


def accelerate_config(strategy: Strategy, precision: str, num_processes: int, num_machines: int,
                      device: str, layer_class: str | None, gradient_checkpointing: bool) -> dict:
    """Accelerate's ClusterConfig for an FSDP1 candidate (`layer_class`: the decoder block class
    that `TRANSFORMER_BASED_WRAP` wraps, e.g. LlamaDecoderLayer). Under `mixed_precision: bf16`
    Accelerate's plugin builds its own `MixedPrecision` in bf16, gradient reduction included
    (`FullyShardedDataParallelPlugin.set_mixed_precision`), where the worker reduces in fp32, and
    HF Trainer with a PEFT model wraps the adapters in units of their own (layout.py
    `MIXED_UNIT_NOTE`)."""
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "num_processes": num_processes,
        "num_machines": num_machines,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": "bf16" if precision == "bf16-mixed" else "no",
        "rdzv_backend": "static" if num_machines == 1 else "c10d",
        "same_network": True,
        "use_cpu": device == "cpu",
        "debug": False,
        "fsdp_config": {
            "fsdp_version": 1,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": layer_class,
            "fsdp_sharding_strategy": sharding_strategy(strategy),
            "fsdp_backward_prefetch": "BACKWARD_PRE",
            "fsdp_forward_prefetch": False,
            "fsdp_use_orig_params": True,
            "fsdp_offload_params": False,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_sync_module_states": True,
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_activation_checkpointing": gradient_checkpointing,
        },
    }


def exports(plan, config) -> Exported:
    """The FSDP1 arguments and the Accelerate config (launcher/exports.py) of the chosen candidate
    when it is an FSDP1 one, else of the fastest FSDP1 candidate that fits and can be launched;
    nothing when no FSDP1 candidate was planned."""
    import json

    import yaml

    if not any(c.strategy.backend == "fsdp1" for c in plan.candidates):
        return Exported("FSDP1")  # planned by name only (rules.py): nothing to say under other strategies
    i = export_candidate(plan, "fsdp1")
    if i is None:
        return Exported("FSDP1", why="no FSDP1 candidate fits")
    c = plan.candidates[i]
    t = config.training
    layer = decoder_layer_class(config)
    ckpt = t.gradient_checkpointing or c.gradient_checkpointing
    note = accelerate_fsdp_note(t.checkpoint_policy.name, ACCELERATE_FILE) if ckpt else ""
    acc = accelerate_config(c.strategy, t.precision.name, config.gpus, config.nodes, config.hardware.device,
                            layer, ckpt and not note)
    if layer is None:
        del acc["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"]  # Accelerate takes _no_split_modules
    return Exported("FSDP1", files=(
        (PLAN_FILE, json.dumps(plan_config(c.strategy, t.precision.name, config.gpus), indent=2,
                               sort_keys=True) + "\n"),
        (ACCELERATE_FILE, yaml.safe_dump(acc, sort_keys=True))), candidate=i, note=note)


def emit(x) -> dict:
    """The registry's emitter (launcher/backends/base.py `EmitInput`): the plan JSON."""
    return plan_config(x.strategy, x.training.precision.name, x.dp_size)

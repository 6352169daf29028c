"""Configs of an FSDP2 candidate that users can reuse: pure functions.

- `plan_config`: the sharding and parallelize plan as JSON (`fsdp2_plan.json`, also run.json's
  `framework_config`, which the worker applies as written: worker.py): the DeviceMesh, which
  modules `fully_shard` wraps, `reshard_after_forward` (the last block's apart: rules.py
  `keep_last_block`), the `MixedPrecisionPolicy`, CPU offload
  and, with tp > 1, the `parallelize_module` plan (tp_plan.py).
- `accelerate_config`: Accelerate's `ClusterConfig` for `accelerate launch --config_file`
  with `distributed_type: FSDP` and `fsdp_version: 2` (accelerate/utils/dataclasses.py
  `FullyShardedDataParallelPlugin`; keys under `fsdp_config` are its fields with the `fsdp_`
  prefix accelerate/commands/launch.py adds); tensor parallelism as its `parallelism_config`
  (`parallelism_config_dp_shard_size`, `parallelism_config_tp_size`, the `accelerate launch`
  arguments of the same names). Accelerate applies one `reshard_after_forward` to every block, so
  under it the last block reshards too: one block's unsharded parameters less through the LM head
  and the loss than the plan's (rules.py `keep_last_block`), one all-gather more.
"""
from __future__ import annotations

from launcher.backends.base import Exported, export_candidate
from launcher.checkpointing import accelerate_fsdp_note
from launcher.types import Strategy

from . import tp_plan
from .rules import keep_last_block, mixed_precision, reshard_after_forward

PLAN_FILE = "fsdp2_plan.json"
ACCELERATE_MIXED = {"bf16-mixed": "bf16"}


def plan_config(strategy: Strategy, precision: str, num_processes: int, knobs=None) -> dict:
    """The plan the worker runs (and a torchtitan/torchtune user reads): mesh, wrapping, policy.
    Activation checkpointing is the run's `gradient_checkpointing` (run.json), applied by
    transformers inside each block, not part of the sharding plan."""
    tp = strategy.tp_size
    config = {
        "mesh": {"dp": num_processes // tp, "tp": tp} if tp > 1 else {"dp": num_processes},
        "fully_shard": ["model.layers.*", "<root>"],
        "reshard_after_forward": reshard_after_forward(strategy),
        "last_block_reshard_after_forward": reshard_after_forward(strategy) and not keep_last_block(strategy, knobs),
        "root_reshard_after_forward": None,  # FSDP2's default for the root: keep it unsharded
        "mp_policy": mixed_precision(precision),
        "cpu_offload": strategy.offload_params,
    }
    if tp > 1:
        config["tp_plan"] = tp_plan.plan_json()
        config["loss_parallel"] = "vocab_parallel_cross_entropy"  # loss.py
    return config


def accelerate_config(strategy: Strategy, precision: str, num_processes: int, num_machines: int,
                      device: str, layer_class: str | None, gradient_checkpointing: bool) -> dict:
    """Accelerate's ClusterConfig for an FSDP2 candidate (`layer_class`: the decoder block class
    that `TRANSFORMER_BASED_WRAP` shards, e.g. LlamaDecoderLayer)."""
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "num_processes": num_processes,
        "num_machines": num_machines,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": ACCELERATE_MIXED.get(precision, "no"),
        "rdzv_backend": "static" if num_machines == 1 else "c10d",
        "same_network": True,
        "use_cpu": device == "cpu",
        "debug": False,
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": layer_class,
            "fsdp_reshard_after_forward": reshard_after_forward(strategy),
            "fsdp_offload_params": strategy.offload_params,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_activation_checkpointing": gradient_checkpointing,
        },
    }
    if strategy.tp_size > 1:
        config["parallelism_config"] = {"parallelism_config_dp_shard_size": num_processes // strategy.tp_size,
                                        "parallelism_config_tp_size": strategy.tp_size}
    return config


ACCELERATE_FILE = "accelerate_fsdp2_config.yaml"


def decoder_layer_class(config) -> str | None:
    """The decoder block classes transformers names for the model of `config`, or None: its
    `ModelSpec.no_split_modules` (launcher/model.py), read from the spec cache when the plan has
    been made, so writing the export imports neither transformers nor torch."""
    from launcher.model import load_spec

    return ",".join(load_spec(config.model, config.cache_dir).no_split_modules) or None


def exports(plan, config) -> Exported:
    """The sharding plan JSON and the Accelerate FSDP2 config (launcher/exports.py) of the chosen
    candidate when it is an FSDP2 one, else of the fastest FSDP2 candidate that fits and can be
    launched."""
    import json

    import yaml

    i = export_candidate(plan, "fsdp2")
    if i is None:
        return Exported("FSDP2", why="no FSDP2 candidate fits")
    c = plan.candidates[i]
    t = config.training
    ckpt = t.gradient_checkpointing or c.gradient_checkpointing
    note = accelerate_fsdp_note(t.checkpoint_policy.name, ACCELERATE_FILE) if ckpt else ""
    plan_json = plan_config(c.strategy, t.precision.name, config.gpus, config.fsdp2)
    layer = decoder_layer_class(config)
    acc = accelerate_config(c.strategy, t.precision.name, config.gpus, config.nodes, config.hardware.device,
                            layer, ckpt and not note)
    if layer is None:
        del acc["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"]  # Accelerate takes _no_split_modules
    return Exported("FSDP2", files=((PLAN_FILE, json.dumps(plan_json, indent=2, sort_keys=True) + "\n"),
                                    (ACCELERATE_FILE, yaml.safe_dump(acc, sort_keys=True))), candidate=i, note=note)


def emit(x) -> dict:
    """The registry's emitter (launcher/backends/base.py `EmitInput`): the plan JSON."""
    return plan_config(x.strategy, x.training.precision.name, x.dp_size * x.strategy.tp_size, x.knobs.get("fsdp2"))

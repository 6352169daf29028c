"""What a DeepSpeed plan writes for the tools users already run (launcher/exports.py asks every
backend through `Backend.exports`, `accelerate` and `launch_commands`):

- `ds_config.standalone.json`: the DeepSpeed config with optimizer and scheduler blocks, for
  `deepspeed.initialize(model=..., config=...)` without a client optimizer;
- `ds_config.hf_trainer.json`: the same with HF Trainer's "auto" values, for
  `TrainingArguments(deepspeed=...)` (Axolotl and LLaMA-Factory take the same file)
  (launcher/backends/deepspeed/standalone.py);
- Accelerate's DEEPSPEED keys, which point `deepspeed_config_file` at the stand-alone file;
- the `deepspeed` launcher's command line.

The files describe the chosen candidate when it is a DeepSpeed one, else the fastest DeepSpeed
candidate that fits and can be launched.
"""
from __future__ import annotations

import json
from pathlib import Path

from launcher.backends.base import Exported, export_candidate
from launcher.backends.deepspeed.emit import deepspeed_config, unsupported_reason
from launcher.backends.deepspeed.standalone import hf_trainer_config, standalone_config, unsupported_optimizer
from launcher.types import Strategy

STANDALONE = "ds_config.standalone.json"
HF_TRAINER = "ds_config.hf_trainer.json"


def exports(plan, config) -> Exported:
    """The two DeepSpeed files (module docstring) of the chosen candidate when it is a DeepSpeed one
    DeepSpeed runs at the plan's precision (emit.py `unsupported_reason`), else of the fastest such
    candidate that fits and can be launched."""
    t = config.training
    if unsupported_optimizer(t):
        return Exported("DeepSpeed", why=unsupported_optimizer(t))
    precision, device = t.precision.name, config.hardware.device
    i = export_candidate(plan, "deepspeed", lambda c: unsupported_reason(c.strategy, precision, device) is None)
    if i is None:
        return Exported("DeepSpeed", why="no DeepSpeed candidate fits")
    c = plan.candidates[i]
    dp = config.gpus // (c.strategy.tp_size * c.strategy.pp_size)
    base = deepspeed_config(c.strategy, t, config.deepspeed, c.micro_batch_size, c.grad_accum_steps, dp)
    return Exported("DeepSpeed", files=(
        (STANDALONE, json.dumps(standalone_config(base, t), indent=2, sort_keys=True) + "\n"),
        (HF_TRAINER, json.dumps(hf_trainer_config(base, t), indent=2, sort_keys=True) + "\n")), candidate=i)


def accelerate_keys(strategy: Strategy, device: str, run_dir) -> dict:
    """Accelerate's DEEPSPEED launch (accelerate/commands/config/config_args.py `ClusterConfig`),
    reading the stand-alone config written into `run_dir`; ZeRO-3 builds the model partitioned
    (`zero3_init_flag`)."""
    if run_dir is None:
        raise ValueError("a DeepSpeed candidate's Accelerate config reads the stand-alone DeepSpeed config: "
                         "give the run directory it is written to")
    return {"distributed_type": "DEEPSPEED",
            "deepspeed_config": {"deepspeed_config_file": str(Path(run_dir) / STANDALONE),
                                 "zero3_init_flag": strategy.zero_stage == 3}}


def launch_commands(per_node: int, num_machines: int, run_json: str, master_port: int) -> dict:
    """The `deepspeed` launcher starting the worker module on every rank (its `--no_local_rank`:
    the worker reads LOCAL_RANK from the environment); over several nodes it reads `hostfile`."""
    nodes = [] if num_machines == 1 else ["--hostfile=hostfile", f"--master_port={master_port}"]
    return {"deepspeed": ["deepspeed", f"--num_gpus={per_node}", f"--num_nodes={num_machines}", *nodes,
                          "--no_local_rank", "--module", "launcher.worker", run_json]}

"""Configs for the tools users already run, written next to the plan.

- `ds_config.standalone.json`: DeepSpeed config with optimizer and scheduler blocks, for
  `deepspeed.initialize(model=..., config=...)` without a client optimizer.
- `ds_config.hf_trainer.json`: the same with HF Trainer's "auto" values, for
  `TrainingArguments(deepspeed=...)` (Axolotl and LLaMA-Factory take the same file).
- `accelerate_config.yaml`: for `accelerate launch --config_file`.
- `launch_commands.sh`: the job as `torchrun`, `deepspeed` and `accelerate launch` commands.

The DeepSpeed files describe the chosen candidate when it is a DeepSpeed one, else the fastest
launchable DeepSpeed candidate that fits; the Accelerate file the chosen candidate when
Accelerate can launch it (torch DDP or DeepSpeed), else the DeepSpeed one. Each file's candidate
is named in launch_commands.sh. The app writes them; everything here returns data.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from launcher.config import LauncherConfig
from launcher.emit.accelerate import accelerate_config, accelerate_unsupported, command_lines
from launcher.emit.deepspeed import deepspeed_config, unsupported_reason
from launcher.emit.standalone import hf_trainer_config, standalone_config, unsupported_optimizer
from launcher.report import strategy_label, trains_label
from launcher.types import Candidate, Plan

STANDALONE = "ds_config.standalone.json"
HF_TRAINER = "ds_config.hf_trainer.json"
ACCELERATE = "accelerate_config.yaml"
COMMANDS = "launch_commands.sh"


@dataclass(frozen=True)
class Export:
    file_name: str
    text: str


def launchable(c: Candidate) -> bool:
    return c.fits and "not launchable" not in c.reason


def pick(plan: Plan, config: LauncherConfig, backends: tuple[str, ...]) -> Optional[int]:
    """The chosen candidate if its backend is in `backends`, else the fastest launchable one that
    fits and is (candidates are ranked fastest first)."""
    precision = config.training.precision.name
    ok = [i for i, c in enumerate(plan.candidates) if c.strategy.backend in backends and launchable(c)
          and (c.strategy.backend != "deepspeed"
               or unsupported_reason(c.strategy, precision, config.hardware.device) is None)]
    if plan.chosen in ok:
        return plan.chosen
    return ok[0] if ok else None


def describe(i: int, c: Candidate) -> str:
    return (f"#{i} {strategy_label(c)} ({trains_label(c)}), micro_batch_size={c.micro_batch_size}, "
            f"grad_accum_steps={c.grad_accum_steps}")


def exports(plan: Plan, config: LauncherConfig, run_dir: Path) -> list[Export]:
    """Every export file for this plan (module docstring); none when nothing fits."""
    t = config.training
    out: list[Export] = []
    header = ["#!/usr/bin/env bash", "# The planned job as each launcher starts it (run from any directory).",
              "# Pick one command; launch_command.sh is the one the launcher runs."]
    ds_i = pick(plan, config, ("deepspeed",))
    ds_path = None
    if ds_i is not None and unsupported_optimizer(t) is None:
        c = plan.candidates[ds_i]
        dp = config.gpus // (c.strategy.tp_size * c.strategy.pp_size)
        base = deepspeed_config(c.strategy, t, config.deepspeed, c.micro_batch_size, c.grad_accum_steps, dp)
        ds_path = str(run_dir / STANDALONE)
        out.append(Export(STANDALONE, json.dumps(standalone_config(base, t), indent=2, sort_keys=True) + "\n"))
        out.append(Export(HF_TRAINER, json.dumps(hf_trainer_config(base, t), indent=2, sort_keys=True) + "\n"))
        header.append(f"# {STANDALONE}, {HF_TRAINER}: {describe(ds_i, c)}")
    elif unsupported_optimizer(t):
        header.append(f"# no DeepSpeed export: {unsupported_optimizer(t)}")
    acc_i = pick(plan, config, ("ddp", "deepspeed"))
    if acc_i is not None and plan.candidates[acc_i].strategy.backend == "deepspeed" and ds_i != acc_i:
        acc_i = ds_i
    acc_path = None
    if acc_i is not None and (plan.candidates[acc_i].strategy.backend == "ddp" or ds_path):
        c = plan.candidates[acc_i]
        acc = accelerate_config(c.strategy, t.precision.name, config.gpus, config.nodes, config.hardware.device,
                                ds_path, config.launch.master_port)
        acc_path = str(run_dir / ACCELERATE)
        out.append(Export(ACCELERATE, yaml.safe_dump(acc, sort_keys=True)))
        header.append(f"# {ACCELERATE}: {describe(acc_i, c)}")
    elif plan.chosen is not None and accelerate_unsupported(plan.candidates[plan.chosen].strategy):
        header.append(f"# no Accelerate export: {accelerate_unsupported(plan.candidates[plan.chosen].strategy)}")
    if plan.chosen is None:
        return out
    chosen = plan.candidates[plan.chosen]
    header.append(f"# torchrun: {describe(plan.chosen, chosen)} (run.json)")
    cmds = command_lines(num_processes=config.gpus, num_machines=config.nodes, run_json=str(run_dir / "run.json"),
                         master_port=config.launch.master_port, accelerate_file=acc_path if acc_i == plan.chosen else None,
                         deepspeed=chosen.strategy.backend == "deepspeed")
    lines = [*header, ""]
    for name, argv in cmds.items():
        lines += [f"# {name}", " ".join(a if "${" in a else shlex.quote(a) for a in argv), ""]
    out.append(Export(COMMANDS, "\n".join(lines)))
    return out


def write(plan: Plan, config: LauncherConfig, run_dir: Path) -> list[str]:
    """Write the export files into `run_dir`; their names."""
    names = []
    for e in exports(plan, config, run_dir):
        (run_dir / e.file_name).write_text(e.text)
        names.append(e.file_name)
    return names

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
from launcher.emit.accelerate import accelerate_config, command_lines
from launcher.backends.deepspeed.emit import deepspeed_config, unsupported_reason
from launcher.backends.deepspeed.standalone import hf_trainer_config, standalone_config, unsupported_optimizer
from launcher.backends.registry import REGISTRY
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


def deepspeed_exports(plan: Plan, config: LauncherConfig) -> tuple[Optional[int], list[Export], str]:
    """(candidate, the two DeepSpeed files, header line) for the DeepSpeed candidate, if any."""
    t = config.training
    if unsupported_optimizer(t):
        return None, [], f"# no DeepSpeed export: {unsupported_optimizer(t)}"
    i = pick(plan, config, ("deepspeed",))
    if i is None:
        return None, [], "# no DeepSpeed export: no DeepSpeed candidate fits"
    c = plan.candidates[i]
    dp = config.gpus // (c.strategy.tp_size * c.strategy.pp_size)
    base = deepspeed_config(c.strategy, t, config.deepspeed, c.micro_batch_size, c.grad_accum_steps, dp)
    files = [Export(STANDALONE, json.dumps(standalone_config(base, t), indent=2, sort_keys=True) + "\n"),
             Export(HF_TRAINER, json.dumps(hf_trainer_config(base, t), indent=2, sort_keys=True) + "\n")]
    return i, files, f"# {STANDALONE}, {HF_TRAINER}: {describe(i, c)}"


def accelerate_export(plan: Plan, config: LauncherConfig, ds_i: Optional[int],
                      run_dir: Path) -> tuple[Optional[int], list[Export], str]:
    """(candidate, the Accelerate file, header line): the chosen candidate when it is torch DDP or
    the DeepSpeed export's candidate, else the fastest torch DDP one, else the DeepSpeed one."""
    i = pick(plan, config, ("ddp", "deepspeed"))
    why = "no torch DDP or DeepSpeed candidate fits"
    if i is not None and plan.candidates[i].strategy.backend == "deepspeed":
        i = ds_i  # Accelerate reads the stand-alone DeepSpeed file, written for ds_i
        why = "it would read the stand-alone DeepSpeed config, which is not written"
    if i is None:
        return None, [], f"# no Accelerate export: {why}"
    c = plan.candidates[i]
    acc = accelerate_config(c.strategy, config.training.precision.name, config.gpus, config.nodes,
                            config.hardware.device, str(run_dir / STANDALONE), config.launch.master_port)
    return i, [Export(ACCELERATE, yaml.safe_dump(acc, sort_keys=True))], f"# {ACCELERATE}: {describe(i, c)}"


def exports(plan: Plan, config: LauncherConfig, run_dir: Path) -> list[Export]:
    """Every export file for this plan (module docstring); none when nothing fits."""
    ds_i, ds_files, ds_line = deepspeed_exports(plan, config)
    acc_i, acc_files, acc_line = accelerate_export(plan, config, ds_i, run_dir)
    backend_lines = []
    for backend in REGISTRY.values():  # a backend's own exports (Backend.exports)
        if backend.exports:
            files, line = backend.exports(plan, config)
            acc_files += [Export(name, text) for name, text in files]
            backend_lines += [line] if line else []  # '': the backend was not planned
    if plan.chosen is None:
        return ds_files + acc_files
    chosen = plan.candidates[plan.chosen]
    cmds = command_lines(num_processes=config.gpus, num_machines=config.nodes, run_json=str(run_dir / "run.json"),
                         master_port=config.launch.master_port,
                         accelerate_file=str(run_dir / ACCELERATE) if acc_i == plan.chosen else None,
                         deepspeed=chosen.strategy.backend == "deepspeed")
    lines = ["#!/usr/bin/env bash", "# The planned job as each launcher starts it (run from any directory).",
             "# Pick one command; launch_command.sh is the one the launcher runs.", ds_line, acc_line, *backend_lines,
             f"# torchrun: {describe(plan.chosen, chosen)} (run.json)", ""]
    for name, argv in cmds.items():
        lines += [f"# {name}", " ".join(a if "${" in a else shlex.quote(a) for a in argv), ""]
    return ds_files + acc_files + [Export(COMMANDS, "\n".join(lines))]


def write(plan: Plan, config: LauncherConfig, run_dir: Path) -> list[str]:
    """Write the export files into `run_dir`; their names."""
    names = []
    for e in exports(plan, config, run_dir):
        (run_dir / e.file_name).write_text(e.text)
        names.append(e.file_name)
    return names

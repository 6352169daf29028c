"""Configs for the tools users already run, written next to the plan.

- Each backend's own files (`Backend.exports`): DeepSpeed's stand-alone and HF Trainer configs
  (launcher/backends/deepspeed/exports.py), FSDP's plans and Accelerate configs.
- `accelerate_config.yaml`: for `accelerate launch --config_file`, for a candidate whose backend
  gives Accelerate's keys (`Backend.accelerate`: torch DDP, DeepSpeed).
- `launch_commands.sh`: the job as `torchrun`, `accelerate launch` and the chosen backend's own
  launchers (`Backend.launch_commands`: `deepspeed`).

A backend's files describe the chosen candidate when it is one of the backend's, else its fastest
launchable candidate that fits. The Accelerate file describes the chosen candidate when Accelerate
can launch it, else the fastest that Accelerate can launch; for a backend with exports, the
candidate they describe (Accelerate reads them: DeepSpeed's stand-alone config). Each file's
candidate is named in launch_commands.sh. The app writes them; everything here returns data.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from launcher.backends.base import Exported, export_candidate
from launcher.backends.registry import REGISTRY
from launcher.config import LauncherConfig
from launcher.emit.accelerate import accelerate_config, command_lines
from launcher.report import strategy_label, trains_label
from launcher.types import Candidate, Plan

ACCELERATE = "accelerate_config.yaml"
COMMANDS = "launch_commands.sh"


@dataclass(frozen=True)
class Export:
    file_name: str
    text: str


def describe(i: int, c: Candidate) -> str:
    return (f"#{i} {strategy_label(c)} ({trains_label(c)}), micro_batch_size={c.micro_batch_size}, "
            f"grad_accum_steps={c.grad_accum_steps}")


def header(plan: Plan, e: Exported) -> str:
    """The launch_commands.sh line naming what a backend exported, or why nothing ('' for nothing to say)."""
    if e.files:
        line = f"# {', '.join(name for name, _ in e.files)}: {describe(e.candidate, plan.candidates[e.candidate])}"
        return line + (f"\n# {e.note}" if e.note else "")
    return f"# no {e.label} export: {e.why}" if e.why else ""


def accelerate_export(plan: Plan, config: LauncherConfig, exported: dict[str, Exported],
                      run_dir: Path) -> tuple[Optional[int], list[Export], str]:
    """(candidate, the Accelerate file, header line) (module docstring)."""
    backends = [name for name, b in REGISTRY.items() if b.accelerate]
    i = export_candidate(plan, backends)
    why = f"no candidate of a backend Accelerate launches here ({', '.join(backends)}) fits"
    if i is not None and plan.candidates[i].strategy.backend in exported:
        e = exported[plan.candidates[i].strategy.backend]
        i = e.candidate  # Accelerate reads the files the backend wrote, for their candidate
        why = f"it would read the {e.label} export, which is not written"
    if i is None:
        return None, [], f"# no Accelerate export: {why}"
    c = plan.candidates[i]
    acc = accelerate_config(c.strategy, config.training.precision.name, config.gpus, config.nodes,
                            config.hardware.device, str(run_dir), config.launch.master_port)
    return i, [Export(ACCELERATE, yaml.safe_dump(acc, sort_keys=True))], f"# {ACCELERATE}: {describe(i, c)}"


def exports(plan: Plan, config: LauncherConfig, run_dir: Path) -> list[Export]:
    """Every export file for this plan (module docstring); none but the backends' when nothing fits."""
    exported = {name: b.exports(plan, config) for name, b in REGISTRY.items() if b.exports}
    files = [Export(name, text) for e in exported.values() for name, text in e.files]
    acc_i, acc_files, acc_line = accelerate_export(plan, config, exported, run_dir)
    if plan.chosen is None:
        return files + acc_files
    chosen = plan.candidates[plan.chosen]
    cmds = command_lines(num_processes=config.gpus, num_machines=config.nodes, run_json=str(run_dir / "run.json"),
                         master_port=config.launch.master_port,
                         accelerate_file=str(run_dir / ACCELERATE) if acc_i == plan.chosen else None,
                         strategy=chosen.strategy)
    lines = ["#!/usr/bin/env bash", "# The planned job as each launcher starts it (run from any directory).",
             "# Pick one command; launch_command.sh is the one the launcher runs.",
             *[line for line in (header(plan, e) for e in exported.values()) if line], acc_line,
             f"# torchrun: {describe(plan.chosen, chosen)} (run.json)", ""]
    for name, argv in cmds.items():
        lines += [f"# {name}", " ".join(a if "${" in a else shlex.quote(a) for a in argv), ""]
    return files + acc_files + [Export(COMMANDS, "\n".join(lines))]


def write(plan: Plan, config: LauncherConfig, run_dir: Path) -> list[str]:
    """Write the export files into `run_dir`; their names."""
    names = []
    for e in exports(plan, config, run_dir):
        (run_dir / e.file_name).write_text(e.text)
        names.append(e.file_name)
    return names

"""The application: the only place that writes files, prints, and spawns processes.

`main(cfg)` is called by the @hydra.main in __main__.py with Hydra's run directory as cwd-free
output dir. Everything it calls is pure: planner -> Plan, emit -> dict, launch -> argv.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from omegaconf import DictConfig

from launcher import (calibrate, exports, fallback, infer_plan, launch, measure, planner, report, report_html,
                      report_table, slurm)
from launcher.calibrate import other_machine_note
from launcher.config import LauncherConfig
from launcher.environment import cache_dir_problem, detect
from launcher import liger
from launcher.errors import ConfigError, SweepError
from launcher.hardware import cluster_from, local_gpu_names
from launcher.model import load_spec
from launcher.progress import working
from launcher.validate import to_config


def model_spec(config: LauncherConfig):
    """The model's numbers, checked against the workload (sequence length within its positions)."""
    spec = load_spec(config.model, config.cache_dir)
    seq_max = spec.max_positions
    serving = config.mode.name == "infer_plan"  # its lengths are inference.prompt_len and gen_len (infer_plan.py)
    if seq_max is not None and config.training.seq_len > seq_max and not serving:
        raise ConfigError(f"training.seq_len={config.training.seq_len} is above {spec.name}'s maximum "
                          f"positions ({seq_max}); use training.seq_len<={seq_max}")
    if config.training.liger_kernel and not liger.supported(spec.model_type):
        raise ConfigError(f"training.liger_kernel: Liger's kernels are modelled for {', '.join(liger.FAMILIES)} "
                          f"models, not {spec.model_type}; use training.liger_kernel=false")
    if config.training.liger_kernel:
        try:
            liger.trace_name(config.training.liger_kernels)
        except ValueError as e:
            raise ConfigError(f"training.liger_kernels: {e}; "
                              "e.g. training.liger_kernels=[rope,fused_linear_cross_entropy]") from None
    return spec


def resolved_mode(config: LauncherConfig) -> str:
    """What mode=auto does here: run where the GPUs are (a Slurm cluster, local GPUs, or CPU
    processes with hardware=cpu), else plan."""
    mode = config.mode.name
    if mode == "auto" and config.launch.kind.name == "slurm":
        return "run"  # launch=slurm: the GPUs are on the cluster, not here
    if mode == "auto":
        return "run" if local_gpu_names() or config.hardware.device == "cpu" else "plan"
    return mode


def mode_problem(config: LauncherConfig) -> str:
    """Why this config cannot run in its mode, or ''."""
    if config.training.length_profile is not None and resolved_mode(config) in ("run", "measure"):
        return (f"training.length_profile={config.training.length_profile}: plans a data pipeline that pads "
                "each micro-batch to its longest example, but the worker trains packed training.seq_len "
                "blocks; use mode=plan, or training.length_profile=null to train")
    mode = resolved_mode(config)
    if (mode in ("run", "measure") and config.launch.kind.name == "torchrun" and config.hardware.device == "cuda"
            and not local_gpu_names()):
        return (f"mode={mode}: hardware={config.hardware.name} plans CUDA GPUs but this machine has none (no GPU in "
                "nvidia-smi -L); use mode=plan to plan only, hardware=cpu to train on CPU processes, or "
                "launch.kind=slurm to run on a cluster's GPUs")
    return ""


def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    config = to_config(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if HydraConfig.get().mode == RunMode.MULTIRUN:  # a single run was checked before Hydra ran it (cli.check)
        why = cache_dir_problem(config.cache_dir) or mode_problem(config)
        if why:
            raise SweepError(why)
    if isinstance(config.resume, str):  # resume=<run dir>: continue that run (launcher/fallback.py)

        rc = fallback.resume_run(config, quiet=config.report.name == "json")
        if rc != 0:
            sys.exit(rc)
        return
    if (run_dir / "plan.json").exists():
        raise ConfigError(f"run directory {run_dir} already holds a run (plan.json) and is never overwritten; "
                          f"use a new hydra.run.dir, or resume={run_dir} to continue that run")
    config.run_dir = str(run_dir)
    if config.mode.name == "calibrate":
        calibrate.main(config, run_dir)
        return
    spec = model_spec(config)
    if config.mode.name == "infer_plan":  # serving memory per GPU (launcher/infer_plan.py)

        result = infer_plan.infer_plan(config, spec)
        (run_dir / "infer_plan.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2) if config.report.name == "json" else infer_plan.format_report(result))
        return
    mode = resolved_mode(config)
    if config.mode.name == "auto" and mode == "plan" and config.hardware.device != "cpu":
        print(report.wrapped("note: no local GPU: planning only. To train for real on CPU processes, "
                             "add hardware=cpu (e.g. scripts/demo)"), file=sys.stderr)

    note = other_machine_note(config.hardware)
    if note and config.report.name != "json":
        print(report.wrapped(note), file=sys.stderr)
    # the job inherits this environment (torchrun, sbatch): its allocator settings shape peak reserved,
    # its NCCL settings NCCL's buffers
    cluster = cluster_from(config.hardware, config.gpus, config.nodes, os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                           os.environ)

    where = f"{config.gpus} CPU processes" if cluster.device == "cpu" else f"{config.gpus} x {config.hardware.name}"
    with working(f"planning {spec.name} on {where}: tracing the model, estimating every strategy"):
        plan = planner.plan(config, spec, cluster, detect())
    plan_dict = report.plan_to_dict(plan, cluster.memory_bytes)
    plan_text = json.dumps(plan_dict, indent=2)  # written and, with report=json, printed: encoded once
    (run_dir / "plan.json").write_text(plan_text + "\n")

    exports.write(plan, config, run_dir)

    report_html.write(run_dir, config.planner.safety_margin, cluster.device)
    if config.report.name == "json":
        print(plan_text)
    else:
        report_table.print_plan(plan, cluster.memory_bytes, cluster.device, wide=config.report.name == "wide")
    if plan.chosen is None:
        fits = any(c.fits for c in plan.candidates)
        print("No candidate that fits can be launched here; see each verdict." if fits else
              "No candidate fits; see the plan for what would.", file=sys.stderr)
        if mode in ("run", "measure"):
            sys.exit(1)
        return

    job = launch.prepare(plan, config, spec, run_dir)
    quiet = config.report.name == "json"
    if not quiet:
        print(f"\nrun directory: {run_dir}\nlaunch command:\n{report.shell_block(job.argv)}")
    if config.launch.kind.name != "torchrun":  # launch=slurm / sbatch_script (launcher/slurm.py)

        rc = slurm.dispatch(config, job, plan.candidates[plan.chosen], mode, quiet, plan, spec)
        if rc == 0 and mode == "run" and config.launch.kind.name == "slurm" and config.launch.wait and not quiet:
            report.print_summary(run_dir)
        if rc != 0:
            sys.exit(rc)
        return
    if mode == "measure":
        result = measure.measure(job, plan, config)
        report_html.write(run_dir, config.planner.safety_margin, cluster.device)
        print(json.dumps(result, indent=2) if quiet else "\n" + measure.format_result(result))
        return
    if mode == "run":
        rc, final_dir = fallback.run_with_fallback(plan, config, spec, job, quiet=quiet)
        report_html.write(run_dir, config.planner.safety_margin, cluster.device, Path(final_dir))
        if rc != 0:
            print(f"error: training exited with code {rc}; logs in {final_dir}", file=sys.stderr)
            sys.exit(rc)
        if not quiet:
            report.print_summary(final_dir)

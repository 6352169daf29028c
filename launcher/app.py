"""The application: the only place that writes files, prints, and spawns processes.

`main(cfg)` is called by the @hydra.main in __main__.py with Hydra's run directory as cwd-free
output dir. Everything it calls is pure: planner -> Plan, emit -> dict, launch -> argv.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from launcher.config import LauncherConfig
from launcher.errors import ConfigError, collect


def to_config(cfg: DictConfig) -> LauncherConfig:
    """The last place that knows about OmegaConf; validates every value at once."""
    config: LauncherConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    collect(problems(config))
    return config


def problems(c: LauncherConfig) -> list[str]:
    """Every problem with the values, each naming the key and the fix."""
    out: list[str] = []
    t = c.training
    if c.gpus < 1:
        out.append(f"gpus={c.gpus}: must be at least 1; e.g. gpus=4")
    if c.nodes < 1:
        out.append(f"nodes={c.nodes}: must be at least 1; e.g. nodes=2")
    elif c.gpus >= 1 and c.gpus % c.nodes:
        out.append(f"gpus={c.gpus} is not divisible by nodes={c.nodes}; gpus counts GPUs over all nodes, "
                   f"e.g. gpus={c.nodes * max(1, c.gpus // c.nodes)} nodes={c.nodes}")
    for key in ("seq_len", "max_steps"):
        if getattr(t, key) < 1:
            out.append(f"training.{key}={getattr(t, key)}: must be at least 1")
    for key in ("micro_batch_size", "global_batch_size"):
        v = getattr(t, key)
        if v is not None and v < 1:
            out.append(f"training.{key}={v}: must be at least 1 (or null to let the planner choose)")
    if t.micro_batch_size and t.global_batch_size and c.gpus >= 1 and t.global_batch_size % (t.micro_batch_size * c.gpus):
        m, dp = t.micro_batch_size, c.gpus
        out.append(f"training.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size x "
                   f"data-parallel size = {m} x {dp}; try training.global_batch_size={m * dp * max(1, t.global_batch_size // (m * dp))}")
    if t.learning_rate <= 0:
        out.append(f"training.learning_rate={t.learning_rate}: must be positive")
    if not 0 <= c.planner.safety_margin < 1:
        out.append(f"planner.safety_margin={c.planner.safety_margin}: must be in [0, 1), e.g. 0.05")
    if c.planner.max_micro_batch_size < 1:
        out.append(f"planner.max_micro_batch_size={c.planner.max_micro_batch_size}: must be at least 1")
    ds = c.deepspeed
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_max_live_parameters", "sub_group_size"):
        if getattr(ds, key) < 1:
            out.append(f"deepspeed.{key}={getattr(ds, key)}: must be a positive number of elements")
    if c.ddp.bucket_cap_mb <= 0:
        out.append(f"ddp.bucket_cap_mb={c.ddp.bucket_cap_mb}: must be positive, e.g. 25")
    if c.hardware.memory_bytes <= 0:
        out.append(f"hardware.memory_bytes={c.hardware.memory_bytes}: must be positive")
    if c.model.trust_remote_code and "model.trust_remote_code=true" not in " ".join(sys.argv).lower():
        out.append("model.trust_remote_code: may only be enabled on the command line "
                   "(model.trust_remote_code=true), never from a config or recipe file")
    return out


def model_spec(config: LauncherConfig):
    """The model's numbers, checked against the workload (sequence length within its positions)."""
    from launcher.model import load_spec

    spec = load_spec(config.model)
    seq_max = spec.max_positions
    if seq_max is not None and config.training.seq_len > seq_max:
        raise ConfigError(f"training.seq_len={config.training.seq_len} is above {spec.name}'s maximum "
                          f"positions ({seq_max}); use training.seq_len<={seq_max}")
    return spec


def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from launcher import planner, report
    from launcher.hardware import cluster_from, local_gpu_names

    config = to_config(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    config.run_dir = str(run_dir)
    spec = model_spec(config)
    mode = config.mode.name
    if mode == "auto":
        mode = "run" if local_gpu_names() or config.hardware.device == "cpu" else "plan"
        if mode == "plan" and config.hardware.device != "cpu":
            print("note: no local GPU: planning only. To train for real on CPU processes, "
                  "add hardware=cpu (e.g. scripts/demo)", file=sys.stderr)
    cluster = cluster_from(config.hardware, config.gpus, config.nodes)
    plan = planner.plan(config, spec, cluster)
    plan_dict = report.plan_to_dict(plan, cluster.memory_bytes)
    (run_dir / "plan.json").write_text(json.dumps(plan_dict, indent=2) + "\n")
    if config.report.name == "json":
        print(json.dumps(plan_dict, indent=2))
    else:
        report.print_plan(plan, cluster.memory_bytes)
    if plan.chosen is None:
        print("No candidate fits; see the plan for what would.", file=sys.stderr)
        if mode in ("run", "measure"):
            sys.exit(1)
        return
    from launcher import launch

    job = launch.prepare(plan, config, spec, run_dir)
    quiet = config.report.name == "json"
    if not quiet:
        print(f"\nrun directory: {run_dir}\nlaunch command: {job.command_line}")
    if mode in ("run", "measure"):
        rc = launch.execute(job, quiet=quiet)
        if rc != 0:
            print(f"error: training exited with code {rc}; logs in {run_dir}", file=sys.stderr)
            sys.exit(rc)
        if not quiet:
            report.print_summary(run_dir)

"""mode=measure: run the chosen candidate for a few real steps and put the measurements next to
the estimate, per rank: peak memory (bytes, % error) and median step time (s, % error).

Two passes of the same worker `mode=run` starts (launcher/worker, through torchrun), each in
its own sub-directory of the run directory:
- memory/: `measure.memory_steps` steps with the allocation tracker on (CPU: peak live tensor
  bytes from launcher/worker/storage_tracker.py; CUDA: torch.cuda.max_memory_allocated /
  max_memory_reserved per phase, plus NVML used bytes when pynvml is installed).
- timing/: `measure.timing_steps` steps with the tracker off (it intercepts every op and would
  inflate the step time); the median `step_s` of rank 0 after `measure.warmup_steps` steps.
The result is printed and written to RUN_DIR/measure.json.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
from dataclasses import replace
from pathlib import Path

from launcher.config import LauncherConfig
from launcher.runspec import RunSpec
from launcher.errors import ConfigError
from launcher.launch import torchrun_argv, worker_python
from launcher.worker.metrics import error_percent

MIB = 2**20


def run_pass(job, config: LauncherConfig, name: str, *, steps: int, measure_memory: bool) -> Path:
    """Run the worker in RUN_DIR/<name> with this many steps; return that directory."""
    base = RunSpec.load(job.run_dir / "run.json")
    sub = job.run_dir / name
    sub.mkdir(exist_ok=True)
    spec = replace(base, run_dir=str(sub), max_steps=steps, measure_memory=measure_memory,
                   checkpoint_every=0, resume=False, log_every=max(1, steps))
    spec.save(sub / "run.json")
    argv = torchrun_argv(config, sub / "run.json", worker_python(spec.backend, spec.strategy))
    with open(sub / "train.log", "w") as log:
        rc = subprocess.run(argv, env={**os.environ, **job.env}, stdout=log, stderr=subprocess.STDOUT).returncode
    if not config.measure.keep_checkpoints:
        shutil.rmtree(sub / "checkpoints", ignore_errors=True)
    if rc != 0:
        tail = (sub / "train.log").read_text().strip().splitlines()[-5:]
        raise ConfigError(f"mode=measure: the {name} pass exited with code {rc}; log {sub / 'train.log'}: "
                          + " | ".join(tail))
    return sub


def median_step_s(metrics_path: Path, warmup_steps: int) -> tuple[float, list[float]]:
    """Median of rank 0's step_s after the warm-up steps, and all step times."""
    steps = [json.loads(line)["step_s"] for line in metrics_path.read_text().splitlines() if line.strip()]
    timed = steps[warmup_steps:] or steps
    return statistics.median(timed), steps


def memory_rows(summary: dict, estimate: dict) -> list[dict]:
    """Per rank: measured vs estimated peak allocated (and reserved / NVML on CUDA); the rank's own
    estimate when `estimate["per_rank_peak_allocated_bytes"]` has one (ZeRO 1-2), else the headline."""
    rows = []
    per_rank = estimate.get("per_rank_peak_allocated_bytes") or []
    for rank, meas in enumerate(summary["measured_peak_allocated_bytes"]):
        est_alloc = per_rank[rank] if rank < len(per_rank) else estimate.get("peak_allocated_bytes")
        breakdown = (summary.get("measured_peak_breakdown") or [None] * (rank + 1))[rank] or {}
        row = {"rank": rank, "measured_peak_bytes": meas, "estimated_peak_bytes": est_alloc,
               "error_percent": error_percent(est_alloc, meas),
               "measured_peak_phase": summary["measured_peak_phase"][rank],
               "measured_breakdown": breakdown}
        reserved = (summary.get("measured_peak_reserved_bytes") or [None] * (rank + 1))[rank]
        if reserved is not None:
            row.update(measured_reserved_bytes=reserved, estimated_reserved_bytes=estimate.get("peak_reserved_bytes"),
                       reserved_error_percent=error_percent(estimate.get("peak_reserved_bytes"), reserved))
        if "nvml_used" in breakdown:
            row.update(measured_device_total_bytes=breakdown["nvml_used"],
                       estimated_device_total_bytes=estimate.get("device_total_bytes"),
                       device_total_error_percent=error_percent(estimate.get("device_total_bytes"),
                                                                breakdown["nvml_used"]))
        rows.append(row)
    return rows


def measure(job, plan, config: LauncherConfig) -> dict:
    """Run both passes for the plan's chosen candidate; write and return measure.json's content."""
    c = plan.candidates[plan.chosen]
    m = config.measure
    mem_dir = run_pass(job, config, "memory", steps=max(2, m.memory_steps), measure_memory=True)
    summary = json.loads((mem_dir / "summary.json").read_text())
    estimate = dict(RunSpec.load(job.run_dir / "run.json").estimate,
                    per_rank_peak_allocated_bytes=list(c.memory.per_rank_peak_allocated_bytes))
    result = {
        "strategy": c.strategy.name, "micro_batch_size": c.micro_batch_size,
        "grad_accum_steps": c.grad_accum_steps, "world_size": job.world_size,
        "precision": config.training.precision.name, "seq_len": config.training.seq_len,
        "attn_implementation": config.training.attn_implementation.name,
        "gradient_checkpointing": config.training.gradient_checkpointing,
        "model": plan.model.get("name"), "hardware": plan.hardware,
        "estimated_peak_phase": c.memory.peak_phase,
        "memory": memory_rows(summary, estimate),
        "memory_steps": summary["steps"],
    }
    errs = [r["error_percent"] for r in result["memory"] if r["error_percent"] is not None]
    result["max_abs_memory_error_percent"] = max((abs(e) for e in errs), default=None)
    if m.timing_steps > 0:
        time_dir = run_pass(job, config, "timing", steps=m.timing_steps + m.warmup_steps, measure_memory=False)
        med, steps = median_step_s(time_dir / "metrics.jsonl", m.warmup_steps)
        result["time"] = {"measured_step_s": med, "estimated_step_s": c.speed.step_s,
                          "error_percent": error_percent(c.speed.step_s, med), "step_s": steps,
                          "warmup_steps": m.warmup_steps, "estimated_breakdown": dict(c.speed.breakdown)}
    (job.run_dir / "measure.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def format_result(result: dict) -> str:
    lines = [f"measured {result['strategy']} micro_batch_size={result['micro_batch_size']} on "
             f"{result['world_size']} x {result['hardware']} ({result['memory_steps']} steps with the memory tracker)",
             "rank  estimated MiB  measured MiB  error %  measured peak phase"]
    for r in result["memory"]:
        err = "-" if r["error_percent"] is None else f"{r['error_percent']:+.3f}"
        lines.append(f"{r['rank']:>4}  {r['estimated_peak_bytes'] / MIB:>13.3f}  {r['measured_peak_bytes'] / MIB:>12.3f}"
                     f"  {err:>7}  {r['measured_peak_phase']}")
        if "measured_reserved_bytes" in r:
            lines.append(f"      reserved: estimated {r['estimated_reserved_bytes'] / MIB:.1f} MiB, "
                         f"measured {r['measured_reserved_bytes'] / MIB:.1f} MiB")
    t = result.get("time")
    if t:
        lines.append(f"step time: estimated {t['estimated_step_s']:.4g} s, measured median {t['measured_step_s']:.4g} s "
                     f"(steps after {t['warmup_steps']} warm-up; tracker off): error {t['error_percent']:+.1f}%")
    return "\n".join(lines)

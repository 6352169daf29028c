"""Per-step framework overhead, measured: `mode=calibrate calibrate.frameworks=[ddp,zero2,...]`.

The speed model (launcher/speed.py, launcher/host_time.py) counts compute, op dispatch, memory
traffic, the optimizer, framework copies and collectives. What a framework's step costs beyond
that (DeepSpeed's engine and ZeRO bookkeeping per step, its per-parameter gradient hooks,
the worker's own loop) has no first-principles formula, so it is measured: for each strategy,
the calibration model (tiny-llama, `model.hf_config.num_hidden_layers` set to each of
`calibrate.framework_depths`) trains `calibrate.framework_timing_steps` steps through the real
worker (`mode=measure`, sequence 16, micro-batch 1, 32-true: the modelled terms are small, the
overhead dominates), and the measured median step time minus the modelled one is the residual.
Each (strategy, depth) is timed `calibrate.framework_rounds` times, round-robin over all of them
(every other round in reverse order), and the median over rounds is kept: single steps vary by
~10% on a quiet 2-core machine and load drifts over minutes, so one run per point leaves
differences of a millisecond between strategies that are noise.
A least-squares line through (parameter tensors, residual) over the depths gives
[seconds per step, seconds per parameter tensor per micro-batch] for the hardware profile's
`framework_overhead_s` (both clamped at 0). The runs use the profile being calibrated, without
any framework term, so the residual is exactly what the other terms leave out.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import yaml
from launcher.runspec import RunSpec
from launcher.errors import ConfigError
from launcher.launch import worker_python

CALIBRATION_MODEL = "tiny-llama"
SEQ_LEN, MICRO_BATCH, WARMUP_STEPS = 16, 1, 3
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def cell_argv(strategy: str, depth: int, hardware_file: Path, gpus: int, steps: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "launcher", f"model={CALIBRATION_MODEL}",
            f"model.hf_config.num_hidden_layers={depth}", f"hardware={hardware_file}", f"gpus={gpus}",
            f"strategy={strategy}", f"training.seq_len={SEQ_LEN}", f"training.micro_batch_size={MICRO_BATCH}",
            "training.precision=32-true", "mode=measure", "measure.memory_steps=2",
            f"measure.timing_steps={steps}", f"measure.warmup_steps={WARMUP_STEPS}", "report=json",
            f"hydra.run.dir={run_dir}"]


def residual(measure: dict, measured_step_s: float | None = None) -> tuple[float, float]:
    """(parameter tensors, measured - modelled step seconds) of one calibration run; `measured_step_s`
    replaces the run's own median (the median over rounds)."""
    t = measure["time"]
    measured = t["measured_step_s"] if measured_step_s is None else measured_step_s
    return t["estimated_breakdown"]["num_param_tensors"], measured - t["estimated_step_s"]


def retime_s(run_dir: Path, steps: int, warmup: int, num_procs: int, env: dict | None = None) -> float:
    """Median step time of one more timing run of a measured run directory: torchrun on a copy of
    its timing/run.json in RUN_DIR/retime (steps after `warmup` warm-up steps). One retry: a
    transient failure (the rendezvous port taken) is not a result."""
    spec = RunSpec.load(run_dir / "timing" / "run.json")
    out = run_dir / "retime"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    replace(spec, run_dir=str(out), max_steps=steps + warmup, log_every=steps + warmup).save(out / "run.json")
    argv = [worker_python(spec.backend, spec.strategy), "-m", "torch.distributed.run", f"--nproc-per-node={num_procs}", "--standalone",
            "-m", "launcher.worker", str(out / "run.json")]
    env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or num_procs) // num_procs))}
    for _ in range(2):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True)
        if proc.returncode == 0:
            break
        (out / "metrics.jsonl").unlink(missing_ok=True)
    else:
        raise RuntimeError(f"re-timing {run_dir} failed: {proc.stderr.strip().splitlines()[-3:]}")
    step_s = [json.loads(line)["step_s"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return statistics.median(step_s[warmup:])


def fit(points: list[tuple[float, float]]) -> list[float]:
    """Least-squares [intercept, slope] of residual on parameter tensors, both >= 0 (a negative
    slope or intercept is measurement noise: the other coefficient then takes the mean)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var > 0 else 0.0
    intercept = mean_y - slope * mean_x
    if slope < 0:
        return [max(0.0, mean_y), 0.0]
    if intercept < 0:
        return [0.0, max(0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points))]
    return [intercept, slope]


def measure_frameworks(strategies: list[str], depths: list[int], steps: int, profile_file: Path, gpus: int,
                       out_dir: Path, rounds: int = 1) -> tuple[dict, list[dict]]:
    """({strategy: [per step s, per tensor s]}, raw points); each run in out_dir/<strategy>-d<depth>.
    Round 1 runs `mode=measure` for every (strategy, depth); rounds 2.. re-time them round-robin."""
    points = [(s, d) for s in strategies for d in depths]
    measures, times = {}, {p: [] for p in points}
    for p in points:
        measures[p] = _measure_point(*p, profile_file, gpus, steps, out_dir)
        times[p].append(measures[p]["time"]["measured_step_s"])
    for k in range(1, rounds):
        for p in (points if k % 2 == 0 else points[::-1]):
            times[p].append(retime_s(out_dir / f"{p[0]}-d{p[1]}", steps, WARMUP_STEPS, gpus, OFFLINE_ENV))
    overhead, raw = {}, []
    for strategy in strategies:
        fit_points = []
        for depth in depths:
            measure, measured = measures[(strategy, depth)], statistics.median(times[(strategy, depth)])
            x, y = residual(measure, measured)
            fit_points.append((x, y))
            raw.append({"strategy": strategy, "depth": depth, "num_param_tensors": x, "residual_s": y,
                        "measured_step_s": measured, "measured_rounds_s": times[(strategy, depth)],
                        "estimated_step_s": measure["time"]["estimated_step_s"]})
            print(f"framework {strategy} depth {depth}: {x:.0f} parameter tensors, measured {measured:.4f} s "
                  f"(median of {len(times[(strategy, depth)])} rounds), modelled "
                  f"{measure['time']['estimated_step_s']:.4f} s", flush=True)
        overhead[strategy] = fit(fit_points)
    return overhead, raw


def _measure_point(strategy: str, depth: int, profile_file: Path, gpus: int, steps: int, out_dir: Path) -> dict:
    """measure.json of one `mode=measure` run of the calibration model."""
    run_dir = out_dir / f"{strategy}-d{depth}"
    proc = subprocess.run(cell_argv(strategy, depth, profile_file, gpus, steps, run_dir), capture_output=True,
                          text=True, env={**os.environ, **OFFLINE_ENV})
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"calibrate.frameworks: strategy={strategy} did not train here ({last}); "
                          f"remove it from calibrate.frameworks")
    return json.loads((run_dir / "measure.json").read_text())


def add_to_profile(path: Path, overhead: dict) -> None:
    """Write `framework_overhead_s` into the calibrated profile, keeping its header comments."""
    text = path.read_text()
    header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    prof = yaml.safe_load(text)
    prof["framework_overhead_s"] = overhead
    path.write_text(header + yaml.safe_dump(prof, sort_keys=False))

"""Per-step framework overhead, measured: `mode=calibrate calibrate.frameworks=[ddp,zero2,...]`.

The speed model (launcher/speed.py, launcher/host_time.py) counts compute, op dispatch, memory
traffic, the optimizer, framework copies and collectives. What a framework's step costs beyond
that (DeepSpeed's engine and ZeRO bookkeeping per step, its per-parameter gradient hooks,
the worker's own loop) has no first-principles formula, so it is measured: for each strategy,
the calibration model (tiny-llama, `model.hf_config.num_hidden_layers` set to each of
`calibrate.framework_depths`) trains `calibrate.framework_timing_steps` steps through the real
worker (`mode=measure`, sequence 16, micro-batch 1, 32-true: the modelled terms are small, the
overhead dominates), and the measured median step time minus the modelled one is the residual.
A least-squares line through (parameter tensors, residual) over the depths gives
[seconds per step, seconds per parameter tensor per micro-batch] for the hardware profile's
`framework_overhead_s` (both clamped at 0). The runs use the profile being calibrated, without
any framework term, so the residual is exactly what the other terms leave out.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

CALIBRATION_MODEL = "tiny-llama"
SEQ_LEN, MICRO_BATCH, WARMUP_STEPS = 16, 1, 3


def cell_argv(strategy: str, depth: int, hardware_file: Path, gpus: int, steps: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "launcher", f"model={CALIBRATION_MODEL}",
            f"model.hf_config.num_hidden_layers={depth}", f"hardware={hardware_file}", f"gpus={gpus}",
            f"strategy={strategy}", f"training.seq_len={SEQ_LEN}", f"training.micro_batch_size={MICRO_BATCH}",
            "training.precision=32-true", "mode=measure", "measure.memory_steps=2",
            f"measure.timing_steps={steps}", f"measure.warmup_steps={WARMUP_STEPS}", "report=json",
            f"hydra.run.dir={run_dir}"]


def residual(measure: dict) -> tuple[float, float]:
    """(parameter tensors, measured - modelled step seconds) of one calibration run."""
    t = measure["time"]
    return t["estimated_breakdown"]["num_param_tensors"], t["measured_step_s"] - t["estimated_step_s"]


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
                       out_dir: Path) -> tuple[dict, list[dict]]:
    """({strategy: [per step s, per tensor s]}, raw points); each run in out_dir/<strategy>-d<depth>."""
    overhead, raw = {}, []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for strategy in strategies:
        points = []
        for depth in depths:
            run_dir = out_dir / f"{strategy}-d{depth}"
            argv = cell_argv(strategy, depth, profile_file, gpus, steps, run_dir)
            proc = subprocess.run(argv, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                from launcher.errors import ConfigError

                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise ConfigError(f"calibrate.frameworks: strategy={strategy} did not train here ({last}); "
                                  f"remove it from calibrate.frameworks")
            measure = json.loads((run_dir / "measure.json").read_text())
            x, y = residual(measure)
            points.append((x, y))
            raw.append({"strategy": strategy, "depth": depth, "num_param_tensors": x, "residual_s": y,
                        "measured_step_s": measure["time"]["measured_step_s"],
                        "estimated_step_s": measure["time"]["estimated_step_s"]})
            print(f"framework {strategy} depth {depth}: {x:.0f} parameter tensors, measured "
                  f"{measure['time']['measured_step_s']:.4f} s, modelled {measure['time']['estimated_step_s']:.4f} s",
                  flush=True)
        overhead[strategy] = fit(points)
    return overhead, raw


def add_to_profile(path: Path, overhead: dict) -> None:
    """Write `framework_overhead_s` into the calibrated profile, keeping its header comments."""
    text = path.read_text()
    header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    prof = yaml.safe_load(text)
    prof["framework_overhead_s"] = overhead
    path.write_text(header + yaml.safe_dump(prof, sort_keys=False))

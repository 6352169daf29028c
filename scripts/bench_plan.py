#!/usr/bin/env python
"""Planning time per model size: `python -m launcher model=M gpus=G mode=plan` wall time, with a
cold trace cache (first run: the step is traced under fake tensors) and a warm one (second run:
traces read from the cache), for models from tiny to 70B.

    .venv/bin/python scripts/bench_plan.py                    # default models, 8 x a100-80g
    .venv/bin/python scripts/bench_plan.py --models bloom-1b1,llama-2-7b --gpus 4

Prints a markdown table (model, parameters, candidates, cold s, warm s). It is a benchmark, not a
test: the numbers depend on the machine and its load (reported with the table).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ["gpt2", "bloom-1b1", "llama-3.2-3b", "llama-2-7b", "llama-2-13b", "llama-2-70b"]


def plan_once(model: str, gpus: int, hardware: str, cache_dir: Path, out_dir: Path, extra: list[str]) -> tuple[float, dict]:
    argv = [sys.executable, "-m", "launcher", f"model={model}", f"gpus={gpus}", f"hardware={hardware}", "mode=plan",
            "report=json", f"cache_dir={cache_dir}", f"hydra.run.dir={out_dir}", *extra]
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{model}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    return wall_s, json.loads((out_dir / "plan.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--hardware", default="a100-80g")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. training.seq_len=2048")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for i, model in enumerate(args.models.split(",")):
            cold_s, plan = plan_once(model, args.gpus, args.hardware, cache, Path(tmp) / f"{i}-cold", args.overrides)
            warm_s, _ = plan_once(model, args.gpus, args.hardware, cache, Path(tmp) / f"{i}-warm", args.overrides)
            rows.append((model, plan["model"].get("num_params") or 0, len(plan["candidates"]), cold_s, warm_s))
            print(f"{model}: cold {cold_s:.1f} s, warm {warm_s:.1f} s", file=sys.stderr, flush=True)
    print(f"planning time on {args.gpus} x {args.hardware} (load average {os.getloadavg()[0]:.1f}, "
          f"{os.cpu_count()} cores; includes Python start-up and imports)\n")
    print("| model | parameters | candidates | cold cache s | warm cache s |\n|---|---:|---:|---:|---:|")
    for model, n, c, cold, warm in rows:
        print(f"| {model} | {n / 1e9:.2f}B | {c} | {cold:.1f} | {warm:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

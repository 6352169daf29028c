"""The full-depth step rebuilt from two shallow traces, checked against traces at the real depth.

Every plan traces the model at 2 and 3 decoder layers and rebuilds the step at the model's depth
(launcher/memory/replay.py `full_depth_items`, `full_depth_peaks`). This script plans each training
row of scripts/validate_gpu_rows.yaml twice: as the planner does, and from traces at the real depth
(N-1 and N layers, where the rebuild is the identity), and prints peak allocated, peak reserved and
what the step needs for both, with the relative difference. A difference is an error of the
rebuild, not of the memory model: both sides use the same layouts, allocator and runtime terms.

    scripts/depth_check                     # every training row of reliability A and B
    scripts/depth_check --rows TT-06,LIGER-03

Tracing at the real depth costs seconds to a minute per row (a 72B model has 80 layers); the
traces are cached under --cache-dir between runs.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import validate_gpu as V  # noqa: E402
from launcher import candidate_memo, planner, trace  # noqa: E402
from launcher.steptrace import TraceSet  # noqa: E402

VIEWS = ("allocated", "reserved", "needed")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help="comma-separated check ids (default: the training rows of reliability A, B)")
    ap.add_argument("--cache-dir", default="/tmp/launcher-depth-check", help="traces at the real depth")
    a = ap.parse_args(argv)
    specs = yaml.safe_load(V.ROWS.read_text())["rows"]
    csv_rows = {r["id"]: r for r in csv.DictReader(V.CSV.open())}
    keys = a.rows.split(",") if a.rows else [
        k for k, s in specs.items() if s.get("mode", "train") == "train" and s.get("view") != "allocated_at_init"
        and csv_rows[s.get("row", k)]["reliability"] in "AB"]
    shipped = trace.trace_set

    def real_depth(key, num_layers=None, cache_dir=None, scale_batch=True):
        n = num_layers or trace.config_num_layers(key.hf_config_json)
        return TraceSet(*(trace._trace_at(key, d, a.cache_dir, scale_batch) for d in (n - 1, n)), n)

    # every candidate estimated afresh on both sides (the memo keys do not hold the trace depths)
    candidate_memo.CandidateMemo.get = lambda self, *args: None
    candidate_memo.CandidateMemo.put = lambda self, *args: None
    print("| row | " + " | ".join(f"{v} GiB (rebuilt / real depth, diff %)" for v in VIEWS) + " | s |")
    print("|---|" + "---:|" * (len(VIEWS) + 1))
    worst = 0.0
    for key in keys:
        spec = specs[key]
        if spec.get("mode", "train") != "train":
            continue
        t0 = time.perf_counter()
        out = []
        for fn in (shipped, real_depth):
            planner.trace.trace_set = fn
            try:
                views, _, _ = V.plan_row(spec["args"], "train", spec.get("cuda_alloc_conf"), spec.get("part"))
            finally:
                planner.trace.trace_set = shipped
            out.append(views)
        cells = []
        for v in VIEWS:
            x, y = out[0][v], out[1][v]
            diff = 100.0 * (x - y) / y
            worst = max(worst, abs(diff))
            cells.append(f"{x / 2**30:.2f} / {y / 2**30:.2f} ({diff:+.1f})")
        print(f"| {key} | " + " | ".join(cells) + f" | {time.perf_counter() - t0:.0f} |", flush=True)
    print(f"\nlargest difference: {worst:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Plan every published GPU measurement the launcher can express and compare the matching view.

The measurements are docs/validation/gpu_measurements.csv (sources in its README); how each row is
planned is scripts/validate_gpu_rows.yaml. For every expressed row this plans the same
configuration (the candidate of the row's strategy), reads the view the row reports (peak
allocated, peak reserved or the device total nvidia-smi shows) and prints the signed error;
capacity rows (a configuration fitted / ran out of memory on a GPU) are checked as fit/OOM
agreement. The table is written into docs/accuracy.md between the GPU-validation markers.

Usage: scripts/validate_gpu [--rows ID,ID] [--no-write]
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "docs" / "validation" / "gpu_measurements.csv"
ROWS = ROOT / "scripts" / "validate_gpu_rows.yaml"
ACCURACY = ROOT / "docs" / "accuracy.md"
ERRORS = ROOT / "launcher" / "data" / "gpu_errors.json"
BEGIN, END = "<!-- gpu-validation:begin -->", "<!-- gpu-validation:end -->"
UNIT_BYTES = {"GiB": 2**30, "GB": 10**9, "MiB": 2**20, "MB": 10**6, "1000MiB": 1000 * 2**20}
VIEWS = ("allocated", "reserved", "device_total", "unstated", "allocated_at_init")
TARGET_RELIABILITY = ("A", "B")


@dataclass
class Result:
    key: str
    row: dict
    spec: dict
    estimate_bytes: float | None = None
    published_bytes: float | None = None
    capacity_ok: bool | None = None
    step_error: float | None = None
    detail: str = ""
    error: str = ""
    notes: list = field(default_factory=list)

    @property
    def signed_error(self) -> float | None:
        if self.estimate_bytes is None or not self.published_bytes:
            return None
        return 100.0 * (self.estimate_bytes - self.published_bytes) / self.published_bytes


def published_bytes(row: dict, spec: dict) -> float:
    """The row's value in bytes per GPU: 'a + b' (per-GPU values) -> the larger (the worst rank is
    estimated), or the value of GPU `part` (a device map, estimated per GPU); scope total -> divided
    by the GPU count; scope sum -> the per-GPU values added (the parts of one model split over GPUs,
    planned on one)."""
    numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", row["memory_value"])]
    if "part" in spec:
        return numbers[spec["part"]] * UNIT_BYTES[spec["unit"]]
    if spec.get("scope") == "sum":
        return sum(numbers) * UNIT_BYTES[spec["unit"]]
    value = max(numbers) if "+" in row["memory_value"] else numbers[0]
    if spec.get("scope") == "total":
        value /= int(row["gpu_count"])
    return value * UNIT_BYTES[spec["unit"]]


def plan_row(args: list[str], mode: str, cuda_alloc_conf: str | None = None, part: int | None = None):
    """(estimate views, candidate or serving result, cluster memory) for one row's overrides;
    `cuda_alloc_conf`: the PYTORCH_CUDA_ALLOC_CONF the row's run had; `part`: the GPU of a serving
    device map whose views are wanted (else the worst GPU)."""
    from launcher.app import model_spec
    from launcher.cli import compose

    config = compose([*args, "mode=plan"])
    spec = model_spec(config)
    if mode == "infer":
        from launcher.infer_plan import infer_plan

        result = infer_plan(config, spec)
        r = result["per_gpu"] if part is None else result["devices"][part]
        views = {"allocated": r["peak_allocated_bytes"], "device_total": r["device_total_bytes"],
                 "unstated": r["peak_allocated_bytes"],  # a serving plan has no reserved view
                 "allocated_at_init": r["weight_bytes"]}  # loaded, before generate
        return views, None, config.hardware.memory_bytes
    from launcher import planner
    from launcher.hardware import cluster_from

    cluster = cluster_from(config.hardware, config.gpus, config.nodes, cuda_alloc_conf)
    plan = planner.plan(config, spec, cluster)
    cand = plan.candidates[0]
    m = cand.memory
    views = {"allocated": m.peak_allocated_bytes, "reserved": m.peak_reserved_bytes,
             "device_total": m.device_total_bytes, "needed": m.oom_bytes}
    views["unstated"] = views["reserved"]
    # after the model is built, before any step: its parameters and buffers (the breakdown's terms
    # for a strategy that keeps every parameter whole on the device: single, ddp)
    views["allocated_at_init"] = m.breakdown["parameters"] + m.breakdown["buffers"]
    return views, cand, cluster.memory_bytes


def evaluate(key: str, spec: dict, row: dict) -> Result:
    res = Result(key, row, spec)
    try:
        views, cand, capacity = plan_row(spec["args"], spec.get("mode", "train"), spec.get("cuda_alloc_conf"),
                                         spec.get("part"))
    except Exception as err:  # noqa: BLE001 - a row that cannot be planned is reported, not fatal
        res.error = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        return res
    if "capacity" in spec:  # fit/OOM as the planner decides it: the memory the step needs
        total = views.get("needed", views["device_total"])
        res.estimate_bytes = total
        res.capacity_ok = (total <= capacity) if spec["capacity"] == "fits" else (total > capacity)
        res.detail = f"{spec['capacity']} on {capacity / 2**30:.2f} GiB"
        return res
    res.estimate_bytes = views[spec["view"]]
    res.published_bytes = published_bytes(row, spec)
    thr = spec.get("throughput") or {}
    if cand is not None and thr:
        if "tokens_per_s" in thr:
            res.step_error = 100.0 * (cand.speed.tokens_per_s - thr["tokens_per_s"]) / thr["tokens_per_s"]
            res.step_error = -res.step_error  # as a step-time error: more tokens/s = shorter step
        else:
            res.step_error = 100.0 * (cand.speed.step_s - thr["step_s"]) / thr["step_s"]
    return res


def summarize(results: list[Result]) -> list[str]:
    lines = ["| view | rows (A/B) | median abs error % | worst underestimate % | rows (all) | median abs error % (all) |",
             "|---|---:|---:|---:|---:|---:|"]
    for view in VIEWS:
        rs = [r for r in results if r.spec.get("view") == view and r.signed_error is not None]
        ab = [r.signed_error for r in rs if r.row["reliability"] in TARGET_RELIABILITY]
        alls = [r.signed_error for r in rs]
        if not alls:
            continue
        med = lambda xs: f"{statistics.median(abs(x) for x in xs):.1f}" if xs else "-"  # noqa: E731
        worst = f"{min(min(ab), 0.0):+.1f}" if ab else "-"
        lines.append(f"| {view} | {len(ab)} | {med(ab)} | {worst} | {len(alls)} | {med(alls)} |")
    caps = [r for r in results if r.capacity_ok is not None]
    if caps:
        agree = sum(r.capacity_ok for r in caps)
        lines.append(f"\nCapacity rows: {agree} of {len(caps)} agree (fit/OOM).")
    steps = [r.step_error for r in results if r.step_error is not None]
    if steps:
        lines.append(f"Step time (rows that give a throughput): {len(steps)} rows, median |error| "
                     f"{statistics.median(abs(s) for s in steps):.0f}%, range {min(steps):+.0f}% to {max(steps):+.0f}%.")
    return lines


def table(results: list[Result], waits: dict, total_rows: int) -> str:
    expressed = {r.row["id"] for r in results if not r.error}
    out = [f"Rows expressed: **{len(expressed)} of {total_rows}** published rows "
           f"({len(results)} checks). Generated by `scripts/validate_gpu` on {time.strftime('%Y-%m-%d')}.",
           "", *summarize(results), "",
           "| check | rel. | model / setup | view | published GiB | estimate GiB | error % | step-time error % | assumptions |",
           "|---|---|---|---|---:|---:|---:|---:|---|"]
    for r in results:
        setup = f"{r.row['model_hf_id'].split('/')[-1]} {r.row['method'][:28]}, {r.row['gpu_count']}x {r.row['gpu_type'][:16]}"
        if r.error:
            out.append(f"| {r.key} | {r.row['reliability']} | {setup} | - | - | - | not planned: {r.error} | - | |")
            continue
        est = f"{r.estimate_bytes / 2**30:.2f}"
        if r.capacity_ok is not None:
            out.append(f"| {r.key} | {r.row['reliability']} | {setup} | capacity | {r.detail} | {est} | "
                       f"{'agrees' if r.capacity_ok else 'DISAGREES'} | - | {r.spec.get('assume', '')} |")
            continue
        step = f"{r.step_error:+.0f}" if r.step_error is not None else "-"
        out.append(f"| {r.key} | {r.row['reliability']} | {setup} | {r.spec['view']} | "
                   f"{r.published_bytes / 2**30:.2f} | {est} | {r.signed_error:+.1f} | {step} | {r.spec.get('assume', '')} |")
    out += ["", "Rows not expressible yet, by the feature they wait for:", ""]
    out += [f"- {feature} ({len(ids)}): {', '.join(ids)}" for feature, ids in waits.items()]
    return "\n".join(out)


def write_errors(results: list[Result]) -> None:
    """The signed errors of the reliability A/B rows, for the planner's margin (launcher/margin.py);
    rows measured after model init are left out: the margin covers a step's peak."""
    rows = [{"id": r.key, "view": r.spec["view"], "error_percent": round(r.signed_error, 2)}
            for r in results if r.signed_error is not None and r.row["reliability"] in TARGET_RELIABILITY
            and r.spec["view"] != "allocated_at_init"]
    ERRORS.write_text(json.dumps({"generated": time.strftime("%Y-%m-%d"), "source": "scripts/validate_gpu",
                                  "rows": rows}, indent=1) + "\n")


def write_accuracy(text: str) -> None:
    doc = ACCURACY.read_text() if ACCURACY.exists() else ""
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in doc:
        doc = doc[:doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
    else:
        doc = doc.rstrip() + "\n\n## Published GPU measurements\n\n" + block + "\n"
    ACCURACY.write_text(doc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help="comma-separated check ids (default: all)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/accuracy.md")
    a = ap.parse_args(argv)
    csv_rows = {r["id"]: r for r in csv.DictReader(CSV.open())}
    mapping = yaml.safe_load(ROWS.read_text())
    specs = mapping["rows"]
    listed = {specs[k].get("row", k) for k in specs} | {i for ids in mapping["waits_for"].values() for i in ids}
    missing = sorted(set(csv_rows) - listed)
    unknown = sorted(listed - set(csv_rows))
    if missing or unknown:
        print(f"error: rows not accounted for in {ROWS.name}: {missing}; unknown ids: {unknown}", file=sys.stderr)
        return 2
    keys = a.rows.split(",") if a.rows else list(specs)
    results = []
    for key in keys:
        t0 = time.perf_counter()
        r = evaluate(key, specs[key], csv_rows[specs[key].get("row", key)])
        results.append(r)
        err = r.error or (f"{r.signed_error:+.1f}%" if r.signed_error is not None else
                          ("agrees" if r.capacity_ok else "DISAGREES"))
        print(f"{key:22s} {err:>10s}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    text = table(results, mapping["waits_for"], len(csv_rows))
    print()
    print("\n".join(summarize(results)))
    if not a.no_write and not a.rows:
        write_accuracy(text)
        write_errors(results)
        print(f"\nwritten: {ACCURACY.relative_to(ROOT)}, {ERRORS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What rank 0 writes: RUN_DIR/metrics.jsonl (one line per optimizer step), a live line on
stdout, and RUN_DIR/summary.json with measured peak memory next to the planner's estimate."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

MIB = 2 ** 20


def human_rate(tokens_per_s: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.1f}{unit}"
    return f"{tokens_per_s:.0f}"


def live_line(record: dict, max_steps: int) -> str:
    line = (f"step {record['step']}/{max_steps}  loss {record['loss']:.3f}  "
            f"{human_rate(record['tokens_per_s'])} tok/s")
    peaks = record.get("peak_allocated_bytes")
    if peaks:
        line += f"  mem {max(peaks) / MIB:.1f} MiB"
    return line


def append_metrics(run_dir: str | Path, record: dict) -> None:
    with open(Path(run_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def estimated_per_rank(estimate: dict, world_size: int) -> Optional[list[int]]:
    """Each rank's estimated peak: `estimate["per_rank_peak_allocated_bytes"]` when the plan
    estimated ranks apart (ZeRO 1-2 gradient partitions), else `peak_allocated_bytes` (one number
    for every rank, or a list per rank)."""
    per_rank = (estimate or {}).get("per_rank_peak_allocated_bytes") or []
    if len(per_rank) == world_size:
        return [int(v) for v in per_rank]
    value = estimate.get("peak_allocated_bytes") if estimate else None
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)] * world_size


def error_percent(estimated: Optional[float], measured: Optional[float]) -> Optional[float]:
    """(estimated - measured) / measured, in percent; positive means over-estimated; None when
    either is missing."""
    return None if not measured or estimated is None else 100.0 * (estimated - measured) / measured


def build_summary(records: list[dict], measured_peaks: list[Optional[dict]], estimate: dict,
                  world_size: int) -> dict:
    losses = [r["loss"] for r in records]
    rates = [r["tokens_per_s"] for r in records[1:]] or [r["tokens_per_s"] for r in records]
    measured = [p["allocated_bytes"] if p else None for p in measured_peaks]
    estimated = estimated_per_rank(estimate, world_size)
    errors = None
    if estimated and all(m is not None for m in measured):
        errors = [error_percent(e, m) for e, m in zip(estimated, measured)]
    return {
        "steps": len(records),
        "first_step": records[0]["step"] if records else None,
        "last_step": records[-1]["step"] if records else None,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "mean_tokens_per_s": sum(rates) / len(rates) if rates else None,
        "measured_peak_allocated_bytes": measured,
        "measured_peak_phase": [p["phase"] if p else None for p in measured_peaks],
        "measured_peak_breakdown": [p["breakdown"] if p else None for p in measured_peaks],
        "measured_peak_reserved_bytes": [p.get("reserved_bytes") if p else None for p in measured_peaks],
        "estimate": estimate,
        "estimated_peak_allocated_bytes": estimated,
        "error_percent": errors,
    }


def summary_table(summary: dict) -> str:
    rows = ["rank  estimated MiB  measured MiB  error %  peak phase"]
    measured = summary["measured_peak_allocated_bytes"]
    estimated = summary["estimated_peak_allocated_bytes"] or [None] * len(measured)
    errors = summary["error_percent"] or [None] * len(measured)
    for rank, (est, meas, err) in enumerate(zip(estimated, measured, errors)):
        fmt = lambda b: "-" if b is None else f"{b / MIB:.2f}"  # noqa: E731
        err_text = "-" if err is None else f"{err:+.1f}"
        rows.append(f"{rank:>4}  {fmt(est):>13}  {fmt(meas):>12}  {err_text:>7}  "
                    f"{summary['measured_peak_phase'][rank] or '-'}")
    return "\n".join(rows)


def summary_path(run_dir: str | Path) -> Path:
    """summary.json, or summary-2.json, -3, ... when a resumed run finishes again: a finished
    run's summary is never overwritten."""
    path, num = Path(run_dir) / "summary.json", 1
    while path.exists():
        num += 1
        path = Path(run_dir) / f"summary-{num}.json"
    return path


def write_summary(run_dir: str | Path, summary: dict) -> Path:
    path = summary_path(run_dir)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path

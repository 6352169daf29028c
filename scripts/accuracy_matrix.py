#!/usr/bin/env python
"""The accuracy matrix: `python -m launcher ... mode=measure` on 2 CPU processes over strategies,
precisions, gradient checkpointing, attention implementations, two model families and two sizes;
writes a markdown table and a CSV of per-rank peak-memory error and step-time error, and checks
the speed model's ranking of strategies (Kendall tau) and the plan's choice against the measured
fastest.

    .venv/bin/python scripts/accuracy_matrix.py --quick          # a subset, ~10 minutes
    .venv/bin/python scripts/accuracy_matrix.py                  # the full matrix
    .venv/bin/python scripts/accuracy_matrix.py --reestimate     # re-plan stored measurements

Measurements are appended to OUT/results.jsonl (a cell already there is not re-run, so an
interrupted run resumes); `--reestimate` recomputes only the estimates (memory and step time)
with the current code and hardware profile, in-process.
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from launcher.calibrate_frameworks import retime_s  # noqa: E402

STRATEGIES = ["ddp", "zero0", "zero1", "zero2", "zero3"]
PRECISIONS = ["32-true", "bf16-mixed", "bf16-true"]
# (size label, models, seq_len, micro_batch_size): activations dominate the tiny models at seq
# 256 x micro 4; model states (32k-vocabulary embeddings and head) dominate the small ones.
SIZES = {"tiny": (["tiny-llama", "tiny-bloom"], 256, 4), "small": (["small-llama", "small-bloom"], 128, 2)}
SMALL_BUCKETS = ["deepspeed.reduce_bucket_size=200000", "deepspeed.allgather_bucket_size=200000",
                 "deepspeed.stage3_prefetch_bucket_size=200000"]
NO_SDPA = {"tiny-bloom", "small-bloom"}  # transformers' BLOOM has no sdpa attention


COLOSSALAI_ON_CPU = {"cai_ddp", "cai_zero1", "cai_zero2", "cai_tp"}  # cai_tp in .venv-colossalai (README "ColossalAI")


def cell(model, size, strategy, precision, ckpt=False, attn="sdpa", buckets="small", peft="none") -> dict:
    """`ckpt`: False, True (torch's non-reentrant checkpoint, the launcher's default) or
    "reentrant" (training.checkpoint_policy=reentrant)."""
    _, seq, micro = SIZES[size]
    attn = "eager" if model in NO_SDPA else attn
    return {"model": model, "size": size, "strategy": strategy, "precision": precision,
            "gradient_checkpointing": bool(ckpt), "checkpoint_policy": "reentrant" if ckpt == "reentrant" else "full",
            "attn": attn, "buckets": buckets, "seq_len": seq, "micro_batch_size": micro, "peft": peft}


def ckpt_label(c: dict) -> str:
    """The ckpt column: off, on (non-reentrant) or reentrant."""
    if not c["gradient_checkpointing"]:
        return "off"
    return "reentrant" if c.get("checkpoint_policy") == "reentrant" else "on"


def supported(c: dict) -> bool:
    """bf16-true under DeepSpeed needs ZeRO 1-3 (launcher/backends/deepspeed/rules.py)."""
    return not (c["precision"] == "bf16-true" and c["strategy"] == "zero0")


def full_cells(strategies: list[str]) -> list[dict]:
    """Every strategy x precision on one model per size and family (tiny-llama, small-bloom);
    every strategy at 32-true and bf16-mixed on the other two; gradient checkpointing (both tiny
    models; tiny-llama also with the reentrant checkpoint) and eager attention (tiny-llama) on
    DDP, ZeRO-2 and ZeRO-3 at fp32; LoRA on DDP and ZeRO-2, and with checkpointing on DDP
    (reentrant) and ZeRO-3 (both checkpoints); one default-bucket row. Ordered so that an
    interrupted run covers every axis early with whole strategy groups (the script resumes where
    it stopped)."""
    variants = [s for s in ("ddp", "zero2", "zero3") if s in strategies]
    first = [cell("tiny-llama", "tiny", s, p) for p in PRECISIONS for s in strategies]
    first += [cell("tiny-llama", "tiny", s, "32-true", ckpt=True) for s in variants]
    first += [cell(m, "tiny", s, "32-true", peft="lora") for m in ("tiny-llama",) for s in ("ddp", "zero2")]
    first += [cell("small-llama", "small", "ddp", "32-true", peft="lora")]
    first += [cell("tiny-llama", "tiny", s, "32-true", ckpt="reentrant") for s in variants]
    first += [cell("tiny-llama", "tiny", "ddp", "32-true", ckpt="reentrant", peft="lora")]
    first += [cell("small-llama", "small", "zero3", "32-true", ckpt=k, peft="lora")
              for k in (True, "reentrant") if "zero3" in strategies]
    first += [cell("tiny-llama", "tiny", s, "32-true") for s in sorted(COLOSSALAI_ON_CPU)]
    first += [cell("tiny-llama", "tiny", "cai_tp", "bf16-mixed"), cell("small-llama", "small", "cai_tp", "32-true")]
    first += [cell("tiny-bloom", "tiny", "cai_tp", "32-true")]
    first += [cell(m, "tiny", "cai_pp", "32-true") for m in SIZES["tiny"][0]]  # in .venv-colossalai
    first += [cell(m, "small", s, "32-true") for m in SIZES["small"][0] for s in strategies]
    first += [cell("tiny-bloom", "tiny", s, "32-true") for s in strategies]
    first += [cell("tiny-bloom", "tiny", s, "32-true", ckpt=True) for s in variants]
    first += [cell("tiny-llama", "tiny", s, "32-true", attn="eager") for s in variants]
    first += [cell("tiny-llama", "tiny", "zero2", "32-true", buckets="default")] if "zero2" in strategies else []
    rest = [cell(m, size, s, "bf16-mixed") for m, size in (("small-llama", "small"), ("small-bloom", "small"),
                                                           ("tiny-bloom", "tiny")) for s in strategies]
    rest += [cell("small-bloom", "small", s, "bf16-true") for s in strategies]
    return [c for c in first + rest if supported(c)]


def quick_cells(strategies: list[str]) -> list[dict]:
    """Every strategy once (tiny Llama fp32), plus bf16-mixed / bf16-true, checkpointing, BLOOM
    and a small model on a few strategies."""
    out = [cell("tiny-llama", "tiny", s, "32-true") for s in strategies]
    out += [cell("tiny-llama", "tiny", "zero2", "bf16-mixed"), cell("tiny-llama", "tiny", "zero3", "bf16-true"),
            cell("tiny-llama", "tiny", "ddp", "32-true", ckpt=True), cell("tiny-bloom", "tiny", "zero1", "32-true"),
            cell("small-llama", "small", "zero3", "32-true")]
    return [c for c in out if supported(c) and c["strategy"] in strategies]


def cell_id(c: dict) -> str:
    peft = [] if c.get("peft", "none") == "none" else [c["peft"]]
    ckpt = {"off": "nockpt", "on": "ckpt", "reentrant": "reentrant"}[ckpt_label(c)]
    return "_".join([c["model"], c["strategy"], c["precision"], ckpt,
                     c["attn"], f"{c['buckets']}buckets", *peft])


def overrides(c: dict, hardware: str) -> list[str]:
    out = [f"model={c['model']}", f"hardware={hardware}", "gpus=2", f"strategy={c['strategy']}",
           f"training.seq_len={c['seq_len']}", f"training.micro_batch_size={c['micro_batch_size']}",
           f"training.precision={c['precision']}", f"training.attn_implementation={c['attn']}",
           f"training.gradient_checkpointing={str(c['gradient_checkpointing']).lower()}"]
    out += [f"peft={c.get('peft', 'none')}"]
    out += ["training.checkpoint_policy=reentrant"] if c.get("checkpoint_policy") == "reentrant" else []
    return out + (SMALL_BUCKETS if c["buckets"] == "small" else [])


TIMING_STEPS, WARMUP_STEPS = 20, 3
"""Timed steps per timing pass and re-timing run, after the warm-up steps left out of the median: a
tiny model's step is ~40 ms and single steps vary by ~10% on a quiet 2-core machine, so 20 steps
put the median within ~2%."""


def cell_env(c: dict) -> dict:
    """Environment additions of a cell's processes: offline, and this checkout on PYTHONPATH (the
    ColossalAI environment's ranks import the launcher from it)."""
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_cell(c: dict, hardware: str, out_dir: Path) -> dict:
    """mode=measure in a subprocess; returns the cell with its measure.json."""
    run_dir = out_dir / "cells" / cell_id(c)
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted attempt: launcher never reuses a run dir
    argv = [sys.executable, "-m", "launcher", *overrides(c, hardware), "mode=measure", "report=json",
            f"measure.timing_steps={TIMING_STEPS}", f"measure.warmup_steps={WARMUP_STEPS}",
            f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **cell_env(c)})
    wall_s = time.perf_counter() - start
    if proc.returncode != 0:
        return {**c, "id": cell_id(c), "error": proc.stderr.strip().splitlines()[-1:], "wall_s": wall_s}
    return {**c, "id": cell_id(c), "measure": json.loads((run_dir / "measure.json").read_text()),
            "wall_s": wall_s, "load_avg_1m": os.getloadavg()[0]}


def reestimate(r: dict, hardware: str) -> dict:
    """The plan's estimates for this cell with the current code and profile (no run)."""
    from launcher import planner
    from launcher.app import model_spec
    from launcher.cli import compose, translate_hardware
    from launcher.hardware import cluster_from

    config = compose(translate_hardware(overrides(r, hardware)))
    plan = planner.plan(config, model_spec(config), cluster_from(config.hardware, config.gpus, config.nodes))
    c = plan.candidates[plan.chosen]
    m = r["measure"]
    for row in m["memory"]:
        row["estimated_peak_bytes"] = c.memory.rank_peak_allocated_bytes(row["rank"])
        row["error_percent"] = 100.0 * (row["estimated_peak_bytes"] - row["measured_peak_bytes"]) / row["measured_peak_bytes"]
    if "time" in m:
        t = m["time"]
        t["estimated_step_s"] = c.speed.step_s
        t["estimated_breakdown"] = dict(c.speed.breakdown)
        t["error_percent"] = 100.0 * (c.speed.step_s - t["measured_step_s"]) / t["measured_step_s"]
    return r


# ---- ranking ---------------------------------------------------------------------------------

def interleaved_times(results: list[dict], out_dir: Path, rounds: int, steps: int = TIMING_STEPS,
                      warmup: int = WARMUP_STEPS) -> None:
    """Re-time every cell's timing pass (its RUN_DIR/timing/run.json, tracker off) round-robin
    inside its workload group, `rounds` times, and store the median over rounds of each run's
    median step time as `interleaved_step_s`: load from other processes then drifts over every
    strategy of a group alike instead of over whichever cells ran at a busy moment."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        if "time" in r.get("measure", {}):
            groups.setdefault(group_key(r), []).append(r)
    for rows in (g for g in groups.values() if len(g) > 1):
        times: dict[str, list[float]] = {r["id"]: [] for r in rows}
        for k in range(rounds):
            for r in (rows if k % 2 == 0 else rows[::-1]):
                times[r["id"]].append(retime_s(out_dir / "cells" / r["id"], steps, warmup, 2, cell_env(r)))
        with open(out_dir / "results.jsonl", "a") as f:  # stored per group; later lines win on load
            for r in rows:
                r["measure"]["time"]["interleaved_step_s"] = statistics.median(times[r["id"]])
                r["measure"]["time"]["interleaved_runs"] = times[r["id"]]
                f.write(json.dumps(r) + "\n")
                print(f"interleaved {r['id']}: {[round(t, 4) for t in times[r['id']]]}", flush=True)


def measured_step(r: dict) -> float:
    """The interleaved median when the cell was re-timed, else its own timing pass's median."""
    t = r["measure"]["time"]
    return t.get("interleaved_step_s", t["measured_step_s"])


def group_key(r: dict) -> tuple:
    return (r["model"], r["precision"], ckpt_label(r), r["attn"], r["buckets"], r.get("peft", "none"))


def spread(r: dict) -> float:
    """A cell's measurement noise, relative: the range of its re-timed medians when it was re-timed
    (the noise of the number that is ranked), else the inter-quartile range of its timed steps."""
    t = r["measure"]["time"]
    runs = t.get("interleaved_runs")
    if runs and len(runs) > 1:
        return (max(runs) - min(runs)) / statistics.median(runs)
    timed = sorted(t["step_s"][t["warmup_steps"]:])
    q1, q3 = timed[len(timed) // 4], timed[(3 * len(timed)) // 4]
    return (q3 - q1) / t["measured_step_s"]


def ranking(results: list[dict]) -> dict:
    """Kendall tau between estimated and measured step times, pooled over the pairs of strategies
    inside each workload group (tau-a over all pairs, and over the pairs whose measured times differ
    by more than the noisier cell's spread: the others are ties within the noise),
    and per group the plan's choice (fastest estimated) against the fastest measured."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        if "time" in r.get("measure", {}):
            groups.setdefault(group_key(r), []).append(r)
    retimed = {k: rows for k, rows in groups.items() if all("interleaved_step_s" in r["measure"]["time"] for r in rows)}
    groups = retimed or groups  # only the re-timed groups when there are any (module docstring)
    totals = {"all": [0, 0], "resolved": [0, 0]}
    per_group = []
    step = lambda r, k: r["measure"]["time"][k]  # noqa: E731
    for key, rows in groups.items():
        if len(rows) < 2:
            continue
        c = d = 0
        for a, b in itertools.combinations(rows, 2):
            est = step(a, "estimated_step_s") - step(b, "estimated_step_s")
            meas = measured_step(a) - measured_step(b)
            ok = est * meas > 0
            c, d = (c + 1, d) if ok else (c, d + 1)
            totals["all"][0 if ok else 1] += 1
            if abs(meas) > max(spread(a), spread(b)) * min(measured_step(a), measured_step(b)):
                totals["resolved"][0 if ok else 1] += 1
        chosen = min(rows, key=lambda r: step(r, "estimated_step_s"))
        best = min(rows, key=measured_step)
        slower = measured_step(chosen) / measured_step(best) - 1
        per_group.append({"group": "/".join(map(str, key)), "tau": (c - d) / (c + d),
                          "measured_order": [r["strategy"] for r in sorted(rows, key=measured_step)],
                          "estimated_order": [r["strategy"] for r in sorted(rows, key=lambda r: step(r, "estimated_step_s"))],
                          "chosen": chosen["strategy"], "best": best["strategy"], "chosen_slower_percent": 100 * slower})
    tau = {k: (v[0] - v[1]) / sum(v) if sum(v) else None for k, v in totals.items()}
    return {"kendall_tau": tau["all"], "pairs": sum(totals["all"]), "kendall_tau_resolved": tau["resolved"],
            "resolved_pairs": sum(totals["resolved"]), "groups": per_group,
            "chosen_within_10_percent": all(g["chosen_slower_percent"] <= 10 for g in per_group),
            "worst_chosen_slower_percent": max((g["chosen_slower_percent"] for g in per_group), default=None)}


# ---- tables ----------------------------------------------------------------------------------

EXPLANATIONS = {
    "ckpt": ("gradient checkpointing: transformers' masking utilities take a data-dependent shortcut "
             "(the mask is skipped when it can be proven all-causal); fake tensors cannot evaluate it, so the "
             "trace keeps the mask tensors the real run drops"),
}


def explanation(r: dict, max_err: float) -> str:
    if max_err <= 1.0:
        return ""
    if r["gradient_checkpointing"]:
        return EXPLANATIONS["ckpt"]
    return r.get("note", "unexplained")


def rows_of(results: list[dict]) -> list[dict]:
    out = []
    for r in results:
        base = {k: r[k] for k in ("model", "size", "strategy", "precision", "gradient_checkpointing", "attn",
                                  "buckets", "seq_len", "micro_batch_size")}
        base["checkpoint_policy"] = r.get("checkpoint_policy", "full")
        if r.get("peft", "none") != "none":  # adapters on a frozen base: shown with the strategy
            base["strategy"] = f"{r['strategy']}+{r['peft']}"
        if "error" in r:
            out.append({**base, "note": "failed: " + " ".join(r["error"])})
            continue
        m = r["measure"]
        mem = m["memory"]
        errs = [row["error_percent"] for row in mem]
        max_err = max(abs(e) for e in errs)
        t = m.get("time", {})
        out.append({**base,
                    "estimated_mib": max(row["estimated_peak_bytes"] for row in mem) / 2**20,
                    "estimated_mib_per_rank": [row["estimated_peak_bytes"] / 2**20 for row in mem],
                    "measured_mib": [row["measured_peak_bytes"] / 2**20 for row in mem],
                    "memory_error_percent": errs, "max_abs_memory_error_percent": max_err,
                    "estimated_step_s": t.get("estimated_step_s"), "measured_step_s": t.get("measured_step_s"),
                    "step_error_percent": t.get("error_percent"),
                    "retimed_step_s": t.get("interleaved_step_s"),
                    "retimed_error_percent": (100 * (t["estimated_step_s"] - t["interleaved_step_s"]) / t["interleaved_step_s"]
                                              if t.get("interleaved_step_s") else None),
                    "note": explanation(r, max_err) + (" (BLOOM: no sdpa in transformers, eager)" if r["model"] in NO_SDPA else "")})
    return out


def write_csv(rows: list[dict], path: Path) -> None:
    fields = ["model", "size", "strategy", "precision", "gradient_checkpointing", "checkpoint_policy", "attn",
              "buckets", "seq_len",
              "micro_batch_size", "estimated_mib", "measured_mib_rank0", "measured_mib_rank1",
              "memory_error_percent_rank0", "memory_error_percent_rank1", "estimated_step_s", "measured_step_s",
              "step_error_percent", "retimed_step_s", "retimed_error_percent", "note"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            flat = {k: r.get(k) for k in fields if k in r}
            for i, v in enumerate(r.get("measured_mib", [])):
                flat[f"measured_mib_rank{i}"] = round(v, 4)
            for i, v in enumerate(r.get("memory_error_percent", [])):
                flat[f"memory_error_percent_rank{i}"] = round(v, 4)
            w.writerow(flat)


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(rows: list[dict], rank: dict, meta: dict) -> str:
    lines = [f"# Accuracy: estimates against real runs", "",
             f"Measured {meta['date']} on {meta['machine']}; {meta['cells']} of the {meta['selected']} selected cells, "
             f"{meta['wall_min']:.0f} min of runs "
             f"(load average during the runs: {meta['load']}). {meta['profile']}", "",
             "Each cell: `python -m launcher ... mode=measure` on 2 CPU processes (gloo): a memory pass "
             "(3 steps, allocation tracker on; per-rank peak live tensor bytes) and a timing pass (tracker "
             f"off; median of {TIMING_STEPS} steps after {WARMUP_STEPS} warm-up steps). Error = (estimated - measured) / measured.", "",
             "Reproduce:", "", "```", *meta["commands"], "```", "",
             "| model | strategy | precision | ckpt | attn | buckets | est. MiB (per rank if they differ) | meas. MiB (r0, r1) | mem err % (r0, r1) | est. step s | meas. step s | step err % | re-timed s | re-timed err % | note |",
             "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        meas = ", ".join(f"{v:.3f}" for v in r.get("measured_mib", [])) or "-"
        errs = ", ".join(f"{v:+.3f}" for v in r.get("memory_error_percent", [])) or "-"
        per_rank = r.get("estimated_mib_per_rank", [])  # ranks estimated apart (ZeRO 1-2) when they differ
        est = ", ".join(f"{v:.3f}" for v in per_rank) if len(set(per_rank)) > 1 else fmt(r.get("estimated_mib"), ".3f")
        lines.append(f"| {r['model']} | {r['strategy']} | {r['precision']} | {ckpt_label(r)} "
                     f"| {r['attn']} | {r['buckets']} | {est} | {meas} | {errs} "
                     f"| {fmt(r.get('estimated_step_s'), '.4f')} | {fmt(r.get('measured_step_s'), '.4f')} "
                     f"| {fmt(r.get('step_error_percent'), '+.0f')} | {fmt(r.get('retimed_step_s'), '.4f')} "
                     f"| {fmt(r.get('retimed_error_percent'), '+.0f')} | {r['note']} |")
    worst = max((r["max_abs_memory_error_percent"] for r in rows if "max_abs_memory_error_percent" in r), default=None)
    lines += ["", f"Worst per-rank memory error: {fmt(worst, '.3f')}%.", "", *NOTES, "",
              "## Speed ranking", "",
              f"Kendall tau between estimated and measured step time, over {rank['pairs']} strategy pairs "
              f"inside the workload groups: **{fmt(rank['kendall_tau'], '.3f')}**; over the {rank['resolved_pairs']} pairs "
              f"whose measured times differ by more than the noisier cell's spread (range of its re-timed medians): "
              f"**{fmt(rank['kendall_tau_resolved'], '.3f')}**. Plan's choice (fastest estimated) "
              f"vs the fastest measured: worst {fmt(rank['worst_chosen_slower_percent'], '.1f')}% slower "
              f"({'within' if rank['chosen_within_10_percent'] else 'NOT within'} 10% in every group).", "",
              "| group (model/precision/ckpt/attn/buckets) | tau | measured order | estimated order | chosen | best | chosen slower % |",
              "|---|---:|---|---|---|---|---:|"]
    for g in rank["groups"]:
        lines.append(f"| {g['group']} | {g['tau']:+.2f} | {' < '.join(g['measured_order'])} | "
                     f"{' < '.join(g['estimated_order'])} | {g['chosen']} | {g['best']} | {g['chosen_slower_percent']:.1f} |")
    return "\n".join(lines) + "\n"


NOTES = [
    "Notes:",
    "- Memory is the peak of live tensor bytes per rank (allocation tracker on real tensors); the estimate is "
    "the same quantity from the traced step and the strategy's layout (`hardware=cpu`: no allocator rounding, "
    "no CUDA runtime terms). BLOOM has no sdpa attention in transformers: its cells run eager.",
    "- Step time is measured with the tracker off. Single steps of a tiny model vary by ~10% even on a quiet "
    "2-core machine, and any other process on it moves whole runs, so the ranking uses `--interleave` "
    "re-timings where present: every strategy of a group re-run round-robin (every other round reversed), "
    "each run's median kept, and the median over rounds ranked (`re-timed s`); when any group was re-timed, "
    "only re-timed groups are ranked. A pair counts as resolved when the two cells differ by more than the "
    "noisier cell's spread (the range of its re-timed medians).",
    "- Step-time estimates hold for the machine the hardware profile was calibrated on: a CPU model with "
    "other matmul, memory and gloo rates (e.g. AMX bf16 on recent Xeons) gets other numbers and often "
    "another ranking, so the matrix is estimated with a profile `mode=calibrate` measured on the machine "
    "that ran it.",
]


def profile_line(hardware: str) -> str:
    """Which hardware profile the step-time estimates use and where it was measured: a CPU
    profile's speed numbers hold for the CPU model it was calibrated on."""
    import yaml

    from launcher.calibrate import cpu_model

    path = Path(hardware) if hardware.endswith((".yaml", ".yml")) else ROOT / "conf" / "hardware" / f"{hardware}.yaml"
    on = yaml.safe_load(path.read_text()).get("calibrated_on") or "an unrecorded machine"
    same = "this machine" if on == cpu_model() else f"NOT this machine ({cpu_model()})"
    return f"Step-time estimates use the hardware profile `{hardware}`, calibrated on {on}: {same}."


def load_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


KEPT_SECTIONS = ("## ColossalAI shardformer runs",)
"""Sections of accuracy.md written by hand (runs outside the matrix), kept before "## Speed ranking"."""


def keep_hand_sections(text: str, path: Path) -> str:
    """The generated `text` with what accuracy.md holds beside the matrix: the KEPT_SECTIONS before
    "## Speed ranking", and every section after the matrix's own (other scripts' tables, e.g.
    scripts/validate_gpu's between its markers), unchanged."""
    old = path.read_text() if path.exists() else ""
    kept = []
    for title in KEPT_SECTIONS:
        start = old.find(title)
        if start >= 0:
            end = old.find("\n## ", start + len(title))
            kept.append(old[start:end + 1 if end >= 0 else len(old)])
    if kept and "## Speed ranking" in text:
        text = text.replace("## Speed ranking", "".join(kept) + "## Speed ranking", 1)
    ranking = old.find("## Speed ranking")
    after = old.find("\n## ", ranking + 1) if ranking >= 0 else -1
    return text.rstrip("\n") + "\n\n" + old[after + 1:] if after >= 0 else text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a subset of the matrix")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated strategy names")
    ap.add_argument("--hardware", default="cpu", help="hardware profile name or YAML path")
    ap.add_argument("--out", default=str(ROOT / "runs" / "accuracy"), help="results directory")
    ap.add_argument("--docs", default=str(ROOT / "docs"), help="where accuracy.md and accuracy.csv go")
    ap.add_argument("--reestimate", action="store_true", help="re-plan the stored measurements; run nothing")
    ap.add_argument("--only", default="", help="regular expression: keep the cells whose id matches")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="re-time each group's cells round-robin ROUNDS times for the ranking (stored)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    strategies = args.strategies.split(",")
    cells = [c for c in (quick_cells if args.quick else full_cells)(strategies) if re.search(args.only, cell_id(c))]
    results_path = out_dir / "results.jsonl"
    done = {r["id"]: r for r in load_results(results_path) if "error" not in r}
    start = time.perf_counter()
    loads = []
    if not args.reestimate:
        for i, c in enumerate(cells):
            if cell_id(c) in done:
                continue
            while (out_dir / "pause").exists():  # touch OUT/pause to hold the machine quiet between cells
                time.sleep(5)
            r = run_cell(c, args.hardware, out_dir)
            loads.append(r.get("load_avg_1m"))
            done[r["id"]] = r
            with open(results_path, "a") as f:
                f.write(json.dumps(r) + "\n")
            m = r.get("measure")
            summary = (f"mem {m['max_abs_memory_error_percent']:.3f}% step {m['time']['error_percent']:+.0f}%"
                       if m and "time" in m else r.get("error"))
            print(f"[{i + 1}/{len(cells)}] {r['id']}: {summary} ({r['wall_s']:.0f} s)", flush=True)
    results = [done[cell_id(c)] for c in cells if cell_id(c) in done]
    if not results:  # nothing measured: the tables written before stay as they are
        print(f"error: no measured cells in {results_path}; run the matrix first (without --reestimate), "
              "or point --out at the directory of a run", file=sys.stderr)
        return 2
    if args.interleave:
        interleaved_times(results, out_dir, args.interleave)
    if args.reestimate:
        results = [reestimate(r, args.hardware) for r in results]
    rows, rank = rows_of(results), ranking(results)
    wall_min = sum(r.get("wall_s", 0) for r in results) / 60
    load_values = [r.get("load_avg_1m") for r in results if r.get("load_avg_1m") is not None]
    meta = {"date": dt.date.today().isoformat(), "machine": machine(), "cells": len(results), "selected": len(cells),
            "wall_min": wall_min,
            "load": f"{min(load_values):.1f}-{max(load_values):.1f}" if load_values else "unknown",
            "profile": profile_line(args.hardware),
            "commands": ["scripts/setup",
                         ".venv/bin/python -m launcher mode=calibrate hardware=cpu gpus=2 "
                         "'calibrate.frameworks=[ddp,zero0,zero1,zero2,zero3,cai_ddp,cai_zero1,cai_zero2,cai_tp]' "
                         "hydra.run.dir=runs/calibrate   # this machine's speed profile (~8 min)",
                         f".venv/bin/python scripts/accuracy_matrix.py{' --quick' if args.quick else ''} "
                         "--hardware runs/calibrate/hardware/cpu-calibrated.yaml --interleave 3",
                         f".venv/bin/python scripts/accuracy_matrix.py --hardware {args.hardware} "
                         "--reestimate   # the estimates below: the current code with this profile"]}
    docs = Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    write_csv(rows, docs / "accuracy.csv")
    (docs / "accuracy.md").write_text(keep_hand_sections(markdown(rows, rank, meta), docs / "accuracy.md"))
    (out_dir / "ranking.json").write_text(json.dumps(rank, indent=2) + "\n")
    print(f"{len(results)} cells ({time.perf_counter() - start:.0f} s this run); kendall tau {rank['kendall_tau']}; "
          f"worst chosen-vs-best {rank['worst_chosen_slower_percent']}%; wrote {docs / 'accuracy.md'}")
    return 0


def machine() -> str:
    import platform

    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


if __name__ == "__main__":
    sys.exit(main())

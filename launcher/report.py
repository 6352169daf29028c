"""Plan -> JSON contract and a readable table; the end-of-run summary."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from launcher.types import Candidate, Plan

BREAKDOWN_KEYS = ("parameters", "gradients", "optimizer_states", "activations", "buffers", "runtime")


def candidate_to_dict(c: Candidate, capacity_bytes: int) -> dict:
    m, s = c.memory, c.speed
    return {
        "strategy": c.strategy.name,
        "backend": c.strategy.backend,
        "layout": asdict(c.strategy),
        "micro_batch_size": c.micro_batch_size,
        "grad_accum_steps": c.grad_accum_steps,
        "trains": c.trains,
        "fits": c.fits,
        "reason": c.reason,
        "memory": {
            "peak_allocated_bytes": m.peak_allocated_bytes,
            "peak_reserved_bytes": m.peak_reserved_bytes,
            "device_total_bytes": m.device_total_bytes,
            "capacity_bytes": capacity_bytes,
            "host_bytes": m.host_bytes,
            "peak_phase": m.peak_phase,
            "breakdown": {k: int(m.breakdown.get(k, 0)) for k in BREAKDOWN_KEYS},
            "notes": list(m.notes),
        },
        "speed": {"step_s": s.step_s, "tokens_per_s": s.tokens_per_s, "compute_s": s.compute_s,
                  "comm_s": s.comm_s, "breakdown": dict(s.breakdown)},
    }


def plan_to_dict(plan: Plan, capacity_bytes: int) -> dict:
    return {
        "model": plan.model,
        "hardware": plan.hardware,
        "gpus": plan.gpus,
        "nodes": plan.nodes,
        "candidates": [candidate_to_dict(c, capacity_bytes) for c in plan.candidates],
        "chosen": plan.chosen,
        "notes": list(plan.notes),
    }


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def print_plan(plan: Plan, capacity_bytes: int, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=180)
    n = plan.model.get("num_params")
    title = (f"{plan.model['name']} ({n / 1e9:.2f}B params) on {plan.gpus} x {plan.hardware}"
             f"{f' over {plan.nodes} nodes' if plan.nodes > 1 else ''}: {gib(capacity_bytes)} GiB per GPU"
             if n else f"{plan.model['name']} on {plan.gpus} x {plan.hardware}")
    table = Table(title=title, show_lines=False, pad_edge=False, box=None, header_style="bold")
    for col, just in (("#", "right"), ("strategy", "left"), ("micro", "right"), ("accum", "right"),
                      ("total", "right"), ("alloc", "right"), ("params", "right"), ("grads", "right"),
                      ("optim", "right"), ("activ", "right"), ("buffers", "right"), ("runtime", "right"),
                      ("host", "right"), ("tokens/s", "right"), ("verdict", "left")):
        table.add_column(col, justify=just, overflow="fold")
    for i, c in enumerate(plan.candidates):
        b = c.memory.breakdown
        style = "bold green" if i == plan.chosen else (None if c.fits else "red")
        table.add_row(str(i), c.strategy.name, str(c.micro_batch_size), str(c.grad_accum_steps),
                      gib(c.memory.device_total_bytes), gib(c.memory.peak_allocated_bytes),
                      *(gib(b.get(k, 0)) for k in BREAKDOWN_KEYS), gib(c.memory.host_bytes),
                      f"{c.speed.tokens_per_s:,.0f}", "CHOSEN: fastest that fits" if i == plan.chosen else c.reason,
                      style=style)
    console.print(table)
    console.print("GiB per GPU on the worst rank. total = device total as nvidia-smi shows it (peak reserved + "
                  "CUDA context + NCCL); alloc = max_memory_allocated; params..runtime = breakdown at the peak; "
                  "host = offloaded bytes per rank.")
    for note in plan.notes:
        console.print(f"note: {note}")
    if plan.chosen is not None:
        c = plan.candidates[plan.chosen]
        console.print(f"[bold]chosen:[/bold] #{plan.chosen} {c.strategy.name}, micro_batch_size={c.micro_batch_size}, "
                      f"grad_accum_steps={c.grad_accum_steps}: {gib(c.memory.device_total_bytes)} GiB per GPU, "
                      f"{c.speed.tokens_per_s:,.0f} tokens/s")
        for note in c.memory.notes:
            console.print(f"  assumption: {note}")


def print_summary(run_dir: Path) -> None:
    """One line after training: loss, measured throughput next to the estimate (the worker's rank 0
    has already printed measured peak memory per rank next to the estimate)."""
    path = run_dir / "summary.json"
    if not path.exists():
        print(f"no summary.json in {run_dir}: training did not finish")
        return
    s = json.loads(path.read_text())
    est = s.get("estimate", {})
    line = (f"trained {s['steps']} steps: loss {s['first_loss']:.3f} -> {s['last_loss']:.3f}; "
            f"measured {s['mean_tokens_per_s']:,.0f} tokens/s")
    if est.get("step_s"):
        line += f" (estimated step {est['step_s']:.3g} s)"
    print(f"{line}; details in {path}")

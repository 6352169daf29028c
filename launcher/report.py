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
        "trains_label": trains_label(c),
        "peft": c.peft,
        "gradient_checkpointing": c.gradient_checkpointing,
        "num_trainable_params": c.num_trainable_params,
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


def trains_label(c: Candidate) -> str:
    """What a candidate trains, as the table shows it: 'full', 'lora r=8', 'qlora nf4 r=16',
    with ' +ckpt' when it recomputes activations (gradient checkpointing)."""
    p = c.peft
    what = "full" if not p else (f"lora r={p['r']}" if not p.get("quant_type")
                                 else f"qlora {p['quant_type']} r={p['r']}")
    return what + (" +ckpt" if c.gradient_checkpointing else "")


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


def strategy_label(c: Candidate) -> str:
    """Strategy name with its model-parallel sizes (cai_tp tp=2, cai_pp pp=4)."""
    sizes = [f"{k}={v}" for k, v in (("tp", c.strategy.tp_size), ("pp", c.strategy.pp_size)) if v > 1]
    return " ".join([c.strategy.name, *sizes])


def shown_rows(plan: Plan) -> list[int]:
    """The rows a person needs: per strategy layout and training variant, its fastest candidate
    that fits and its first that does not (the rest are in plan.json)."""
    keep: dict[tuple, list[int]] = {}
    for i, c in enumerate(plan.candidates):
        group = (strategy_label(c), trains_label(c), c.fits)
        keep.setdefault(group, []).append(i)
    rows = {idx[0] for idx in keep.values()}  # candidates are ranked fastest first
    if plan.chosen is not None:
        rows.add(plan.chosen)
    return sorted(rows)


def print_plan(plan: Plan, capacity_bytes: int, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=200)
    n = plan.model.get("num_params")
    k = plan.model.get("num_trainable_params")
    trainable = f", {k:,} trainable" if k is not None and k != n else ""
    peak = max((c.memory.device_total_bytes for c in plan.candidates), default=0)
    unit, scale = ("GiB", 2**30) if max(peak, capacity_bytes) >= 2**30 else ("MiB", 2**20)
    fmt = lambda v: f"{v / scale:.2f}"  # noqa: E731
    size = f"{n / 1e9:.2f}B" if n and n >= 1e8 else f"{(n or 0) / 1e6:.2f}M"
    title = (f"{plan.model['name']} ({size} params{trainable}) on {plan.gpus} x {plan.hardware}"
             f"{f' over {plan.nodes} nodes' if plan.nodes > 1 else ''}: {fmt(capacity_bytes)} {unit} per GPU")
    table = Table(title=title, show_lines=False, pad_edge=False, box=None, header_style="bold")
    for col, just in (("#", "right"), ("strategy", "left"), ("trains", "left"), ("micro", "right"),
                      ("accum", "right"), ("total", "right"), ("alloc", "right"), ("params", "right"),
                      ("grads", "right"), ("optim", "right"), ("activ", "right"), ("buffers", "right"),
                      ("runtime", "right"), ("host", "right"), ("tokens/s", "right"), ("verdict", "left")):
        table.add_column(col, justify=just, overflow="fold")
    rows = shown_rows(plan)
    for i in rows:
        c = plan.candidates[i]
        b = c.memory.breakdown
        style = "bold green" if i == plan.chosen else (None if c.fits else "red")
        table.add_row(str(i), strategy_label(c), trains_label(c), str(c.micro_batch_size), str(c.grad_accum_steps),
                      fmt(c.memory.device_total_bytes), fmt(c.memory.peak_allocated_bytes),
                      *(fmt(b.get(k, 0)) for k in BREAKDOWN_KEYS), fmt(c.memory.host_bytes),
                      f"{c.speed.tokens_per_s:,.0f}", "CHOSEN: fastest that fits" if i == plan.chosen else c.reason,
                      style=style)
    console.print(table)
    hidden = len(plan.candidates) - len(rows)
    if hidden:
        console.print(f"{hidden} more candidates (other micro-batch sizes of the same strategies) are in "
                      "plan.json; report=json prints every one.")
    console.print("trains = what a candidate changes: 'full' fine-tuning, or LoRA/QLoRA adapters on a frozen "
                  "base (peft; +ckpt = gradient checkpointing).")
    console.print(f"{unit} per GPU on the worst rank. total = device total as nvidia-smi shows it (peak reserved + "
                  "CUDA context + NCCL); alloc = max_memory_allocated; params..runtime = breakdown at the peak; "
                  "host = offloaded bytes per rank.")
    for note in plan.notes:
        console.print(f"note: {note}")
    if plan.chosen is not None:
        c = plan.candidates[plan.chosen]
        console.print(f"[bold]chosen:[/bold] #{plan.chosen} {strategy_label(c)} ({trains_label(c)}, "
                      f"{c.num_trainable_params:,} trainable parameters), micro_batch_size={c.micro_batch_size}, "
                      f"grad_accum_steps={c.grad_accum_steps}: {fmt(c.memory.device_total_bytes)} {unit} per GPU, "
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

"""The plan as a terminal table: one row per strategy, 120 columns; `report=wide` every column.

Each row is a strategy layout and training variant (`strategy_label`, `trains_label`): its
fastest candidate that fits, or, when none does, its smallest one and why it does not fit. The
micro-batch sizes planned for it are summarised in `sizes` (how many fit); plan.json and
plan.html hold every candidate.
"""
from __future__ import annotations

import math
import re
import shutil

from launcher.report import BREAKDOWN_KEYS, line_width, strategy_label, trains_label
from launcher.types import Candidate, Plan

WIDTH = 120
"""Widest line of the default table (launcher/report.py line_width); report=wide uses 220 or more."""

NOT_PLANNED = re.compile(r"(?P<name>\S+(?: tp=\d+)?)(?: \((?P<variant>[^()]*)\))? not planned: (?P<why>.*)", re.S)
"""A planner note `<strategy>[ tp=<n>][ (<training variant>)] not planned: <reason>` (launcher/planner.py)."""


def grouped_notes(notes: list[str]) -> list[str]:
    """The plan's notes as printed: the `not planned` lines that give one reason are one line,
    `cai_ddp, cai_zero1 (lora r=8; lora r=8 +ckpt) not planned: <reason>`, where the strategies
    named share the variants listed (strategies with other variants get a line of their own);
    every other note as it is, in the order the first of each group came. plan.json keeps every
    line."""
    out: list = []
    groups: dict[str, dict[str, list]] = {}
    for note in notes:
        m = NOT_PLANNED.fullmatch(note)
        if m is None:
            out.append(note)
            continue
        if m["why"] not in groups:
            groups[m["why"]] = {}
            out.append((m["why"],))
        variants = groups[m["why"]].setdefault(m["name"], [])
        if m["variant"] not in variants:
            variants.append(m["variant"])
    lines = []
    for item in out:
        if isinstance(item, str):
            lines.append(item)
            continue
        why = item[0]
        by_variants: dict[tuple, list[str]] = {}
        for name, variants in groups[why].items():
            by_variants.setdefault(tuple(variants), []).append(name)
        for variants, names in by_variants.items():
            shown = [v for v in variants if v]
            suffix = f" ({'; '.join(shown)})" if shown else ""
            lines.append(f"{', '.join(names)}{suffix} not planned: {why}")
    return lines


def strategy_rows(plan: Plan) -> list[tuple[int, list[int]]]:
    """(shown candidate, every candidate of its group) per strategy, in rank order of the shown
    one: the fastest that fits (the chosen one for its group), else the smallest that does not."""
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(plan.candidates):
        groups.setdefault((strategy_label(c), trains_label(c)), []).append(i)
    rows = []
    for members in groups.values():
        fitting = [i for i in members if plan.candidates[i].fits]
        if plan.chosen in members:
            shown = plan.chosen
        elif fitting:
            shown = fitting[0]  # candidates are ranked fastest first
        else:
            shown = min(members, key=lambda i: plan.candidates[i].memory.device_total_bytes)
        rows.append((shown, members))
    return sorted(rows, key=lambda r: (not plan.candidates[r[0]].fits, r[0]))


def short_verdict(c: Candidate, chosen: bool) -> str:
    """The planner's reason in a few words; report=wide prints it whole."""
    if chosen:
        return "chosen (fastest fit)"
    r = c.reason
    if m := re.match(r"fits; lost on speed: ([\d.]+)x slower", r):
        return f"{float(m.group(1)):.2f}x slower"
    if m := re.match(r"fits; as fast as the chosen .*: ([\d.]+) (\w+) > ([\d.]+) (\w+) device total", r):
        return f"as fast; {m.group(1)} > {m.group(3)} {m.group(4)}"
    if r.startswith("fits; ties with the chosen"):
        return "ties with the chosen"
    if r.startswith("fits; not launchable"):
        return "fits; not launchable here"
    if m := re.match(r"fits; trains (\S+) instead of (\S+)", r):
        return f"fits; trains {m.group(1)}, not {m.group(2)}"
    if m := re.match(r"OOM: ([\d.]+) (\w+) > ([\d.]+) (\w+) usable", r):
        need = m.group(1) if m.group(2) == m.group(4) else f"{m.group(1)} {m.group(2)}"
        return f"OOM: {need} > {m.group(3)} {m.group(4)}"
    if m := re.match(r"host RAM: .* needs ([\d.]+) (\w+) per node > ([\d.]+) (\w+)", r):
        # whole units, the need rounded up and the capacity down, so a small excess still shows
        need = f"{math.ceil(float(m.group(1)))}" + ("" if m.group(2) == m.group(4) else f" {m.group(2)}")
        return f"host RAM {need} > {math.floor(float(m.group(3)))} {m.group(4)}"
    return r


def sizes(plan: Plan, members: list[int]) -> str:
    """'3/5 fit' and the largest micro-batch that fits: the micro-batch variants in a word."""
    fit = [plan.candidates[i].micro_batch_size for i in members if plan.candidates[i].fits]
    return f"{len(fit)}/{len(members)} fit" + (f", <={max(fit)}" if fit else "")


def unit_for(plan: Plan, capacity_bytes: int) -> tuple[str, int]:
    peak = max((c.memory.device_total_bytes for c in plan.candidates), default=0)
    return ("GiB", 2**30) if max(peak, capacity_bytes) >= 2**30 else ("MiB", 2**20)


def title(plan: Plan, capacity_bytes: int, device: str) -> str:
    unit, scale = unit_for(plan, capacity_bytes)
    n = plan.model.get("num_params")
    k = plan.model.get("num_trainable_params")
    trainable = f", {k:,} trainable" if k is not None and k != n else ""
    size = f"{n / 1e9:.2f}B" if n and n >= 1e8 else f"{(n or 0) / 1e6:.2f}M"
    counted = f" ({size} params{trainable})" if n else ""  # nothing traced: no count to give
    where = (f"{plan.gpus} CPU processes ({plan.hardware} profile)" if device == "cpu"
             else f"{plan.gpus} x {plan.hardware}")
    each = "per process" if device == "cpu" else "per GPU"
    nodes = f" over {plan.nodes} nodes" if plan.nodes > 1 else ""
    return (f"{plan.model['name']}{counted} on {where}{nodes}: "
            f"{capacity_bytes / scale:.2f} {unit} {each}")


def build_table(plan: Plan, capacity_bytes: int, device: str, wide: bool):
    from rich.table import Table

    unit, scale = unit_for(plan, capacity_bytes)
    fmt = lambda v: f"{v / scale:.2f}"  # noqa: E731
    table = Table(title=title(plan, capacity_bytes, device), box=None, pad_edge=False, header_style="bold",
                  title_justify="left")
    columns = [("#", "right"), ("strategy", "left"), ("trains", "left"), ("micro", "right"),
               ("accum", "right"), (f"total {unit}", "right")] + [("needs", "right")] * wide + [("alloc", "right")]
    if wide:
        columns += [("params", "right"), ("grads", "right"), ("optim", "right"), ("activ", "right"),
                    ("buffers", "right"), ("runtime", "right")]
    rows = strategy_rows(plan)
    host = wide or any(plan.candidates[i].memory.host_bytes for i, _ in rows)  # offload only
    columns += [("host", "right")] * host + [("tokens/s", "right"), ("sizes", "left"), ("verdict", "left")]
    for name, just in columns:
        table.add_column(name, justify=just, overflow="fold" if wide else "ellipsis",
                         no_wrap=not wide and name != "verdict")
    for i, members in rows:
        c = plan.candidates[i]
        m = c.memory
        style = "bold green" if i == plan.chosen else (None if c.fits else "red")
        cells = [str(i), strategy_label(c), trains_label(c), str(c.micro_batch_size), str(c.grad_accum_steps),
                 fmt(m.device_total_bytes), *[fmt(m.oom_bytes)] * wide, fmt(m.peak_allocated_bytes)]
        if wide:
            cells += [fmt(m.breakdown.get(k, 0)) for k in BREAKDOWN_KEYS]
        verdict = ("CHOSEN: fastest that fits" if i == plan.chosen else c.reason) if wide \
            else short_verdict(c, i == plan.chosen)
        cells += [fmt(m.host_bytes)] * host + [f"{c.speed.tokens_per_s:,.0f}", sizes(plan, members), verdict]
        table.add_row(*cells, style=style)
    return table


def legend(plan: Plan, unit: str, device: str, wide: bool) -> list[str]:
    each = "per CPU process" if device == "cpu" else "per GPU"
    total = ("total = peak live tensor bytes (on CPU processes allocated = reserved = total)" if device == "cpu"
             else "total = device total as nvidia-smi shows it (peak reserved + CUDA context + NCCL)")
    lines = [f"{unit} {each} on the worst rank. {total}; alloc = max_memory_allocated; "
             "host = offloaded bytes per rank (shown with offload).",
             "One row per strategy: its fastest candidate that fits, or its smallest and why it does not fit. "
             "sizes = micro-batch sizes planned and how many fit (<= the largest that fits)"
             + (".", "; a candidate fits when what it needs (total less the cached segments the allocator "
                "frees before it reports out of memory) is within the usable memory.")[device != "cpu"],
             "trains = 'full' fine-tuning, or LoRA/QLoRA adapters on a frozen base (+ckpt = gradient checkpointing)."]
    if wide:
        lines.insert(1, "needs = what decides the fit; params..runtime = breakdown at the peak.")
    else:
        lines.append("Every candidate, memory breakdown and full verdict: plan.html, plan.json; report=wide prints "
                     "every column.")
    return lines


def print_plan(plan: Plan, capacity_bytes: int, device: str = "cuda", wide: bool = False, console=None) -> None:
    from rich.console import Console

    if console is None:
        console = Console(width=max(shutil.get_terminal_size((WIDTH, 24)).columns, 220) if wide else line_width())
    unit, scale = unit_for(plan, capacity_bytes)
    console.print(build_table(plan, capacity_bytes, device, wide))
    for line in legend(plan, unit, device, wide):
        console.print(line, markup=False)
    for note in grouped_notes(plan.notes):
        console.print(f"note: {note}", markup=False)
    if plan.chosen is not None:
        c = plan.candidates[plan.chosen]
        each = "per process" if device == "cpu" else "per GPU"
        console.print(f"[bold]chosen:[/bold] #{plan.chosen} {strategy_label(c)} ({trains_label(c)}, "
                      f"{c.num_trainable_params:,} trainable parameters), micro_batch_size={c.micro_batch_size}, "
                      f"grad_accum_steps={c.grad_accum_steps}: {c.memory.device_total_bytes / scale:.2f} {unit} "
                      f"{each}, {c.speed.tokens_per_s:,.0f} tokens/s")
        for note in c.memory.notes:
            console.print(f"  assumption: {note}", markup=False)

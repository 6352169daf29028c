"""Plan -> JSON contract; the terminal table (launcher/report_table.py); the end-of-run summary."""
from __future__ import annotations

import json
import shutil
import textwrap
from dataclasses import asdict
from pathlib import Path

from launcher.shell import shell_word
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
            "needed_bytes": m.oom_bytes,
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
    """What a candidate trains, as the table shows it: 'full', 'lora r=8' ('lora r=8+base' with the
    base trained too), 'qlora nf4 r=16', with ' +ckpt' when it recomputes activations (gradient
    checkpointing)."""
    p = c.peft
    base = "+base" if p and p.get("train_base") else ""
    what = "full" if not p else (f"lora r={p['r']}{base}" if not p.get("quant_type")
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


def line_width() -> int:
    """Width of printed lines: the terminal's (COLUMNS first), at most 120."""
    columns = shutil.get_terminal_size((120, 24)).columns
    return min(columns, 120) if columns > 40 else 120


def wrapped(text: str) -> str:
    """`text` folded to line_width(), continuation lines indented."""
    return textwrap.fill(text, line_width(), subsequent_indent="  ", break_long_words=False,
                         break_on_hyphens=False)


def shell_block(argv) -> str:
    """A command folded to line_width() with shell line continuations: it still pastes as one."""
    lines, line = [], ""
    for word in (shell_word(a) for a in argv):
        if line and len(line) + len(word) + 3 > line_width():
            lines.append(line + " \\")
            line = "  " + word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join([*lines, line])


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

#!/usr/bin/env python
"""FSDP1 accuracy: `python -m launcher ... mode=measure` on 2 CPU processes (gloo) for the FSDP1
strategies, every rank's estimated peak against the peak of live tensor bytes the worker's
allocation tracker measures, next to what FSDP2's layout of the same step estimates (the
strategy=fsdp1 rows of the GPU validation were planned with it before FSDP1 had its own).
Writes the section between the FSDP1 markers of docs/accuracy.md (appended when absent).

    .venv/bin/python scripts/fsdp1_accuracy.py            # ~5 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import fsdp2_accuracy as f2  # noqa: E402  (the same measure(): CLI, tracker, JSON)

BEGIN, END = "<!-- fsdp1-accuracy:begin -->", "<!-- fsdp1-accuracy:end -->"
LORA = ("peft=lora", "peft.r=8")
CELLS = [  # (model, strategy, precision, gradient checkpointing, extra overrides, note)
    ("tiny-llama", "fsdp1", "32-true", False, (), ""),
    ("tiny-llama", "fsdp1", "bf16-mixed", False, f2.UNEVEN, "vocabulary 321, MLP 175: padded flat parameters"),
    ("tiny-llama", "fsdp1_grad_op", "32-true", True, (), ""),
    ("tiny-bloom", "fsdp1", "bf16-mixed", True, (), ""),
    ("small-llama", "fsdp1", "32-true", False, (), "the root's flat gradient at the end of backward"),
    ("small-llama", "fsdp1", "bf16-mixed", False, (), ""),
    ("small-llama", "fsdp1_grad_op", "bf16-mixed", False, (), ""),
    ("small-llama", "fsdp1", "bf16-true", False, LORA, "LoRA r=8: the frozen base's gradients too"),
    ("small-llama", "fsdp1", "bf16-mixed", False, LORA, "LoRA r=8"),
    ("tiny-bloom", "fsdp1", "bf16-mixed", False, ("peft=lora",), "LoRA r=16"),
]
AS_FSDP2 = {"fsdp1": "fsdp2", "fsdp1_grad_op": "fsdp2_grad_op"}


def fsdp2_estimate(cell, work: Path, cache: Path) -> list:
    """FSDP2's layout of the same step (`mode=plan`, strategy fsdp2 or fsdp2_grad_op); per rank."""
    model, strategy, precision, ckpt, extra, _ = cell
    run_dir = work / f"plan-{model}-{strategy}-{precision}-{ckpt}-{abs(hash(extra)) % 10**6}"
    attn = "eager" if model in f2.NO_SDPA else "sdpa"
    lora = ("peft.autocast_adapter_dtype=false",) if any(e.startswith("peft=") for e in extra) else ()
    argv = [sys.executable, "-m", "launcher", f"model={model}", "hardware=cpu", "gpus=2",
            f"strategy={AS_FSDP2[strategy]}", "mode=plan", "report=json", f"training.seq_len={f2.SEQ_LEN}",
            f"training.micro_batch_size={f2.MICRO}", f"training.precision={precision}",
            f"training.gradient_checkpointing={str(ckpt).lower()}", f"training.attn_implementation={attn}",
            *extra, *lora, f"cache_dir={cache}", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(argv, cwd=work, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return []
    plan = json.loads((run_dir / "plan.json").read_text())
    mem = plan["candidates"][plan["chosen"]]["memory"]
    return list(mem.get("per_rank_peak_allocated_bytes") or [mem["peak_allocated_bytes"]] * 2)


def table(rows: list[dict], seconds: float) -> str:
    cpu = platform.processor() or platform.machine()
    out = [BEGIN, "## FSDP1 (FullyShardedDataParallel)", "",
           f"From `scripts/fsdp1_accuracy.py`, {dt.date.today()}, 2 CPU processes (gloo), {cpu}, Python "
           f"{platform.python_version()}; {len(rows)} cells, {seconds / 60:.0f} min. Sequence {f2.SEQ_LEN}, micro-batch "
           f"{f2.MICRO}, AdamW (foreach). Estimated (launcher/backends/fsdp1/layout.py) vs measured peak of live "
           "tensor bytes per rank (the worker's allocation tracker), and FSDP2's layout of the same step (what "
           "FSDP1 runs were planned with before).", "",
           "| model | strategy | precision | ckpt | est. MiB (per rank if they differ) | meas. MiB (r0, r1) "
           "| mem err % (r0, r1) | FSDP2 layout err % (r0, r1) | note |",
           "|---|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        ckpt = "on" if r["ckpt"] else "off"
        if "failed" in r:
            out.append(f"| {r['model']} | {r['strategy']} | {r['precision']} | {ckpt} | - | - | - | - | failed: "
                       f"{' '.join(r['failed'])} |")
            continue
        err = ", ".join(f"{e:+.3f}" for e in r["error"])
        other = ", ".join(f"{100 * (e - m) / m:+.2f}" for e, m in zip(r["fsdp2"], r["measured"])) or "-"
        out.append(f"| {r['model']} | {r['strategy']} | {r['precision']} | {ckpt} | {f2.mib(r['estimated'])} | "
                   f"{', '.join(f'{m / 2**20:.3f}' for m in r['measured'])} | {err} | {other} | {r['note']} |")
    ok = [abs(e) for r in rows if "error" in r for e in r["error"]]
    out += ["", f"Largest per-rank error: {max(ok):.3f}% over {len(ok)} rank peaks." if ok else "", "",
            "On gloo the worker reduce-scatters through FSDP1's comm hook as an in-place all-reduce "
            "(launcher/backends/fsdp1/worker.py `gloo_reduce_scatter_hook`): gloo's reduce-scatter copies its "
            "input, and that copy of the root's gradient was alive at small-llama's bf16-mixed peak (the estimate read -18% against runs without the hook).",
            END]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print the section instead of writing it")
    args = parser.parse_args()
    start = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work, cache = Path(tmp), Path(tmp) / "cache"
        for cell in CELLS:
            row = f2.measure(cell, work, cache)
            row["fsdp2"] = fsdp2_estimate(cell, work, cache) if "failed" not in row else []
            rows.append(row)
            print(json.dumps(row), flush=True)
    text = table(rows, time.time() - start)
    if args.print:
        print(text)
        return
    path = ROOT / "docs" / "accuracy.md"
    doc = path.read_text()
    if BEGIN in doc and END in doc:
        doc = doc[:doc.index(BEGIN)] + text + doc[doc.index(END) + len(END) + 1:]
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    path.write_text(doc)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

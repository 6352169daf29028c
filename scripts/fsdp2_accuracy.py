#!/usr/bin/env python
"""FSDP2 accuracy: `python -m launcher ... mode=measure` on 2 CPU processes (gloo) for the FSDP2
strategies, every rank's estimated peak against the peak of live tensor bytes the worker's
allocation tracker measures, and the cross-check with torch's FSDPMemTracker
(scripts/fsdp2_memtracker.py). Writes the section between the FSDP2 markers of docs/accuracy.md
(appended when absent; run it after scripts/accuracy_matrix.py, which rewrites the file).

    .venv/bin/python scripts/fsdp2_accuracy.py            # ~8 minutes on 2 cores
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
sys.path.insert(0, str(ROOT))
BEGIN, END = "<!-- fsdp2-accuracy:begin -->", "<!-- fsdp2-accuracy:end -->"
UNEVEN = ("model.hf_config.vocab_size=321", "model.hf_config.intermediate_size=175")
LORA = ("peft.method=lora",)
LORA_R64 = (*LORA, "peft.r=64", "peft.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]")
QLORA = ("peft=qlora",)  # sharded QLoRA: NF4 stored as bf16, double quantization, r=16 (conf/peft/qlora.yaml)
NO_SDPA = {"tiny-bloom", "small-bloom"}
# (model, strategy, precision, gradient checkpointing, extra overrides, note)
CELLS = [
    *[("tiny-llama", s, p, False, (), "") for s in ("fsdp2", "fsdp2_grad_op")
      for p in ("32-true", "bf16-mixed", "bf16-true")],
    ("tiny-llama", "fsdp2", "bf16-mixed", True, (), ""),
    ("tiny-llama", "fsdp2_grad_op", "32-true", True, (), ""),
    ("tiny-llama", "fsdp2", "32-true", False, UNEVEN, "vocabulary 321, MLP 175: uneven shards"),
    ("tiny-llama", "fsdp2", "bf16-mixed", False, LORA, "LoRA r=8"),
    ("tiny-llama", "fsdp2", "32-true", False, LORA, "LoRA r=8"),
    ("tiny-llama", "fsdp2_tp", "32-true", False, (), "dp 1 x tp 2"),
    ("tiny-llama", "fsdp2_tp", "bf16-mixed", False, (), "dp 1 x tp 2"),
    ("tiny-llama", "fsdp2_tp", "32-true", True, (), "dp 1 x tp 2"),
    ("tiny-bloom", "fsdp2", "32-true", False, (), ""),
    ("tiny-bloom", "fsdp2", "bf16-mixed", False, (), ""),
    ("tiny-bloom", "fsdp2_grad_op", "bf16-mixed", False, (), ""),
    ("tiny-bloom", "fsdp2", "bf16-mixed", True, (), ""),
    ("small-llama", "fsdp2", "32-true", False, (), ""),
    ("small-llama", "fsdp2", "bf16-mixed", False, (), ""),
    ("small-llama", "fsdp2_grad_op", "bf16-mixed", False, (), ""),
    ("small-llama", "fsdp2", "bf16-mixed", True, (), ""),
    ("small-llama", "fsdp2_tp", "bf16-mixed", False, (), "dp 1 x tp 2"),
    ("small-llama", "fsdp2_tp", "32-true", False, (), "dp 1 x tp 2"),
    ("tiny-bloom", "fsdp2", "bf16-mixed", False, LORA, "LoRA r=8"),
    ("small-llama", "fsdp2", "bf16-true", False, LORA, "LoRA r=8: fp32 adapters, no MixedPrecisionPolicy"),
    ("small-llama", "fsdp2", "bf16-true", False, LORA_R64, "LoRA r=64, every projection: fp32 adapters"),
    ("small-llama", "fsdp2", "bf16-mixed", False, LORA_R64, "LoRA r=64, every projection"),
    ("tiny-llama", "fsdp2", "bf16-mixed", False, QLORA, "QLoRA"),
    ("tiny-llama", "fsdp2", "bf16-mixed", True, QLORA, "QLoRA"),
    ("tiny-bloom", "fsdp2", "bf16-mixed", False, QLORA, "QLoRA"),
    ("small-llama", "fsdp2", "bf16-mixed", False, QLORA, "QLoRA"),
    ("small-llama", "fsdp2_grad_op", "bf16-mixed", False, QLORA, "QLoRA"),
    ("small-llama", "fsdp2", "bf16-mixed", True, QLORA, "QLoRA"),
    ("small-llama", "fsdp2", "bf16-true", False, QLORA, "QLoRA: fp32 adapters, no MixedPrecisionPolicy"),
    ("small-llama", "fsdp2", "32-true", False, QLORA, "QLoRA: bf16 base, fp32 adapters"),
]
SEQ_LEN, MICRO = 128, 2


def measure(cell, work: Path, cache: Path) -> dict:
    model, strategy, precision, ckpt, extra, note = cell
    run_dir = work / f"{model}-{strategy}-{precision}-{ckpt}-{len(extra)}-{abs(hash(extra)) % 10**6}"
    attn = "eager" if model in NO_SDPA else "sdpa"
    argv = [sys.executable, "-m", "launcher", f"model={model}", "hardware=cpu", "gpus=2", f"strategy={strategy}",
            "mode=measure", "report=json", f"training.seq_len={SEQ_LEN}", f"training.micro_batch_size={MICRO}",
            f"training.precision={precision}", f"training.gradient_checkpointing={str(ckpt).lower()}",
            f"training.attn_implementation={attn}", "measure.memory_steps=2", "measure.timing_steps=0",
            "measure.warmup_steps=1", *extra, f"cache_dir={cache}", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    row = {"model": model, "strategy": strategy, "precision": precision, "ckpt": ckpt, "note": note}
    if proc.returncode != 0:
        return {**row, "failed": proc.stderr.strip().splitlines()[-1:]}
    result = json.loads((run_dir / "measure.json").read_text())
    mem = result["memory"]
    return {**row, "estimated": [r["estimated_peak_bytes"] for r in mem],
            "measured": [r["measured_peak_bytes"] for r in mem], "error": [r["error_percent"] for r in mem]}


def mib(values) -> str:
    values = [v / 2 ** 20 for v in values]
    return f"{values[0]:.3f}" if len(set(values)) == 1 else ", ".join(f"{v:.3f}" for v in values)


def table(rows: list[dict], tracker: list[dict], seconds: float) -> str:
    cpu = platform.processor() or platform.machine()
    out = [BEGIN, "## FSDP2 (fully_shard) and FSDP2 x tensor parallelism",
           "",
           f"From `scripts/fsdp2_accuracy.py`, {dt.date.today()}, 2 CPU processes (gloo), {cpu}, "
           f"Python {platform.python_version()}; {len(rows)} cells, {seconds / 60:.0f} min. Sequence {SEQ_LEN}, "
           f"micro-batch {MICRO}, AdamW (foreach). Estimated vs measured peak of live tensor bytes per rank "
           "(the worker's allocation tracker, `launcher/worker/storage_tracker.py`); the estimate is "
           "launcher/backends/fsdp2/layout.py on the traced step.",
           "",
           "| model | strategy | precision | ckpt | est. MiB (per rank if they differ) | meas. MiB (r0, r1) "
           "| mem err % (r0, r1) | note |",
           "|---|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        ckpt = "on" if r["ckpt"] else "off"
        if "failed" in r:
            out.append(f"| {r['model']} | {r['strategy']} | {r['precision']} | {ckpt} | - | - | - | failed: "
                       f"{' '.join(r['failed'])} |")
            continue
        err = ", ".join(f"{e:+.3f}" for e in r["error"])
        out.append(f"| {r['model']} | {r['strategy']} | {r['precision']} | {ckpt} | {mib(r['estimated'])} | "
                   f"{', '.join(f'{m / 2**20:.3f}' for m in r['measured'])} | {err} | {r['note']} |")
    ok = [abs(e) for r in rows if "error" in r for e in r["error"]]
    out += ["", f"Largest per-rank error: {max(ok):.3f}% over {len(ok)} rank peaks." if ok else "", "",
            "### Cross-check with torch's FSDPMemTracker", "",
            "`scripts/fsdp2_memtracker.py`: the same model and wrapping on rank 0 of a fake 2-rank process "
            "group (`FakeStore`: collectives move no data, FSDP2's allocations are real) under "
            "`torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`, peak of the third step, against "
            "the launcher's rank-0 estimate.", "",
            "| model | strategy | precision | ckpt | FSDPMemTracker MiB | est. MiB | err % |", "|---|---|---|---|---:|---:|---:|"]
    for r in tracker:
        out.append(f"| {r['model']} | {r['strategy']} | {r['precision']} | {'on' if r['gradient_checkpointing'] else 'off'} "
                   f"| {r['fsdp_mem_tracker_bytes'] / 2**20:.3f} | {r['estimated_bytes'] / 2**20:.3f} "
                   f"| {r['error_percent']:+.3f} |")
    out += ["", "Notes: on gloo the worker reduce-scatters by an in-place all-reduce "
            "(launcher/backends/fsdp2/worker.py `gloo_reduce_scatter`): gloo's own reduce-scatter reduces into a "
            "copy of its input that its worker thread frees at a scheduler-dependent moment. fsdp2_tp computes "
            "the loss with a vocab-parallel cross-entropy over explicit all-reduces "
            "(launcher/backends/fsdp2/loss.py); torch's `loss_parallel` keeps its temporaries inside DTensor's "
            "op handlers, which no allocation tracker on the CPU sees.", END]
    return "\n".join(out) + "\n"


def write_section(text: str) -> Path:
    path = ROOT / "docs" / "accuracy.md"
    doc = path.read_text()
    if BEGIN in doc and END in doc:
        doc = doc[:doc.index(BEGIN)] + text + doc[doc.index(END) + len(END) + 1:]
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    path.write_text(doc)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--print", action="store_true", help="print the section instead of writing it")
    parser.add_argument("--measured", default=None,
                        help="a log of an earlier run: reuse its measured cells (JSON lines) instead of re-running them")
    args = parser.parse_args()
    from scripts_fsdp2_memtracker import CELLS as TRACKER_CELLS, estimated_peak, measured_peak  # noqa: E402

    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cache = Path(args.cache_dir) if args.cache_dir else work / "cache"
        rows = []
        earlier = [json.loads(line) for line in Path(args.measured).read_text().splitlines()
                   if line.startswith("{") and '"measured"' in line] if args.measured else []
        for cell in ([] if earlier else CELLS):
            rows.append(measure(cell, work, cache))
            print(json.dumps(rows[-1]), flush=True)
        rows += earlier
        tracker = []
        for model, strategy, precision, ckpt in TRACKER_CELLS:
            m = measured_peak(model, strategy, precision, ckpt)
            e = estimated_peak(model, strategy, precision, ckpt, cache)
            tracker.append({"model": model, "strategy": strategy, "precision": precision, "gradient_checkpointing": ckpt,
                            "fsdp_mem_tracker_bytes": m, "estimated_bytes": e, "error_percent": 100 * (e - m) / m})
            print(json.dumps(tracker[-1]), flush=True)
    text = table(rows, tracker, time.time() - start)
    if args.print:
        print(text)
    else:
        print(f"wrote {write_section(text)}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "scripts"))
    import importlib

    sys.modules["scripts_fsdp2_memtracker"] = importlib.import_module("fsdp2_memtracker")
    main()

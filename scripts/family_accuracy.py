#!/usr/bin/env python
"""Every decoder family against real runs: `python -m launcher model=custom ... mode=measure` on 2
CPU processes for a tiny config of each family the catalogue holds (tied embeddings, learned and
rotary positions, ALiBi, parallel attention, multi-query and grouped-query attention, fused and
separate projections), with and without gradient checkpointing; prints the per-rank peak-memory
error and writes the table into docs/accuracy.md between the family markers.

    .venv/bin/python scripts/family_accuracy.py                      # ddp, fp32, ~4 minutes
    .venv/bin/python scripts/family_accuracy.py --cells ddp:32-true,fsdp2:bf16-mixed,zero3:bf16-mixed
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ACCURACY = ROOT / "docs" / "accuracy.md"
BEGIN, END = "<!-- family-accuracy:begin -->", "<!-- family-accuracy:end -->"
# DeepSpeed's default 5e8-element buckets would be ~1 GB beside a 3 MB model: small ones, as in
# scripts/accuracy_matrix.py, keep the model's own memory visible in the error
SMALL_BUCKETS = ["deepspeed.reduce_bucket_size=200000", "deepspeed.allgather_bucket_size=200000",
                 "deepspeed.stage3_prefetch_bucket_size=200000"]
COMMON = {"vocab_size": 320, "bos_token_id": 1, "eos_token_id": 2, "use_cache": False}
# 2 layers, hidden 64, 4 attention heads, vocabulary 320 (the byte-level tokenizer of the demo data);
# each family's own config keys, dropout off where the config has it.
FAMILIES = {
    "llama (GQA, RoPE)": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "max_position_embeddings": 512},
    "mistral (GQA, sliding window)": {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
                                      "num_hidden_layers": 2, "num_attention_heads": 4,
                                      "num_key_value_heads": 2, "max_position_embeddings": 512,
                                      "sliding_window": 32},
    "qwen2 (tied, qkv bias)": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 512, "tie_word_embeddings": True},
    "gemma (tied, GeGLU, head_dim)": {"model_type": "gemma", "hidden_size": 64, "intermediate_size": 128,
                                      "num_hidden_layers": 2, "num_attention_heads": 4,
                                      "num_key_value_heads": 1, "head_dim": 32,
                                      "max_position_embeddings": 512},
    "bloom (ALiBi, fused qkv)": {"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4,
                                 "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "opt (learned positions, tied)": {"model_type": "opt", "hidden_size": 64, "ffn_dim": 256,
                                      "num_hidden_layers": 2, "num_attention_heads": 4,
                                      "word_embed_proj_dim": 64, "max_position_embeddings": 512,
                                      "pad_token_id": 0, "dropout": 0.0, "attention_dropout": 0.0,
                                      "activation_dropout": 0.0, "do_layer_norm_before": True},
    "gpt2 (tied, Conv1D)": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512,
                            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "gpt_neo (local attention)": {"model_type": "gpt_neo", "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                                  "attention_types": [[["global", "local"], 1]], "window_size": 32,
                                  "max_position_embeddings": 512, "embed_dropout": 0.0,
                                  "attention_dropout": 0.0, "resid_dropout": 0.0},
    "gptj (parallel attention, partial RoPE)": {"model_type": "gptj", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                                "rotary_dim": 8, "n_positions": 512, "resid_pdrop": 0.0,
                                                "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "codegen (fused qkv, parallel)": {"model_type": "codegen", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                      "rotary_dim": 8, "n_positions": 512, "n_ctx": 512, "resid_pdrop": 0.0,
                                      "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "falcon (parallel attention, MQA)": {"model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 2,
                                         "num_attention_heads": 4, "multi_query": True,
                                         "parallel_attn": True, "new_decoder_architecture": False,
                                         "alibi": False, "bias": False, "hidden_dropout": 0.0,
                                         "attention_dropout": 0.0},
    "phi (parallel attention, partial RoPE)": {"model_type": "phi", "hidden_size": 64, "intermediate_size": 128,
                                               "num_hidden_layers": 2, "num_attention_heads": 4,
                                               "partial_rotary_factor": 0.5, "max_position_embeddings": 512,
                                               "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0},
    "biogpt (scaled embeddings)": {"model_type": "biogpt", "hidden_size": 64, "intermediate_size": 128,
                                   "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "max_position_embeddings": 512, "hidden_dropout_prob": 0.0,
                                   "attention_probs_dropout_prob": 0.0, "layerdrop": 0.0},
}


def measure(config_path: Path, strategy: str, precision: str, ckpt: bool, run_dir: Path) -> dict:
    argv = [sys.executable, "-m", "launcher", "model=custom", f"model.config_path={config_path}", "hardware=cpu",
            "gpus=2", f"strategy={strategy}", "mode=measure", "report=json", "training.seq_len=64",
            "training.micro_batch_size=2", f"training.precision={precision}",
            f"training.gradient_checkpointing={str(ckpt).lower()}", "measure.memory_steps=2",
            "measure.timing_steps=0", "measure.warmup_steps=1", f"hydra.run.dir={run_dir}",
            *(SMALL_BUCKETS if strategy.startswith("zero") else [])]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    result = json.loads((run_dir / "measure.json").read_text())
    return {"estimated": [row["estimated_peak_bytes"] for row in result["memory"]],
            "measured": [row["measured_peak_bytes"] for row in result["memory"]],
            "error": None, "errors": [row["error_percent"] for row in result["memory"]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="ddp:32-true", help="comma-separated strategy:precision pairs")
    ap.add_argument("--only", default="", help="families whose name contains this text")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for n, (name, cfg) in enumerate(FAMILIES.items()):
            if args.only not in name:
                continue
            path = Path(tmp) / f"family{n}.json"
            path.write_text(json.dumps({**COMMON, **cfg}))
            for strategy, precision in (c.split(":") for c in args.cells.split(",")):
                for ckpt in (False, True):
                    r = measure(path, strategy, precision, ckpt,
                                Path(tmp) / f"run{n}-{strategy}-{precision}-{int(ckpt)}")
                    cols = f"| {name} | {strategy} | {precision} | {'on' if ckpt else 'off'} |"
                    if r["error"]:
                        line = f"{cols} - | - | failed: {r['error']} |"
                    else:
                        worst = max([worst] + [abs(e) for e in r["errors"]])
                        mib = ", ".join(f"{b / 2**20:.3f}" for b in r["measured"])
                        line = (f"{cols} {r['estimated'][0] / 2**20:.3f} | {mib} | "
                                f"{', '.join(f'{e:+.3f}' for e in r['errors'])} |")
                    print(line, flush=True)
                    rows.append(line)
    table = [f"Measured {dt.date.today()} by `scripts/family_accuracy.py --cells {args.cells}`: tiny configs (2 layers, hidden 64, 4 heads, vocabulary 320) of every "
             "decoder family, 2 CPU processes, seq 64, micro-batch 2, `mode=measure`. Largest per-rank error: "
             f"{worst:.3f}%. DeepSpeed runs use 2e5-element buckets.", "",
             "| family | strategy | precision | ckpt | est. MiB | meas. MiB (r0, r1) | mem err % (r0, r1) |",
             "|---|---|---|---|---:|---:|---:|", *rows]
    print("\n".join(table[:1]))
    if not args.no_write and not args.only:
        text = ACCURACY.read_text()
        block = f"{BEGIN}\n## Every decoder family (tiny configs)\n\n" + "\n".join(table) + f"\n{END}"
        if BEGIN in text:
            text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
        else:
            text = text.rstrip("\n") + "\n\n" + block + "\n"
        ACCURACY.write_text(text)
        print(f"written: {ACCURACY.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time `launcher.trace.trace_set` on real model shapes, cold (empty cache) and warm.

    .venv/bin/python scripts/bench_trace.py                 # bloom-1b1 and llama-2-70b
    .venv/bin/python scripts/bench_trace.py --quick         # seq 1024, micro-batch 1 only
    .venv/bin/python scripts/bench_trace.py --check-depth   # + extrapolation vs full-depth trace

Cold = a fresh cache directory and an empty in-process memo (every trace is run);
warm-disk = the traces are read back from the cache files; warm-memo = in-process memo hits.
Peak = max of the depth-extrapolated per-phase maxima (forward, backward, optimizer).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher import trace as tr  # noqa: E402

# config.json values of the published checkpoints (bigscience/bloom-1b1, meta-llama/Llama-2-70b-hf)
MODELS = {
    "bloom-1b1": {"model_type": "bloom", "hidden_size": 1536, "n_head": 16, "n_layer": 24,
                  "vocab_size": 250880},
    "llama-2-70b": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
                    "num_hidden_layers": 80, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "vocab_size": 32000, "rms_norm_eps": 1e-5},
}
ATTN = {"bloom-1b1": "eager", "llama-2-70b": "sdpa"}  # bloom has no sdpa in transformers


def peak_bytes(ts) -> float:
    return max(ts.phase_max(ph) for ph in ("forward", "backward", "optimizer"))


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def bench(name: str, seq_len: int, micro_batch_size: int, cache_dir: Path) -> str:
    key = tr.TraceKey(tr.canonical_config_json(MODELS[name]), 1, micro_batch_size, seq_len,
                      param_dtype="bfloat16", attn_implementation=ATTN[name],
                      optimizer="adamw_fused")
    tr._MEMO.clear()
    ts, cold_s = timed(lambda: tr.trace_set(key, cache_dir=cache_dir))
    tr._MEMO.clear()
    _, disk_s = timed(lambda: tr.trace_set(key, cache_dir=cache_dir))
    _, memo_s = timed(lambda: tr.trace_set(key, cache_dir=cache_dir))
    fl = ts.at_depth(lambda t: t.flops["forward"] + t.flops["backward"])
    return (f"| {name} | {seq_len} | {micro_batch_size} | {cold_s:.2f} | {disk_s:.3f} | "
            f"{memo_s:.4f} | {peak_bytes(ts) / 2**30:.2f} | {fl / 1e12:.1f} |")


def check_depth(name: str, seq_len: int, checkpointing: bool, autocast) -> str:
    """Per-phase maxima extrapolated from depths 2 and 3 vs a direct trace at full depth, per
    segment (`TraceSet.phase_max`) and, in parentheses, for the whole phase at once."""
    key = tr.TraceKey(tr.canonical_config_json(MODELS[name]), 1, 1, seq_len,
                      param_dtype="float32" if autocast else "bfloat16", autocast_dtype=autocast,
                      attn_implementation=ATTN[name], gradient_checkpointing=checkpointing,
                      optimizer="adamw_foreach")
    ts = tr.trace_set(key, scale_batch=False, cache_dir=Path(tempfile.mkdtemp()))
    deep, deep_s = timed(lambda: tr.trace_step(dataclasses.replace(key, num_layers=ts.num_layers)))
    errs = []
    for ph in ("forward", "backward", "optimizer"):
        want = deep.phase_max(deep.live_curve(), ph)
        whole = ts.at_depth(lambda t: t.phase_max(t.live_curve(), ph))
        got = ts.phase_max(ph)
        errs.append(f"{(got - want) / want * 100:+.4f}% (whole phase {(whole - want) / want * 100:+.2f}%)")
    return (f"| {name} | {seq_len} | {checkpointing} | {autocast or 'bf16-true'} | "
            + " | ".join(errs) + f" | {deep_s:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--check-depth", action="store_true",
                    help="also compare depth extrapolation with a direct full-depth trace")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        run(args, Path(d))


def run(args, d: Path) -> None:
    tiny = dict(MODELS["llama-2-70b"], hidden_size=64, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=320)
    _, first_s = timed(lambda: tr.trace_step(tr.TraceKey(tr.canonical_config_json(tiny), 1, 1, 16)))
    print(f"first trace in this process (imports transformers' modeling code and "
          f"torch._dynamo): {first_s:.1f} s; not counted below\n")
    seqs, batches = ((1024,), (1,)) if args.quick else ((1024, 4096), (1, 4))
    print("| model | seq_len | micro_batch | cold_s | warm_disk_s | warm_memo_s | "
          "peak_gib (bf16, fused AdamW) | fwd+bwd TFLOP |")
    print("|---|---|---|---|---|---|---|---|")
    for name in MODELS:
        for seq in seqs:
            for b in batches:
                print(bench(name, seq, b, d / f"{name}-{seq}-{b}"), flush=True)
    if args.check_depth:
        print("\n| model | seq_len | checkpointing | precision | forward err | backward err | "
              "optimizer err | full-depth trace_s |")
        print("|---|---|---|---|---|---|---|---|")
        for name in MODELS:
            for gc in (False, True):
                for autocast in (None, "bfloat16"):
                    print(check_depth(name, 1024, gc, autocast), flush=True)


if __name__ == "__main__":
    main()

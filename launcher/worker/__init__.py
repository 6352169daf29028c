"""The per-rank training worker: what torchrun starts on every rank.

    torchrun --nproc-per-node 2 -m launcher.worker RUN_DIR/run.json

It reads the `RunSpec` (launcher/runspec.py), trains with the chosen backend (torch DDP or
DeepSpeed), measures each rank's peak memory, appends one JSON line per optimizer step to
RUN_DIR/metrics.jsonl, saves atomic checkpoints under RUN_DIR/checkpoints/ and writes
RUN_DIR/summary.json (measured peak vs the planner's estimate).

`python -m launcher.worker --check RUN_DIR/run.json` validates the inputs (dataset, tokenizer,
sequence length) without training, so a caller can report a bad input before starting torchrun.
A bad input is a `launcher.errors.ConfigError`: one line `error: ...` on stderr, exit code 2.

Modules: tokenizer (byte-level or HF), data (read, pack, deterministic sharded order),
model (build from the HF config), backends (DDP / DeepSpeed), memory (per-rank peak),
checkpoint (atomic save, verified resume), metrics (metrics.jsonl, summary.json), train (loop).
"""

#!/usr/bin/env python
"""Cross-check of the FSDP2 memory layout (launcher/backends/fsdp2/layout.py) with PyTorch's own
`FSDPMemTracker` (torch/distributed/_tools/fsdp2_mem_tracker.py).

Each cell builds the model for real (random weights) in one process, joins a fake process group of
2 ranks (`torch.testing._internal.distributed.fake_pg.FakeStore`: collectives return without
moving data, every allocation FSDP2 makes is real), wraps it as the worker does
(launcher/backends/fsdp2/worker.py: `fully_shard` per decoder block, then the root) and runs
steps under `FSDPMemTracker`; the peak of the last step is compared with the launcher's estimate
of rank 0.

    .venv/bin/python scripts/fsdp2_memtracker.py            # prints a markdown table
    .venv/bin/python scripts/fsdp2_memtracker.py --json     # one JSON object per cell
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (model, strategy, precision, gradient checkpointing); seq 128, micro-batch 2 (the accuracy cells)
CELLS = [("tiny-llama", "fsdp2", "32-true", False), ("tiny-llama", "fsdp2", "bf16-mixed", False),
         ("tiny-llama", "fsdp2_grad_op", "bf16-mixed", False), ("tiny-llama", "fsdp2", "bf16-mixed", True),
         ("tiny-bloom", "fsdp2", "32-true", False), ("small-llama", "fsdp2", "bf16-mixed", False),
         ("small-llama", "fsdp2_grad_op", "32-true", False)]
SEQ_LEN, MICRO, WORLD = 128, 2, 2
NO_SDPA = {"tiny-bloom", "small-bloom"}


def hf_config(model: str) -> dict:
    import yaml

    return yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())["hf_config"]


def measured_peak(model: str, strategy: str, precision: str, ckpt: bool, steps: int = 3) -> int:
    """Peak bytes FSDPMemTracker reports for the last of `steps` steps on rank 0 of 2."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM

    from launcher.backends.fsdp2.emit import plan_config
    from launcher.backends.fsdp2.rules import STRATEGIES, model_dtype
    from launcher.backends.fsdp2.worker import FSDP2Backend
    from launcher.runspec import RunSpec
    from launcher.worker.model import build_config

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        torch.manual_seed(0)
        attn = "eager" if model in NO_SDPA else "sdpa"
        net = AutoModelForCausalLM.from_config(build_config(hf_config(model)), dtype=getattr(torch, model_dtype(precision)),
                                               attn_implementation=attn)
        net.config.use_cache = False
        if ckpt:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        net.train()
        spec = RunSpec(run_dir="", backend="fsdp2", strategy=strategy, model_name=model, hf_config={},
                       framework_config=plan_config(STRATEGIES[strategy], precision, WORLD), optimizer="adamw_torch",
                       learning_rate=1e-3, weight_decay=0.0, warmup_steps=0, grad_accum_steps=1, max_grad_norm=0.0)
        meter = SimpleNamespace(phase=lambda name: _null(), track_external=lambda *a: None)
        backend = FSDP2Backend(net, spec, SimpleNamespace(world_size=WORLD, device="cpu"), None, meter)
        ids = torch.randint(0, net.config.vocab_size, (MICRO, SEQ_LEN))
        tracker = FSDPMemTracker(backend.model, backend.optimizer)
        with tracker:
            for step in range(steps):
                if step:
                    tracker.reset_mod_stats()  # one forward per module between resets (its own rule)
                if step == steps - 1:  # the peak of the last step only (launcher/worker/memory.py `_CpuMeter`)
                    snap = tracker.get_tracker_snapshot("current")
                    tracker._peak_mem_snap = snap
                    tracker._peak_mem = {dev: dev_snap["Total"] for dev, dev_snap in snap.items()}
                backend.micro_step(ids, True)
                backend.optimizer_step()
        return int(sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values()))
    finally:
        dist.destroy_process_group()


def _null():
    import contextlib

    return contextlib.nullcontext()


def estimated_peak(model: str, strategy: str, precision: str, ckpt: bool, cache_dir=None) -> int:
    """The launcher's rank-0 estimate."""
    from launcher import trace
    from launcher.backends.fsdp2.layout import fsdp2_layout, setup, trace_request
    from launcher.backends.fsdp2.rules import STRATEGIES
    from launcher.memory.estimate import _phase_totals
    from launcher.types import Workload

    strategy_ = STRATEGIES[strategy]
    wl = Workload(SEQ_LEN, MICRO, precision, "adamw_torch", ckpt, "eager" if model in NO_SDPA else "sdpa")
    config = hf_config(model)
    key = trace.TraceKey(hf_config_json=trace.canonical_config_json(config), num_layers=config.get(
        "num_hidden_layers", config.get("n_layer")), micro_batch_size=MICRO, seq_len=SEQ_LEN,
        attn_implementation=wl.attn_implementation, gradient_checkpointing=ckpt, **trace_request(strategy_, wl))
    traces = trace.trace_set(key, key.num_layers, cache_dir=cache_dir)
    layouts = [fsdp2_layout(t, setup(strategy_, wl, WORLD, 0)) for t in (traces.depth1, traces.depth2)]
    return int(_phase_totals(traces, layouts, None, {}, SimpleNamespace(device="cpu", sm_arch=0))[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    rows = []
    for model, strategy, precision, ckpt in CELLS:
        measured = measured_peak(model, strategy, precision, ckpt)
        estimated = estimated_peak(model, strategy, precision, ckpt, args.cache_dir)
        row = {"model": model, "strategy": strategy, "precision": precision, "gradient_checkpointing": ckpt,
               "fsdp_mem_tracker_bytes": measured, "estimated_bytes": estimated,
               "error_percent": 100 * (estimated - measured) / measured}
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    if not args.json:
        print("| model | strategy | precision | ckpt | FSDPMemTracker MiB | est. MiB | err % |")
        print("|---|---|---|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['model']} | {r['strategy']} | {r['precision']} | {'on' if r['gradient_checkpointing'] else 'off'} "
                  f"| {r['fsdp_mem_tracker_bytes'] / 2**20:.3f} | {r['estimated_bytes'] / 2**20:.3f} "
                  f"| {r['error_percent']:+.3f} |")


if __name__ == "__main__":
    main()

"""Moving a checkpoint between layouts: what the out-of-memory fallback needs when the next plan
shards the model differently (DDP -> ZeRO-3, ZeRO-2 -> ColossalAI tensor parallel, ...).

A checkpoint's layout (`layout.json`: backend, strategy, world size) says who can read it
natively: the same backend and strategy on the same number of ranks. Any other plan reads the
layout-neutral form, torch's own: `model.pt` (the unwrapped model's full state_dict),
`optimizer.pt` (a torch optimizer state_dict whose parameter ids are the model's trainable
parameters in `model.parameters()` order, full tensors), `scheduler.pt` (LambdaLR state).

- DDP checkpoints are that form already; ColossalAI's are too: its booster writes them unsharded
  (`booster.save_model/save_optimizer(shard=False)` gathers ZeRO and tensor-parallel shards).
- DeepSpeed checkpoints are converted with DeepSpeed's own tools (its Backend.to_neutral,
  launcher/backends/deepspeed/checkpoint.py): the fp32 weights
  with `get_fp32_state_dict_from_zero_checkpoint` (zero_to_fp32), the optimizer's moments and
  step with `ds_to_universal` (universal checkpoint: one full tensor per parameter and state).
- Reading the neutral form: every backend loads the weights into the model before it wraps it;
  DDP loads the optimizer state_dict, ColossalAI through `booster.load_optimizer` (which
  partitions it for ZeRO and tensor parallelism), DeepSpeed through
  `deepspeed.utils.safe_set_full_optimizer_state` per parameter (launcher/worker/backends.py).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from launcher.backends import registry
from launcher.worker import checkpoint
from launcher.worker.checkpoint import LAYOUT_FILE

MODEL, OPTIMIZER, SCHEDULER = "model.pt", "optimizer.pt", "scheduler.pt"


def layout_of(spec, world_size: int) -> dict:
    return {"backend": spec.backend, "strategy": spec.strategy, "world_size": world_size}


def read_layout(directory: Path) -> Optional[dict]:
    path = Path(directory) / LAYOUT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def same_layout(a: Optional[dict], b: dict) -> bool:
    """Checkpoints written before layout.json existed are read natively, as before."""
    return a is None or all(a.get(k) == b[k] for k in ("backend", "strategy", "world_size"))


def is_neutral(layout: Optional[dict]) -> bool:
    """Its checkpoint is torch's own form: the converted 'neutral' one, or a backend that writes no
    other (its Backend.to_neutral is None: DDP, ColossalAI's unsharded booster files)."""
    if layout is None:
        return False
    backend = registry.REGISTRY.get(layout["backend"])
    return layout["backend"] == "neutral" or (backend is not None and not backend.to_neutral)


def load_neutral_weights(model, directory: Path) -> None:
    """The full state_dict into the unwrapped model, before any backend wraps it."""
    import torch

    state = torch.load(Path(directory) / MODEL, map_location="cpu", weights_only=True)
    load_model_state(model, state)


def four_bit_weights(model) -> set:
    """Names of the model's bitsandbytes 4-bit weights (`Params4bit`, QLoRA's frozen base)."""
    return {name for name, p in model.named_parameters() if type(p).__name__ == "Params4bit"}


def model_state(model) -> dict:
    """The model's state_dict without its frozen 4-bit weights (`load_model_state`)."""
    frozen = four_bit_weights(model)
    return {k: v for k, v in model.state_dict().items() if not _of(k, frozen)}


def load_model_state(model, state: dict) -> None:
    """`model.load_state_dict(state)`, strict, except for QLoRA's frozen 4-bit weights. bitsandbytes
    saves each one's QuantState under extra keys (`weight.absmax`, `weight.quant_map`, ...;
    bitsandbytes/nn/modules.py `Linear4bit._save_to_state_dict`) that no `_load_from_state_dict`
    takes back, so a strict load of its own state_dict fails. They never change in training and the
    resumed run rebuilds them as the first run did (the same initialization or checkpoint, then the
    same quantization), so they are neither saved (`model_state`) nor loaded; every other entry must
    match."""
    frozen = four_bit_weights(model)
    if not frozen:
        model.load_state_dict(state)
        return
    result = model.load_state_dict({k: v for k, v in state.items() if not _of(k, frozen)}, strict=False)
    missing = [k for k in result.missing_keys if not _of(k, frozen)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"checkpoint does not match the model: missing {missing[:3]}, "
                           f"unexpected {result.unexpected_keys[:3]}")


def _of(key: str, weights: set) -> bool:
    """Whether state_dict `key` is one of `weights` or an entry saved under it."""
    return key in weights or key.rsplit(".", 1)[0] in weights or key.split(".quant_state.")[0] in weights


def neutral_optimizer(directory: Path) -> dict:
    import torch

    return torch.load(Path(directory) / OPTIMIZER, map_location="cpu", weights_only=True)


def neutral_scheduler(directory: Path) -> dict:
    import torch

    return torch.load(Path(directory) / SCHEDULER, map_location="cpu", weights_only=True)


def to_neutral(src: Path, dst: Path) -> None:
    """Write the layout-neutral form of checkpoint `src` into `dst` (a new directory), with its
    trainer state and RNG states, as a complete checkpoint whose layout is 'neutral'."""
    layout = read_layout(src) or {}
    dst.mkdir(parents=True)
    backend = registry.REGISTRY.get(layout.get("backend"))
    if backend is not None and backend.to_neutral:  # e.g. DeepSpeed's own converters
        registry.load(backend.to_neutral)(src, dst)
    else:
        for name in (MODEL, OPTIMIZER, SCHEDULER):
            shutil.copy2(src / name, dst / name)
    for path in src.glob("rng-rank*.pkl"):
        shutil.copy2(path, dst / path.name)
    shutil.copy2(src / checkpoint.TRAINER_FILE, dst / checkpoint.TRAINER_FILE)
    (dst / checkpoint.LAYOUT_FILE).write_text(json.dumps({**layout, "backend": "neutral", "from": str(src)}) + "\n")
    checkpoint.write_marker(dst, checkpoint.TrainerState.read(src).step)

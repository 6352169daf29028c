"""Moving a checkpoint between layouts: what the out-of-memory fallback needs when the next plan
shards the model differently (DDP -> ZeRO-3, ZeRO-2 -> ColossalAI tensor parallel, ...).

A checkpoint's layout (`layout.json`: backend, strategy, world size) says who can read it
natively: the same backend and strategy on the same number of ranks. Any other plan reads the
layout-neutral form, torch's own: `model.pt` (the unwrapped model's full state_dict),
`optimizer.pt` (a torch optimizer state_dict whose parameter ids are the model's trainable
parameters in `model.parameters()` order, full tensors), `scheduler.pt` (LambdaLR state).

- DDP checkpoints are that form already; ColossalAI's are too: its booster writes them unsharded
  (`booster.save_model/save_optimizer(shard=False)` gathers ZeRO and tensor-parallel shards).
- DeepSpeed checkpoints are converted with DeepSpeed's own tools (`to_neutral`): the fp32 weights
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
import tempfile
from pathlib import Path
from typing import Optional

NEUTRAL_BACKENDS = ("ddp", "colossalai", "neutral")
MODEL, OPTIMIZER, SCHEDULER = "model.pt", "optimizer.pt", "scheduler.pt"


def layout_of(spec, world_size: int) -> dict:
    return {"backend": spec.backend, "strategy": spec.strategy, "world_size": world_size}


def read_layout(directory: Path) -> Optional[dict]:
    from launcher.worker.checkpoint import LAYOUT_FILE

    path = Path(directory) / LAYOUT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def same_layout(a: Optional[dict], b: dict) -> bool:
    """Checkpoints written before layout.json existed are read natively, as before."""
    return a is None or all(a.get(k) == b[k] for k in ("backend", "strategy", "world_size"))


def is_neutral(layout: Optional[dict]) -> bool:
    return layout is not None and layout["backend"] in NEUTRAL_BACKENDS


def load_neutral_weights(model, directory: Path) -> None:
    """The full state_dict into the unwrapped model, before any backend wraps it."""
    import torch

    state = torch.load(Path(directory) / MODEL, map_location="cpu", weights_only=True)
    model.load_state_dict(state)


def neutral_optimizer(directory: Path) -> dict:
    import torch

    return torch.load(Path(directory) / OPTIMIZER, map_location="cpu", weights_only=True)


def neutral_scheduler(directory: Path) -> dict:
    import torch

    return torch.load(Path(directory) / SCHEDULER, map_location="cpu", weights_only=True)


# ---- DeepSpeed -> neutral (runs in the launcher, one process) ------------------------------

def _deepspeed_to_neutral(src: Path, dst: Path) -> None:
    import torch

    from launcher.backends.deepspeed.worker import DS_TAG

    ds_dir = src / DS_TAG
    model_file = min(ds_dir.glob("*mp_rank_00_model_states.pt"))  # ZeRO-3: zero_pp_rank_0_mp_rank_00_...
    states = torch.load(model_file, map_location="cpu", weights_only=False)
    torch.save(states["lr_scheduler"], dst / SCHEDULER)
    if states.get("optimizer") is not None:  # ZeRO-0: the torch optimizer and the module, unpartitioned
        torch.save(states["module"], dst / MODEL)
        torch.save(states["optimizer"], dst / OPTIMIZER)
        return
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    weights = get_fp32_state_dict_from_zero_checkpoint(str(src), tag=DS_TAG)
    module = {**(states.get("module") or {}), **weights}
    torch.save(module, dst / MODEL)
    shapes = {name: shape for group in states["param_shapes"] for name, shape in group.items()}
    torch.save(_universal_optimizer(ds_dir, shapes), dst / OPTIMIZER)


def _base_step(ds_dir: Path):
    """The torch optimizer's step count, from rank 0's ZeRO optimizer file (ZeRO-3's universal
    checkpoint has no step.pt)."""
    import torch

    saved = torch.load(min(ds_dir.glob("*rank_0_*optim_states.pt")), map_location="cpu", weights_only=False)
    return next(iter(saved["optimizer_state_dict"]["optimizer_state_dict"]["state"].values()))["step"]


def _universal_optimizer(ds_dir: Path, shapes: dict) -> dict:
    """A torch optimizer state_dict from DeepSpeed's universal checkpoint of `ds_dir`."""
    import argparse

    import torch
    from deepspeed.checkpoint import ds_to_universal

    with tempfile.TemporaryDirectory(prefix="universal-") as tmp:
        args = argparse.Namespace(input_folder=str(ds_dir), output_folder=str(Path(tmp) / "out"),
                                  num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                  strict=True, inject_missing_state=True)
        ds_to_universal.main(args)
        zero = Path(tmp) / "out" / "zero"
        groups = torch.load(zero / "optimizer_state.pt", map_location="cpu", weights_only=False)["param_groups"]
        state, step = {}, None
        for index, (name, shape) in enumerate(shapes.items()):
            entry = {}
            for file in sorted((zero / name).glob("*.pt")):
                if file.stem != "fp32":  # the weights come from zero_to_fp32
                    value = torch.load(file, map_location="cpu", weights_only=False)
                    value = value["param"] if isinstance(value, dict) else value
                    entry[file.stem] = value if file.stem == "step" else value.reshape(shape)
            if "step" not in entry:
                step = _base_step(ds_dir) if step is None else step
                entry["step"] = step.clone()
            state[index] = entry
    group = {k: v for k, v in groups[0].items() if k != "params"}
    return {"state": state, "param_groups": [{**group, "params": list(range(len(shapes)))}]}


def to_neutral(src: Path, dst: Path) -> None:
    """Write the layout-neutral form of checkpoint `src` into `dst` (a new directory), with its
    trainer state and RNG states, as a complete checkpoint whose layout is 'neutral'."""
    from launcher.worker import checkpoint

    layout = read_layout(src) or {}
    dst.mkdir(parents=True)
    if layout.get("backend") == "deepspeed":
        _deepspeed_to_neutral(src, dst)
    else:
        for name in (MODEL, OPTIMIZER, SCHEDULER):
            shutil.copy2(src / name, dst / name)
    for path in src.glob("rng-rank*.pkl"):
        shutil.copy2(path, dst / path.name)
    shutil.copy2(src / checkpoint.TRAINER_FILE, dst / checkpoint.TRAINER_FILE)
    (dst / checkpoint.LAYOUT_FILE).write_text(json.dumps({**layout, "backend": "neutral", "from": str(src)}) + "\n")
    checkpoint.write_marker(dst, checkpoint.TrainerState.read(src).step)

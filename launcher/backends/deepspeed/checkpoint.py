"""A DeepSpeed checkpoint in torch's layout-neutral form (launcher/worker/layout.py), with DeepSpeed's
own tools: the fp32 weights with `get_fp32_state_dict_from_zero_checkpoint` (zero_to_fp32), the
optimizer's moments and step with `ds_to_universal` (one full tensor per parameter and state).
Runs in the launcher, one process."""
from __future__ import annotations

import tempfile
from pathlib import Path

from launcher.worker.layout import MODEL, OPTIMIZER, SCHEDULER

DS_TAG = "deepspeed"  # the tag directory DeepSpeed checkpoints are saved under (worker.py)


def to_neutral(src: Path, dst: Path) -> None:
    import torch

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

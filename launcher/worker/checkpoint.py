"""Atomic, verifiable checkpoints under RUN_DIR/checkpoints/.

Layout of `step-N/`: the backend's state (DDP: model.pt, optimizer.pt, scheduler.pt written by
rank 0; DeepSpeed: its own `deepspeed/` tree written by every rank), `trainer.json` (step, data
position, world size), `rng-rank{R}.pkl` (torch, python, numpy and cuda RNG states of rank R),
and `COMPLETE`, written last: a JSON list of every other file with its size in bytes.

Saving writes into `.tmp-step-N/`, and only after every rank has finished and the marker is
written does rank 0 `os.replace` it to `step-N/` (a rename is atomic on POSIX), so a crash never
leaves a `step-N/` that looks complete. Loading re-checks the marker: a missing marker, a
missing file or a size mismatch marks the checkpoint corrupt.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from launcher.errors import ConfigError

MARKER = "COMPLETE"
TRAINER_FILE = "trainer.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class TrainerState:
    step: int  # optimizer steps completed
    data_position: int  # next global sample position
    world_size: int


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def rng_state(device: str) -> dict:
    import numpy as np
    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if device == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def file_sizes(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MARKER}


def write_marker(directory: Path, step: int) -> None:
    tmp = directory / (MARKER + ".tmp")
    tmp.write_text(json.dumps({"step": step, "files": file_sizes(directory)}, indent=1))
    os.replace(tmp, directory / MARKER)


def verify(directory: Path) -> Optional[str]:
    """None when the checkpoint is complete, else what is wrong with it."""
    marker = directory / MARKER
    if not marker.is_file():
        return "no COMPLETE marker"
    try:
        listed = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError):
        return "unreadable COMPLETE marker"
    for name, size in listed.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, expected {size}"
    if TRAINER_FILE not in listed:
        return f"{TRAINER_FILE} is missing"
    return None


def save(backend, run_dir: str | Path, state: TrainerState, rank: int, device: str, keep: int) -> Path:
    """Collective: every rank calls it. Returns the final directory."""
    root = checkpoint_root(run_dir)
    tmp, final = root / f".tmp-step-{state.step}", root / f"step-{state.step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    backend.save(tmp, rank)
    with open(tmp / f"rng-rank{rank}.pkl", "wb") as f:
        pickle.dump(rng_state(device), f)
    if rank == 0:
        (tmp / TRAINER_FILE).write_text(json.dumps(asdict(state)) + "\n")
    _barrier()
    if rank == 0:
        write_marker(tmp, state.step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        prune(root, keep)
    _barrier()
    return final


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step-N directory, newest first."""
    found = [(int(m.group(1)), p) for p in root.glob("step-*") if (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints (all when keep <= 0)."""
    if keep > 0:
        for _, path in step_dirs(root)[keep:]:
            shutil.rmtree(path, ignore_errors=True)


def find_resume_dir(run_dir: str | Path, resume, warn: bool) -> Optional[Path]:
    """`resume=True`: the newest complete checkpoint (corrupt ones skipped with a warning), or
    None when there is none. A string names one checkpoint (a path, or `step-N` under
    RUN_DIR/checkpoints); it must be complete."""
    if not resume:
        return None
    root = checkpoint_root(run_dir)
    if isinstance(resume, str):
        path = Path(resume) if Path(resume).is_dir() else root / resume
        if not path.is_dir():
            raise ConfigError(f"checkpoint {resume} does not exist")
        problem = verify(path)
        if problem:
            raise ConfigError(f"checkpoint {path} is corrupt: {problem}")
        return path
    for _, path in step_dirs(root):
        problem = verify(path)
        if problem is None:
            return path
        if warn:
            print(f"warning: skipping corrupt checkpoint {path}: {problem}", file=sys.stderr, flush=True)
    if warn:
        print(f"warning: resume requested but no complete checkpoint in {root}; starting from step 0",
              file=sys.stderr, flush=True)
    return None


def load(backend, directory: Path, rank: int) -> TrainerState:
    """Restore backend state, this rank's RNG state and the trainer state from `directory`."""
    state = TrainerState(**json.loads((directory / TRAINER_FILE).read_text()))
    backend.load(directory)
    rng_file = directory / f"rng-rank{rank}.pkl"
    if rng_file.is_file():
        with open(rng_file, "rb") as f:
            set_rng_state(pickle.load(f))
    return state

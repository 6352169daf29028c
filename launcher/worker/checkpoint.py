"""Atomic, verifiable checkpoints under RUN_DIR/checkpoints/.

Layout of `step-N/`: the backend's state (DDP: model.pt, optimizer.pt, scheduler.pt written by
rank 0; DeepSpeed: its own `deepspeed/` tree written by every rank), `trainer.json` (step, data
position, world size), `rng-rank{R}.pkl` (torch, python, numpy and cuda RNG states of rank R),
`layout.json` (what wrote it: backend, strategy, world size; launcher/worker/layout.py) and
`COMPLETE`, written last: every other file with its size in bytes and CRC-32.

Saving writes into `.tmp-step-N/`, and only after every rank has finished and the marker is
written does rank 0 `os.replace` it to `step-N/` (a rename is atomic on POSIX), so a crash never
leaves a `step-N/` that looks complete; the previous complete checkpoint is only pruned after
that. Loading re-checks the marker: a missing marker, a missing file, a size or CRC-32 mismatch
marks the checkpoint corrupt, and resuming takes the newest one that is complete.

A write that fails for lack of space (ENOSPC, EDQUOT) removes the partial `.tmp-step-N/` and
raises `DiskFullError`: the worker reports it in one line and exits with DISK_FULL_EXIT_CODE;
earlier checkpoints are untouched.

Testing aids (unset in normal use): LAUNCHER_TEST_KILL_IN_SAVE_AT_STEP=N makes the last rank
SIGKILL itself in the middle of writing checkpoint N (first run only, not after a restart);
LAUNCHER_TEST_DISK_FULL_AT_STEP=N makes rank 0's write of checkpoint N fail with ENOSPC.
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
import signal
import sys
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from launcher.errors import ConfigError

MARKER = "COMPLETE"
TRAINER_FILE = "trainer.json"
LAYOUT_FILE = "layout.json"
DISK_FULL_EXIT_CODE = 5
KILL_IN_SAVE_ENV = "LAUNCHER_TEST_KILL_IN_SAVE_AT_STEP"
DISK_FULL_ENV = "LAUNCHER_TEST_DISK_FULL_AT_STEP"
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class TrainerState:
    step: int  # optimizer steps completed
    data_position: int  # next global sample position
    world_size: int

    @classmethod
    def read(cls, directory: Path) -> "TrainerState":
        data = json.loads((directory / TRAINER_FILE).read_text())
        return cls(data["step"], data["data_position"], data["world_size"])


class DiskFullError(OSError):
    """No space (or quota) left while writing a checkpoint; the message says what was kept."""


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


def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            value = zlib.crc32(chunk, value)
    return value


def file_sizes(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size
            for p in sorted(directory.rglob("*")) if p.is_file() and not p.name.startswith(MARKER)}


def write_marker(directory: Path, step: int) -> None:
    sizes = file_sizes(directory)
    tmp = directory / (MARKER + ".tmp")
    tmp.write_text(json.dumps({"step": step, "files": sizes,
                               "crc32": {name: crc32(directory / name) for name in sizes}}, indent=1))
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
    for name, value in json.loads(marker.read_text()).get("crc32", {}).items():
        if crc32(directory / name) != value:
            return f"{name} does not match its CRC-32 (corrupt)"
    if TRAINER_FILE not in listed:
        return f"{TRAINER_FILE} is missing"
    return None


def _test_env_step(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value else None


def _test_faults(step: int, rank: int, world_size: int) -> None:
    """The testing aids of the module docstring, between the backend's files and the marker."""
    first_run = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_run and _test_env_step(KILL_IN_SAVE_ENV) == step and rank == world_size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if _test_env_step(DISK_FULL_ENV) == step and rank == 0:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "trainer.json")


def _write(backend, tmp: Path, state: TrainerState, rank: int, device: str, layout: dict) -> None:
    import torch.distributed as dist

    backend.save(tmp, rank)
    _test_faults(state.step, rank, dist.get_world_size() if dist.is_initialized() else 1)
    with open(tmp / f"rng-rank{rank}.pkl", "wb") as f:
        pickle.dump(rng_state(device), f)
    if rank == 0:
        (tmp / TRAINER_FILE).write_text(json.dumps(asdict(state)) + "\n")
        (tmp / LAYOUT_FILE).write_text(json.dumps(layout) + "\n")


def save(backend, run_dir: str | Path, state: TrainerState, rank: int, device: str, keep: int,
         layout: Optional[dict] = None) -> Path:
    """Collective: every rank calls it. Returns the final directory."""
    root = checkpoint_root(run_dir)
    tmp, final = root / f".tmp-step-{state.step}", root / f"step-{state.step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    try:
        _write(backend, tmp, state, rank, device, layout or {})
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        kept = [p.name for _, p in step_dirs(root) if verify(p) is None]
        raise DiskFullError(err.errno, f"no space left on the device writing checkpoint step-{state.step} in "
                            f"{root} ({err.strerror}); the partial copy was removed and "
                            + (f"the previous checkpoint {kept[0]} is intact" if kept else "no earlier checkpoint exists")
                            + f"; free space, then continue with resume={Path(run_dir)}") from None
    _barrier()
    if rank == 0:
        write_marker(tmp, state.step)
        old = root / f".old-step-{state.step}"
        if final.exists():  # the same step saved again after a resume: keep it until the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
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
    state = TrainerState.read(directory)
    backend.load(directory)
    restore_rng(directory, rank)
    return state


def restore_rng(directory: Path, rank: int) -> None:
    rng_file = directory / f"rng-rank{rank}.pkl"
    if rng_file.is_file():
        with open(rng_file, "rb") as f:
            set_rng_state(pickle.load(f))

"""Stopping a rank early on a signal, with a checkpoint: preemption and time limits on Slurm.

Slurm warns a job before its time limit with the `--signal` it was submitted with (submitit:
USR2, `signal_delay_s` before the end) and preempts with SIGTERM first. Each rank records the
request (SIGUSR1, SIGUSR2 or SIGTERM); the training loop all-reduces the flag with the step's
loss, so every rank stops after the same step. That step is checkpointed, rank 0 writes
RUN_DIR/stopped.json (step and checkpoint) and every rank exits with STOPPED_EXIT_CODE. The
requeued job continues from that checkpoint (launcher/slurm_job.py).

SIGTERM is handled only when STOP_ON_SIGTERM_ENV=1 (set for Slurm jobs): elsewhere torchrun
stops the other ranks with SIGTERM when one fails, and they should leave at once. A rank that
received SIGTERM leaves after STOP_GRACE_S even if the step never ends (a peer that died holds
the collective), before torchrun's own 30 s grace runs out.
"""
from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

STOPPED_EXIT_CODE = 4
STOP_FILE = "stopped.json"
STOP_GRACE_S = 25.0
STOP_ON_SIGTERM_ENV = "LAUNCHER_STOP_ON_SIGTERM"
_requested: list[str] = []


def requested() -> bool:
    return bool(_requested)


def _handle(signum, frame) -> None:
    name = signal.Signals(signum).name
    _requested.append(name)
    if name == "SIGTERM":
        timer = threading.Timer(STOP_GRACE_S, os._exit, args=(128 + signum,))
        timer.daemon = True
        timer.start()


def install_handlers() -> None:
    names = ["SIGUSR1", "SIGUSR2"] + (["SIGTERM"] if os.environ.get(STOP_ON_SIGTERM_ENV) == "1" else [])
    for name in names:
        signal.signal(getattr(signal, name), _handle)


def write_marker(run_dir: str | Path, step: int, checkpoint: Path) -> Path:
    path = Path(run_dir) / STOP_FILE
    path.write_text(json.dumps({"step": step, "checkpoint": str(checkpoint), "signals": sorted(set(_requested))})
                    + "\n")
    return path


def read_marker(run_dir: str | Path) -> dict | None:
    path = Path(run_dir) / STOP_FILE
    return json.loads(path.read_text()) if path.is_file() else None

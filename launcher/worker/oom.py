"""Out-of-memory on a rank: recognise it, record what was measured, and exit with a code the
launcher recognises, so it can relaunch with a candidate that needs less memory
(launcher/fallback.py).

What counts as out of memory: `torch.OutOfMemoryError` (`torch.cuda.OutOfMemoryError` is the
same class since torch 2.5), and on CPU a `RuntimeError` from the allocator, whose message
contains "out of memory" or "DefaultCPUAllocator: can't allocate" (c10/core/impl/alloc_cpu.cpp).

Each rank that runs out writes RUN_DIR/oom-rank{R}.json and leaves with `os._exit(OOM_EXIT_CODE)`:
the other ranks may be blocked in a collective, so a normal shutdown could hang; torchrun stops
them when one rank exits.

Testing aid: with LAUNCHER_SIMULATE_OOM_ABOVE_BYTES=N (set from `worker.simulate_oom_above_bytes`)
a step whose measured peak exceeds N bytes raises `torch.OutOfMemoryError`, as a device with
N bytes would, so the whole path can be exercised on CPU. With LAUNCHER_SIMULATE_OOM_FROM_STEP=K
as well, only steps K and later are held to that capacity (a run that fails in the middle).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

OOM_EXIT_CODE = 3
SIMULATE_ENV = "LAUNCHER_SIMULATE_OOM_ABOVE_BYTES"
SIMULATE_FROM_STEP_ENV = "LAUNCHER_SIMULATE_OOM_FROM_STEP"
_CPU_MESSAGES = ("out of memory", "DefaultCPUAllocator: can't allocate")


@dataclass
class Progress:
    """Where a rank is: updated by the training loop, read when it runs out of memory."""

    step: int = 0  # the optimizer step being run (0 = setup)
    records: list = field(default_factory=list)  # metrics records of the completed steps
    failed_peak_bytes: Optional[int] = None  # this rank's peak in the failing step, when known


def is_oom(err: BaseException) -> bool:
    import torch

    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in _CPU_MESSAGES)


def simulated_cap_bytes() -> Optional[int]:
    value = os.environ.get(SIMULATE_ENV)
    return int(value) if value else None


def check_simulated(peak, progress: Progress) -> None:
    """Raise torch.OutOfMemoryError when the step's measured peak exceeds the simulated capacity."""
    cap = simulated_cap_bytes()
    if cap is None or peak is None or peak.allocated_bytes <= cap:
        return
    if progress.step < int(os.environ.get(SIMULATE_FROM_STEP_ENV) or 0):
        return
    import torch

    progress.failed_peak_bytes = peak.allocated_bytes
    raise torch.OutOfMemoryError(f"out of memory (simulated): step {progress.step} peaked at "
                                 f"{peak.allocated_bytes} bytes in {peak.phase} > {SIMULATE_ENV}={cap}")


def _device_peak_bytes(device: str) -> Optional[int]:
    if device != "cuda":
        return None
    import torch

    return int(torch.cuda.max_memory_allocated())


def oom_files(run_dir: str | Path) -> list[Path]:
    return sorted(Path(run_dir).glob("oom-rank*.json"))


def exit_after_oom(spec, rank: int, device: str, progress: Progress, err: BaseException) -> None:
    """Write RUN_DIR/oom-rank{R}.json (measured numbers next to the estimate) and exit."""
    last = progress.records[-1] if progress.records else {}
    report = {
        "rank": rank,
        "step": progress.step,
        "error": str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__,
        "peak_allocated_bytes": progress.failed_peak_bytes or _device_peak_bytes(device),
        "completed_steps": len(progress.records),
        "last_completed_step_peak_allocated_bytes": last.get("peak_allocated_bytes"),
        "estimate": spec.estimate,
    }
    path = Path(spec.run_dir) / f"oom-rank{rank}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"error: rank {rank} ran out of memory at step {progress.step}: {report['error']}; "
          f"measured numbers in {path}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(OOM_EXIT_CODE)


def exit_if_oom_before_restart(spec, rank: int, restart_count: int) -> None:
    """After an elastic restart of a run that ran out of memory, fail again at once: the same
    layout would only run out again (the launcher's fallback picks a smaller candidate)."""
    if restart_count > 0 and oom_files(spec.run_dir):
        if rank == 0:
            print(f"error: not restarting: this run ran out of memory (see {oom_files(spec.run_dir)[0]})",
                  file=sys.stderr, flush=True)
        os._exit(OOM_EXIT_CODE)

"""gloo on CPU processes: a collective's `wait()` can return while gloo's worker thread still
references the work, and through it the work's tensors. ProcessGroupGloo's `runLoop` resets its
reference to a finished work (`workInProgress_[i].reset()`) only after `AsyncWork::execute` has
completed it (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp), so a buffer the caller frees can
outlive its last use by a scheduling accident. NCCL holds no such reference after `wait()`
(ProcessGroupNCCL.cpp `WorkNCCL::synchronizeStream` unstashes the tensors). Waiting for gloo's
thread makes a CPU run hold what a GPU run holds (launcher/backends/colossalai/cpu.py,
launcher/backends/fsdp2/worker.py `gloo_all_gather`)."""
from __future__ import annotations

SETTLE_TIMEOUT_S = 1.0


def settle(tensors, counts) -> None:
    """Wait until each tensor's reference count is at most its `counts` entry, the count it had
    before a blocking collective (an async one is run blocking: launcher/backends/colossalai/cpu.py
    `_SettledCollectives`), i.e. until gloo's worker thread has dropped the work; at most
    SETTLE_TIMEOUT_S."""
    import time

    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while any(t._use_count() > c for t, c in zip(tensors, counts)) and time.monotonic() < deadline:
        time.sleep(0)

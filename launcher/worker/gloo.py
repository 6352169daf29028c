"""gloo on CPU processes: a collective's `wait()` can return while gloo's worker thread still
references the work, and through it the work's tensors. ProcessGroupGloo's `runLoop` resets its
reference to a finished work (`workInProgress_[i].reset()`) only after `AsyncWork::execute` has
completed it (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp), so a buffer the caller frees can
outlive its last use by a scheduling accident. NCCL holds no such reference after `wait()`
(ProcessGroupNCCL.cpp `WorkNCCL::synchronizeStream` unstashes the tensors). Waiting for gloo's
thread makes a CPU run hold what a GPU run holds (launcher/backends/colossalai/cpu.py,
launcher/backends/fsdp2/worker.py `gloo_all_gather`).

gloo's thread holds a tensor twice over: C++ references to the tensor (`Tensor._use_count()`) and,
for a while after those are gone, a Python reference to its Python object (`sys.getrefcount`).
Measured on one gloo rank (torch 2.13, a blocking 32 KiB all-reduce, the caller spinning with the
GIL held once the C++ count is back): 13 of 3,000 calls still had the Python count raised by one.
gloo's thread needs the GIL to drop that reference, so when the caller then drops its own, the
tensor is freed on gloo's thread (its `comm` is pt_gloo_runloop) whenever it next gets the GIL: in
a tensor-parallel BLOOM run, past the backward peak on one rank in 11 of 62 runs here (each of the
11 while other test processes ran), one activation gradient (32,768 bytes) above the estimate.
Settling waits for both counts: 0 of 20 runs since, under the same load."""
from __future__ import annotations

import sys

SETTLE_TIMEOUT_S = 1.0


def references(tensors) -> list[tuple[int, int]]:
    """Each tensor's (C++ use count, Python reference count), read the same way before a
    collective and while settling it, so the caller's own references cancel out."""
    return [(t._use_count(), sys.getrefcount(t)) for t in tensors]


def settle(tensors, before) -> None:
    """Wait until every tensor's counts (`references`) are at most `before`, read before a
    blocking collective (an async one is run blocking: launcher/backends/colossalai/cpu.py
    `_SettledCollectives`), i.e. until gloo's worker thread has dropped the work and the Python
    reference it held; at most SETTLE_TIMEOUT_S. `time.sleep(0)` lets gloo's thread take the GIL."""
    import time

    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline and any(
            now[0] > was[0] or now[1] > was[1] for now, was in zip(references(tensors), before)):
        time.sleep(0)

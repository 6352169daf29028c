"""Peak reserved bytes of a strategy layout: its allocation sequence replayed through the caching
allocator simulator (allocator.py), in steady state, extrapolated in depth."""
from __future__ import annotations

from .allocator import ROUND_LARGE, replay
from .common import Layout, extrapolate_layouts
from .runtime import cublas_workspace_allocations


def allocation_events(layout: Layout, sm_arch: int) -> list[tuple]:
    """(time, op, key, nbytes) for the device storages of a layout, steady state: persistent
    storages (alive from the first to the last event) are allocated once, before everything else,
    with the cuBLAS workspaces; the rest of the step is replayed twice, so the second step reuses the
    first step's segments as the real second step does. Storages left alive at the end of the first
    replay are freed before the second. At one time, frees come before allocations."""
    t, n = layout.trace, layout.num_events
    items = [(int(layout.alloc[r]), int(layout.free[r]), ("row", r), int(t.nbytes[r]))
             for r in layout.mask.nonzero()[0]]
    items += [(term.start, term.end, ("term", j), term.nbytes)
              for j, term in enumerate(layout.terms) if not term.host]
    events = [(-1, 1, ("cublas", j), b) for j, b in enumerate(cublas_workspace_allocations(sm_arch))]
    persistent = [it for it in items if it[0] == 0 and it[1] >= n]
    events += [(-1, 1, key, nbytes) for _, _, key, nbytes in persistent]
    rest = [it for it in items if not (it[0] == 0 and it[1] >= n)]
    for rep in range(2):
        step = []
        for start, end, key, nbytes in rest:
            step.append((start, 1, (rep, key), nbytes))
            step.append((min(end, n), -1, (rep, key), nbytes))
        step.sort(key=lambda e: (e[0], e[1]))
        events += [(e[0] + rep * (n + 1), e[1], e[2], e[3]) for e in step]
    return events


def peak_reserved_bytes(layouts: list[Layout], num_layers: int, sm_arch: int,
                        extra_bytes: int = 0) -> int:
    """Peak reserved at the two traced depths, extrapolated; `extra_bytes` (full-depth storages not on the
    per-depth curve) are added rounded up to whole 2 MiB large-pool segments."""
    peaks = [replay(allocation_events(lay, sm_arch)).peak_reserved for lay in layouts]
    extra = -(-extra_bytes // ROUND_LARGE) * ROUND_LARGE
    return extrapolate_layouts(layouts, peaks, num_layers) + extra

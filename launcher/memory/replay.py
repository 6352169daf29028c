"""Peak reserved bytes of a strategy layout: its allocation sequence replayed through the caching
allocator simulator (allocator.py), in steady state, at the two traced depths; the cache it holds
above the live bytes is carried to full depth (`peak_reserved_bytes`)."""
from __future__ import annotations

from .allocator import replay
from .common import Layout
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


def peak_reserved_bytes(deeper: Layout, sm_arch: int, peak_allocated_bytes: int,
                        expandable_segments: bool = False) -> int:
    """Peak reserved of the full-depth step: its peak allocated (`peak_allocated_bytes`, the
    phase-aware estimate) plus the cache the allocator holds above its live bytes when the
    steady-state step is replayed at the deeper traced depth (`deeper`, its layout).

    The held cache (peak reserved - peak allocated of a replay) comes from blocks that no later
    request could reuse, since segments are never returned: mostly those of the depth-independent
    large tensors (embedding and LM-head outputs, the loss's logits copies, optimizer-step and
    dequantization temporaries) that the layers' smaller blocks do not fill. A decoder layer
    repeats the previous layer's requests, which best fit reuses, so the held cache is carried to
    full depth as it is, not scaled. Assumption: neither the held cache's change between the two
    traced depths (a few hundred MiB, either sign, where the two replays place blocks differently)
    nor the replays' own peak reserved is extrapolated, because the traced depths' peak may sit in
    another phase than the full-depth one. `expandable_segments`: the replay's allocator grows one
    segment per pool (allocator.py)."""
    replayed = replay(allocation_events(deeper, sm_arch), expandable_segments)
    return peak_allocated_bytes + replayed.peak_reserved - replayed.peak_allocated

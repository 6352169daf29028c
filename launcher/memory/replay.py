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
                        extra_bytes: int = 0, peak_allocated_bytes: int = 0) -> int:
    """Peak reserved of the full-depth step: the larger of
    - the peak reserved at the two traced depths, extrapolated in depth (`extra_bytes`, full-depth
      storages not on the per-depth curve, added rounded up to whole 2 MiB large-pool segments);
    - the full-depth peak allocated plus the cache the deeper replay holds above its own peak
      allocated. Segments are never returned, so what the cache holds above the live bytes comes
      from blocks that no later request could reuse: mostly the depth-independent large ones
      (embedding and LM-head outputs, the loss's logits copies, optimizer-step temporaries),
      which a decoder layer's same-sized blocks do not fill. The held cache therefore carries to
      full depth instead of scaling with it (the per-depth extrapolation alone drops it where
      the peak allocated moves to another phase at full depth)."""
    replays = [replay(allocation_events(lay, sm_arch)) for lay in layouts]
    extra = -(-extra_bytes // ROUND_LARGE) * ROUND_LARGE
    extrapolated = extrapolate_layouts(layouts, [r.peak_reserved for r in replays], num_layers) + extra
    held = replays[-1].peak_reserved - replays[-1].peak_allocated
    return max(extrapolated, peak_allocated_bytes + held)

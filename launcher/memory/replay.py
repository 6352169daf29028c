"""Peak reserved bytes of a strategy layout: its allocation sequence replayed through the caching
allocator simulator (allocator.py), in steady state, at the two traced depths; the cache it holds
above the live bytes is carried to full depth (`peak_reserved_bytes`)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from launcher.environment import DEFAULT_CACHE_DIR
from .allocator import replay
from .common import Layout
from .runtime import cublas_workspace_allocations


def allocation_events(layout: Layout, sm_arch: int) -> list[tuple]:
    """(time, op, key, nbytes, stream) for the device storages of a layout, steady state: persistent
    storages (alive from the first to the last event) are allocated once, before everything else,
    with the cuBLAS workspaces; the rest of the step is replayed twice, so the second step reuses the
    first step's segments as the real second step does. Storages left alive at the end of the first
    replay are freed before the second. At one time, frees come before allocations."""
    t, n = layout.trace, layout.num_events
    items = [(int(layout.alloc[r]), int(layout.free[r]), ("row", r), int(t.nbytes[r]), 0)
             for r in layout.mask.nonzero()[0]]
    items += [(term.start, term.end, ("term", j), term.nbytes, term.stream)
              for j, term in enumerate(layout.terms) if not term.host]
    events = [(-1, 1, ("cublas", j), b, 0) for j, b in enumerate(cublas_workspace_allocations(sm_arch))]
    persistent = [it for it in items if it[0] == 0 and it[1] >= n]
    events += [(-1, 1, key, nbytes, stream) for _, _, key, nbytes, stream in persistent]
    rest = [it for it in items if not (it[0] == 0 and it[1] >= n)]
    for rep in range(2):
        step = []
        for start, end, key, nbytes, stream in rest:
            step.append((start, 1, (rep, key), nbytes, stream))
            step.append((min(end, n), -1, (rep, key), nbytes, stream))
        step.sort(key=lambda e: (e[0], e[1]))
        events += [(e[0] + rep * (n + 1), *e[1:]) for e in step]
    return events


def peak_reserved_bytes(deeper: Layout, sm_arch: int, peak_allocated_bytes: int,
                        expandable_segments: bool = False, memo: "ReplayMemo | None" = None) -> int:
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
    segment per pool (allocator.py). `memo`: replay results kept on disk (`ReplayMemo`)."""
    key = memo.key(deeper, sm_arch, expandable_segments) if memo is not None else None
    held = memo.get(key) if key is not None else None
    if held is None:
        replayed = replay(allocation_events(deeper, sm_arch), expandable_segments)
        held = replayed.peak_reserved - replayed.peak_allocated
        if key is not None:
            memo.put(key, held)
    return peak_allocated_bytes + held


_CODE = ("allocator.py", "replay.py")  # the replay's code: its text is part of every memo key
MEMO_FORMAT = 2  # 2: terms carry their stream


class ReplayMemo:
    """The cache a replay holds above its live bytes (`peak_reserved_bytes`), by the content of
    what is replayed, in one JSON file under the trace cache directory: a warm plan replays no
    layout. The key hashes every input of `allocation_events` and `replay` (the kept rows' sizes
    and events in row order, the framework terms' sizes and lifetimes in order, the event count,
    the cuBLAS workspace requests, expandable segments) with the source text of allocator.py and
    this file and `MEMO_FORMAT`, so a layout, allocator or code change is a new key, never a stale
    value. An unreadable file is an empty memo; the file is rewritten atomically (`save`)."""

    def __init__(self, cache_dir=None):
        self.path = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / "replays.json"
        self._values: dict[str, int] | None = None
        self._new: dict[str, int] = {}
        self._code: str | None = None

    _SHARED: dict = {}

    @classmethod
    def shared(cls, cache_dir=None) -> "ReplayMemo":
        """The one memo of this process for `cache_dir`."""
        memo = cls(cache_dir)
        return cls._SHARED.setdefault(memo.path, memo)

    def _load(self) -> dict[str, int]:
        if self._values is None:
            try:
                data = json.loads(self.path.read_text())
                self._values = {k: v for k, v in data.items() if isinstance(v, int)} if isinstance(data, dict) else {}
            except (OSError, ValueError):
                self._values = {}
        return self._values

    def key(self, layout: Layout, sm_arch: int, expandable_segments: bool) -> str:
        if self._code is None:
            here = Path(__file__).resolve().parent
            self._code = hashlib.sha256(b"".join((here / f).read_bytes() for f in _CODE)).hexdigest()
        t, rows = layout.trace, layout.mask.nonzero()[0]
        h = hashlib.blake2b(digest_size=20)
        h.update(json.dumps([MEMO_FORMAT, self._code, int(layout.num_events), bool(expandable_segments),
                             cublas_workspace_allocations(sm_arch), len(rows),
                             [(term.start, term.end, term.nbytes, term.stream)
                              for term in layout.terms if not term.host]]
                            ).encode())
        for arr in (layout.alloc[rows], layout.free[rows], t.nbytes[rows]):
            h.update(np.ascontiguousarray(arr, np.int64).tobytes())
        return h.hexdigest()

    def get(self, key: str) -> int | None:
        return self._load().get(key)

    def put(self, key: str, held: int) -> None:
        self._load()[key] = self._new[key] = int(held)

    def save(self) -> None:
        """Write the new results (merged with the file as it is now, which another plan may have
        grown meanwhile); a read-only cache only costs time."""
        if not self._new:
            return
        try:
            on_disk = json.loads(self.path.read_text()) if self.path.exists() else {}
            if not isinstance(on_disk, dict):
                on_disk = {}
        except (OSError, ValueError):
            on_disk = {}
        on_disk.update(self._new)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(on_disk, separators=(",", ":")))
            os.replace(tmp, self.path)
        except OSError:
            return
        self._new = {}

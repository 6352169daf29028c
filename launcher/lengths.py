"""Datasets whose examples vary in length: each micro-batch padded to its longest example.

An unpacked dataset (HF Trainer or torchtune on alpaca, with padding to the longest example of each
batch) gives every micro-batch its own length, cut at the sequence-length cap. Two things follow for
memory. The peak is set by the longest batch the run meets, the cap or the dataset's longest example.
And the CUDA caching allocator keeps the blocks each length leaves behind: a block cached for a
shorter batch is too small for a longer one, which gets a new segment, and segments are returned to
the driver only when memory runs out (CUDACachingAllocator.cpp), so peak reserved keeps growing
with the number of distinct lengths seen (replay.py `varlen_held_cache`).

A length profile is the distribution of the dataset's example lengths in tokens, as a cumulative
distribution ([[tokens, fraction of examples with at most that many], ...]). Shipped profiles live in
launcher/data/lengths/<name>.json with their source; `training.length_profile` names one or gives a
path to such a JSON file or to a text file of token counts, one example per line.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from launcher.errors import ConfigError

if TYPE_CHECKING:
    from launcher.steptrace import TraceSet
    from launcher.types import Workload

SHIPPED = Path(__file__).resolve().parent / "data" / "lengths"


@dataclass(frozen=True)
class LengthProfile:
    name: str
    tokens: tuple[float, ...]
    """Example lengths at the points of the cumulative distribution, increasing."""
    fractions: tuple[float, ...]
    """Fraction of examples with at most that many tokens, increasing to 1."""
    longest: int
    """The longest example, tokens."""
    source: str

    def batch_lengths(self, cap: int, micro_batch_size: int, count: int, seed: int, multiple: int = 1) -> list[int]:
        """Lengths of `count` micro-batches of `micro_batch_size` examples drawn independently
        (a shuffled dataset), each padded to its longest example, rounded up to a `multiple` of
        tokens and cut at `cap`; deterministic for a seed."""
        rng = np.random.default_rng(seed)
        u = rng.random((count, micro_batch_size))
        lengths = np.ceil(np.interp(u, self.fractions, self.tokens)).max(axis=1)
        lengths = np.ceil(lengths / multiple) * multiple
        return np.minimum(lengths, cap).astype(int).tolist()

    def peak_length(self, cap: int, multiple: int = 1) -> int:
        """The longest batch a run over the whole dataset meets: the cap, or the longest example
        (rounded up to a `multiple`) when the cap is above it."""
        return min(cap, -(-self.longest // multiple) * multiple)


@dataclass(frozen=True)
class VarlenRun:
    """A run of micro-batches of varying length, for the allocator replay of a GPU estimate
    (launcher/memory/estimate.py): the step traced at a second, shorter length, and the batches'
    lengths in order."""
    short_traces: TraceSet
    """The step at `short.seq_len` tokens."""
    short: Workload
    batches: tuple[int, ...]
    profile: str
    attention_workspace_bytes: int = 0
    """A GPU attention backward's workspace per call at `short.seq_len` (estimate.py)."""


def names() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.json"))


@lru_cache(maxsize=8)
def load(spec: str) -> LengthProfile:
    """The profile `training.length_profile` names (a shipped name or a path); ConfigError names
    the key and the fix."""
    key = f"training.length_profile={spec}"
    path = SHIPPED / f"{spec}.json" if "/" not in spec and not spec.endswith((".json", ".txt")) else Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"{key}: no such profile; use one of {', '.join(names())}, a .json file "
                          '{"cdf": [[tokens, fraction], ...]} or a .txt file of token counts, one per line')
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text())
            points = np.asarray(data["cdf"], float)
            source = str(data.get("source", path))
        else:
            counts = np.sort(np.asarray([float(x) for x in path.read_text().split()], float))
            points = np.stack([counts, np.arange(1, len(counts) + 1) / len(counts)], axis=1)
            source = f"{len(counts)} token counts in {path}"
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise ConfigError(f"{key}: unreadable ({str(err).splitlines()[0][:80]}); give "
                          '{"cdf": [[tokens, fraction], ...]} in JSON or token counts, one per line') from None
    if points.ndim != 2 or points.shape[1] != 2 or len(points) < 1 or (points[:, 0] < 1).any() \
            or (np.diff(points[:, 0]) < 0).any() or (np.diff(points[:, 1]) < 0).any() \
            or not 0 < points[-1, 1] <= 1 or (points[:, 1] < 0).any():
        raise ConfigError(f"{key}: the lengths must be positive and increasing, with fractions "
                          "rising to 1; e.g. [[40, 0.01], [110, 0.5], [580, 1.0]]")
    frac = points[:, 1] / points[-1, 1]
    rising = np.r_[True, np.diff(frac) > 0]  # the inverse distribution needs strictly rising fractions
    tokens, frac = points[rising, 0], frac[rising]
    if frac[0] > 0:  # no example is shorter than the first point
        tokens, frac = np.r_[tokens[0], tokens], np.r_[0.0, frac]
    return LengthProfile(spec, tuple(tokens.tolist()), tuple(frac.tolist()), int(np.ceil(points[-1, 0])), source)

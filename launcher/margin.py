"""How much GPU memory a plan keeps free, from how wrong the estimate has been.

`scripts/validate_gpu` plans the published GPU measurements of docs/validation/ and writes the
signed error of every reliability A/B row it can express into launcher/data/gpu_errors.json. A
GPU candidate fits when the memory it needs (`MemoryEstimate.oom_bytes`) stays below the GPU's
memory less a margin that covers the estimate's underestimates on those rows: by default their
90th percentile
(`planner.safety_margin: null`), so a plan's "fits" held for at least 9 in 10 published runs. A
number given by the user replaces it. CPU processes keep the fixed 5%: their estimate is the
measured peak of real runs within 0.02% (docs/accuracy.md).
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

ERRORS_FILE = Path(__file__).with_name("data") / "gpu_errors.json"
CPU_MARGIN = 0.05
QUANTILE = 0.9
FALLBACK_MARGIN = 0.05  # no validation data (a stripped install): the margin the planner always had


@lru_cache(maxsize=1)
def underestimates() -> tuple[float, ...]:
    """Underestimate of each validated row as a fraction of the published value (0 for rows the
    estimate did not underestimate), sorted."""
    if not ERRORS_FILE.exists():
        return ()
    rows = json.loads(ERRORS_FILE.read_text())["rows"]
    return tuple(sorted(max(0.0, -r["error_percent"] / 100) for r in rows))


def quantile(values: tuple[float, ...], q: float) -> float:
    """The q-quantile by the nearest-rank method (the smallest value with at least q of the values
    at or below it)."""
    return values[max(0, math.ceil(q * len(values)) - 1)]


def resolve(safety_margin: float | None, device: str) -> float:
    """The margin a plan uses: the user's number, else the CPU margin on CPU processes, else the
    90th percentile of the published underestimates (module docstring)."""
    if safety_margin is not None:
        return safety_margin
    if device == "cpu":
        return CPU_MARGIN
    errors = underestimates()
    return quantile(errors, QUANTILE) if errors else FALLBACK_MARGIN  # not rounded: it must cover its own row


def confidence_note(needed: int, capacity: int) -> str:
    """One line on how sure a GPU candidate's "fits" is: its headroom against the published
    underestimates."""
    errors = underestimates()
    if not errors or capacity <= 0:
        return ""
    headroom = 1 - needed / capacity
    covered = sum(e < headroom for e in errors)
    return (f"headroom {headroom:.0%} of the GPU: {covered} of {len(errors)} published measurements "
            f"(docs/accuracy.md) were underestimated by less; the largest underestimate was {errors[-1]:.0%}")

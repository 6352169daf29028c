"""Where the out-of-memory fallback's next attempt continues: the newest complete checkpoint of
the attempts so far, read natively when the next plan has the same layout, else in the
layout-neutral form (launcher/worker/layout.py; DeepSpeed checkpoints are converted once, here,
into the next attempt's directory). The next attempt's run.json names it as `resume`, so the
worker restores weights, optimizer, scheduler, data position and RNG states, and the step
numbers continue."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from launcher.worker import checkpoint, layout

CONVERTED = "resume-from-step-{step}"


def resume_point(attempt_dirs: list[Path]) -> tuple[Optional[int], Optional[Path]]:
    """(step, directory) of the newest complete checkpoint over the attempts (newest attempt
    first; an attempt that has not saved yet continues from its own resume point)."""
    best: tuple[Optional[int], Optional[Path]] = (None, None)
    for attempt in attempt_dirs:
        for step, path in checkpoint.step_dirs(checkpoint.checkpoint_root(attempt)):
            if checkpoint.verify(path) is None:
                if best[0] is None or step > best[0]:
                    best = (step, path)
                break
        spec = json.loads((attempt / "run.json").read_text()) if (attempt / "run.json").is_file() else {}
        if isinstance(spec.get("resume"), str) and checkpoint.verify(Path(spec["resume"])) is None:
            step = checkpoint.TrainerState.read(Path(spec["resume"])).step
            if best[0] is None or step > best[0]:
                best = (step, Path(spec["resume"]))
    return best


def continue_from(run_json: Path, source: Path, world_size: int) -> dict:
    """Point the next attempt's run.json at checkpoint `source`, converting it when its layout is
    not the next plan's and not already neutral. Returns what the fallback records."""
    spec = json.loads(run_json.read_text())
    own = {"backend": spec["backend"], "strategy": spec["strategy"], "world_size": world_size}
    saved = layout.read_layout(source)
    step = checkpoint.TrainerState.read(source).step
    target = source
    if not layout.same_layout(saved, own) and not layout.is_neutral(saved):
        target = run_json.parent / CONVERTED.format(step=step)
        layout.to_neutral(source, target)
    spec["resume"] = str(target)
    run_json.write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
    return {"checkpoint": str(source), "step": step, "read_from": str(target),
            "layout": (saved or {}).get("strategy", spec["strategy"]), "optimizer_state": "restored"}


def describe(resumed: Optional[dict], completed_steps: int) -> str:
    """What the next attempt keeps and loses, for the fallback's report."""
    if resumed is None:
        return (f"from step 0: no complete checkpoint (set checkpoint.every_steps); "
                f"steps lost: {completed_steps}")
    redone = max(0, completed_steps - resumed["step"])
    return (f"continuing from step {resumed['step']} ({resumed['checkpoint']}, optimizer state "
            f"{resumed['optimizer_state']}); steps lost: 0, steps to redo: {redone}")

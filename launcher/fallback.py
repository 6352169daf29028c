"""When a launched run fails: relaunch after out-of-memory with a candidate that needs less memory,
and continue a previous run directory (`resume=<run dir>`).

Out-of-memory fallback. A rank that runs out of memory writes RUN_DIR/oom-rank{R}.json and exits
with `launcher.worker.oom.OOM_EXIT_CODE` (launcher/worker/oom.py). The launcher merges those into
RUN_DIR/oom.json (measured peak per rank and step, next to the estimate) and, with `fallback=true`,
relaunches with the next-ranked candidate of the plan that fits and whose estimated device total
is below the failed one's, in RUN_DIR/attempt-2/, attempt-3/, ... (each with its own run.json,
framework config, launch_command.sh, metrics and checkpoints; the first attempt's files are never
touched). A new attempt continues from the newest complete checkpoint of the attempts before it
(launcher/fallback_resume.py): weights, optimizer, scheduler, data position and RNG states, moved
to the next plan's layout when it differs (launcher/worker/layout.py), with the step numbers
continuing; without a checkpoint it starts from step 0. At most `max_fallbacks` relaunches;
RUN_DIR/fallback.json records every attempt, where it continued from and the steps lost.

Resume. `resume=<run dir>` re-composes that run's own overrides (.hydra/overrides.yaml), so the
plan, the chosen candidate and the data order are the same; only the keys in RESUMABLE may
change. Its latest attempt's run.json is copied to run-resume-N.json with `resume: true` and
started again: the worker continues from the newest complete checkpoint, appending to
metrics.jsonl (steps redone after the checkpoint appear again: the last record of a step is the
one that counts) and writing summary-N.json instead of overwriting summary.json.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Optional

from launcher.errors import ConfigError
from launcher.worker.oom import oom_files
from launcher import fallback_resume, launch
from launcher.runspec import RunSpec
from launcher.worker import checkpoint

ATTEMPT_DIR = re.compile(r"^attempt-(\d+)$")
RESUMABLE = ("training.max_steps", "checkpoint.*", "launch.*", "report", "mode", "cache_dir", "fallback",
             "max_fallbacks")
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
MIB = 2 ** 20


# ---- out-of-memory fallback ---------------------------------------------------------------

def read_oom(run_dir: Path) -> Optional[dict]:
    """Merge the ranks' oom-rank{R}.json into RUN_DIR/oom.json; None when no rank ran out."""
    reports = [json.loads(p.read_text()) for p in oom_files(run_dir)]
    if not reports:
        return None
    merged = {
        "step": min(r["step"] for r in reports),
        "ranks": {str(r["rank"]): {k: r[k] for k in ("step", "error", "peak_allocated_bytes")} for r in reports},
        "completed_steps": min(r["completed_steps"] for r in reports),
        "last_completed_step_peak_allocated_bytes": reports[0]["last_completed_step_peak_allocated_bytes"],
        "estimate": reports[0]["estimate"],
    }
    (run_dir / "oom.json").write_text(json.dumps(merged, indent=2) + "\n")
    return merged


def next_candidate(plan, failed: int, tried: set) -> Optional[int]:
    """The next-ranked candidate (plan order: fastest first) that fits and whose estimated device
    total is below the failed candidate's."""
    limit = plan.candidates[failed].memory.device_total_bytes
    return next((i for i, c in enumerate(plan.candidates)
                 if c.fits and i not in tried and c.memory.device_total_bytes < limit), None)


def _describe(plan, index: int) -> str:
    c = plan.candidates[index]
    return (f"#{index} {c.strategy.name} micro_batch_size={c.micro_batch_size} grad_accum_steps={c.grad_accum_steps} "
            f"(estimated {c.memory.device_total_bytes / MIB:.2f} MiB)")


def _oom_line(report: dict) -> str:
    peaks = [r["peak_allocated_bytes"] for r in report["ranks"].values() if r["peak_allocated_bytes"]]
    measured = f"measured peak {max(peaks) / MIB:.2f} MiB" if peaks else "peak not measured"
    est = report["estimate"].get("peak_allocated_bytes")
    est_text = f" vs estimated {est / MIB:.2f} MiB allocated" if est else ""
    return f"out of memory at step {report['step']}: {measured}{est_text}"


def run_with_fallback(plan, config, spec, job, quiet: bool = False, execute=None,
                      state: Optional[dict] = None) -> tuple[int, Path]:
    """Run the job; after an out-of-memory failure relaunch with a smaller candidate (see the
    module docstring). `execute(job, candidate index) -> exit code` runs one attempt (default:
    torchrun here; in a Slurm job, launcher/slurm_job.py). `state` ({"attempts": [...], "resumed":
    ...}, updated in place): the attempts so far and where the running one continued from, so a
    requeued Slurm job continues the record. fallback.json is rewritten after every attempt.
    Returns the last exit code and the directory of the last attempt."""
    execute = execute or (lambda j, _: launch.execute(j, quiet=quiet))
    run_dir, index, tried = Path(config.run_dir or job.run_dir), plan.chosen, {plan.chosen}
    state = state if state is not None else {}
    attempts = state.setdefault("attempts", [])
    resumed = state.get("resumed")
    while True:
        attempt_dir = job.run_dir
        state["resumed"] = resumed
        rc = execute(job, index)
        report = read_oom(attempt_dir) if rc != 0 else None
        attempts.append({"attempt": len(attempts) + 1, "dir": str(attempt_dir), "candidate": index,
                         "description": _describe(plan, index), "exit_code": rc, "resumed_from": resumed,
                         "result": "finished" if rc == 0 else "out_of_memory" if report else "failed", "oom": report})
        if report is None:
            break
        _write_attempts(run_dir, attempts)
        print(f"attempt {len(attempts)} {_describe(plan, index)}: {_oom_line(report)}; details in "
              f"{attempt_dir / 'oom.json'}", file=sys.stderr)
        nxt = next_candidate(plan, index, tried)
        if not config.fallback or len(attempts) > config.max_fallbacks or nxt is None:
            why = ("fallback=false" if not config.fallback else f"max_fallbacks={config.max_fallbacks} reached"
                   if len(attempts) > config.max_fallbacks else "no fitting candidate needs less memory")
            print(f"not relaunching: {why}", file=sys.stderr)
            break
        next_dir = run_dir / f"attempt-{len(attempts) + 1}"
        next_dir.mkdir()
        job = launch.prepare(dataclasses.replace(plan, chosen=nxt), config, spec, next_dir)
        completed = (resumed or {}).get("step", 0) + report["completed_steps"]  # this attempt's last step
        _, source = fallback_resume.resume_point([Path(a["dir"]) for a in reversed(attempts)])
        resumed = fallback_resume.continue_from(next_dir / "run.json", source, config.gpus) if source else None
        attempts[-1]["steps_lost"] = 0 if resumed else completed
        print(f"relaunching with {_describe(plan, nxt)} in {next_dir}, "
              f"{fallback_resume.describe(resumed, completed)}", file=sys.stderr)
        _write_attempts(run_dir, attempts)
        index = nxt
        tried.add(nxt)
    if len(attempts) > 1 or attempts[0]["oom"]:
        _write_attempts(run_dir, attempts)
        for a in attempts:
            start = f", continued from step {a['resumed_from']['step']}" if a["resumed_from"] else ""
            lost = f", steps lost: {a['steps_lost']}" if "steps_lost" in a else ""
            print(f"attempt {a['attempt']} {a['description']}{start}: {a['result'].replace('_', ' ')}{lost} ({a['dir']})",
                  file=sys.stderr if quiet else sys.stdout)
    return rc, job.run_dir


def _write_attempts(run_dir: Path, attempts: list) -> None:
    tmp = run_dir / "fallback.json.tmp"
    tmp.write_text(json.dumps({"attempts": attempts}, indent=2) + "\n")
    tmp.replace(run_dir / "fallback.json")


# ---- resume a previous run directory ------------------------------------------------------

def _key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


def _last_value(argv: list[str], key: str) -> Optional[str]:
    values = [a.split("=", 1)[1] for a in argv if "=" in a and _key(a) == key]
    return values[-1] if values else None


def hydra_quote(value: str) -> str:
    """A Hydra override value for a path: bare when plain, else single-quoted with escapes."""
    if "${" in value:
        raise ConfigError(f"path {value!r} contains '${{', which Hydra would interpolate; rename the directory")
    if re.fullmatch(r"[\w/.\-:@+]+", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def latest_attempt(run_dir: Path) -> Path:
    """RUN_DIR/attempt-N with the largest N holding a run.json, else RUN_DIR."""
    found = [(int(m.group(1)), p) for p in run_dir.glob("attempt-*")
             if (m := ATTEMPT_DIR.match(p.name)) and (p / "run.json").is_file()]
    return max(found)[1] if found else run_dir


def resume_argv(argv: list[str]) -> list[str]:
    """Turn `resume=<run dir>` (or resume=true with hydra.run.dir=<dir>) into that run's own
    overrides + the user's, with Hydra writing into the same directory under .hydra-resume-N/.
    Refuse a hydra.run.dir that already holds a run when not resuming."""
    value, hydra_dir = _last_value(argv, "resume"), _last_value(argv, "hydra.run.dir")
    resuming = value is not None and value.strip("'\"").lower() not in _FALSE
    if value is not None and value.lower() in _TRUE:
        value = hydra_dir
    if not resuming or value is None:
        if hydra_dir and (Path(hydra_dir.strip("'\"")) / "plan.json").exists():
            raise ConfigError(f"hydra.run.dir={hydra_dir} already holds a run (plan.json) and a run directory is never "
                              f"overwritten; use a new directory, or resume={hydra_dir} to continue that run")
        return argv
    target = Path(value.strip("'\"")).expanduser().resolve()
    if not (target / "run.json").is_file() or not (target / ".hydra" / "overrides.yaml").is_file():
        raise ConfigError(f"resume={value}: {target} is not the run directory of a previous run (no run.json or "
                          f".hydra/overrides.yaml); give one like resume=runs/<date>/<time>_<model>, or resume=false")
    from omegaconf import OmegaConf

    old = [str(a) for a in OmegaConf.load(target / ".hydra" / "overrides.yaml") if not _key(str(a)).startswith("hydra.")]
    mine = [a for a in argv if "=" in a and _key(a) != "resume" and not _key(a).startswith("hydra.")]
    mine_keys = {_key(a) for a in mine}
    num = len(list(target.glob(".hydra-resume-*"))) + 1
    return [*(a for a in old if _key(a) not in mine_keys | {"resume"}), *mine,
            f"resume={hydra_quote(str(target))}", f"hydra.run.dir={hydra_quote(str(target))}",
            f"hydra.output_subdir=.hydra-resume-{num}"]


def _resumable(key: str) -> bool:
    return key in ("resume", "run_dir") or any(key == r or (r.endswith(".*") and key.startswith(r[:-1]))
                                                for r in RESUMABLE)


def _flat(obj, prefix: str = "") -> dict:
    out = {}
    for k, v in (dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj).items():
        if isinstance(v, dict) and k != "hf_config":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def latest_complete_checkpoint(spec_dir: Path) -> tuple[Optional[int], str]:
    """(step, '') of the newest complete checkpoint, or (None, what is wrong with the newest)."""
    problems = []
    for step, path in checkpoint.step_dirs(checkpoint.checkpoint_root(spec_dir)):
        problem = checkpoint.verify(path)
        if problem is None:
            return step, ""
        problems.append(f"{path.name}: {problem}")
    return None, "; ".join(problems[:1]) or "none saved"


def check_resume(config, old) -> None:
    """The resumed run keeps its plan (`old`: that run's config, composed again from its
    overrides); it has a complete checkpoint short of training.max_steps."""
    target = Path(config.resume)
    before, after = _flat(old), _flat(config)
    for key in sorted(before):
        if before[key] != after.get(key) and not _resumable(key):
            was, now = (v.name if isinstance(v, enum.Enum) else v for v in (before[key], after.get(key)))
            raise ConfigError(f"resume={target}: {key} was {was!r} in that run, not {now!r}; a resumed "
                              f"run keeps its plan (only {', '.join(RESUMABLE)} may change): drop {key}=")
    spec_dir = latest_attempt(target)
    step, problem = latest_complete_checkpoint(spec_dir)
    if step is None:
        raise ConfigError(f"resume={target}: no complete checkpoint under {spec_dir / 'checkpoints'} ({problem}); "
                          f"start a new run without resume")
    if step >= config.training.max_steps:
        raise ConfigError(f"resume={target}: its latest checkpoint is at step {step}, which is already "
                          f"training.max_steps={config.training.max_steps}; to train longer pass training.max_steps>{step}")


def resume_run(config, quiet: bool = False) -> int:
    """Start the previous run again from its latest checkpoint; new files get a -resume-N name."""
    spec_dir = latest_attempt(Path(config.resume))
    num = len(list(spec_dir.glob("run-resume-*.json"))) + 1
    spec = RunSpec.load(spec_dir / "run.json")
    spec = dataclasses.replace(spec, resume=True, max_steps=config.training.max_steps,
                               checkpoint_every=config.checkpoint.every_steps, checkpoint_keep=config.checkpoint.keep)
    spec_path = spec_dir / f"run-resume-{num}.json"
    spec.save(spec_path)
    env = launch.job_env(config)
    python = launch.worker_python(spec.backend, spec.strategy)
    job = launch.Job(tuple(launch.torchrun_argv(config, spec_path, python)), env, spec_dir, config.gpus)
    script = spec_dir / f"launch_command-resume-{num}.sh"
    script.write_text("\n".join(["#!/usr/bin/env bash", "set -euo pipefail",
                                 *(f"export {k}={shlex.quote(v)}" for k, v in env.items()), job.command_line, ""]))
    script.chmod(0o755)
    if not quiet:
        print(f"resuming {spec_dir} (run-resume-{num}.json)\nlaunch command: {job.command_line}")
    rc = launch.execute(job, quiet=quiet, log_name=f"train-resume-{num}.log")
    if rc != 0:
        print(f"error: training exited with code {rc}; logs in {spec_dir}", file=sys.stderr)
    elif not quiet:
        summaries = sorted(spec_dir.glob("summary*.json"), key=lambda p: p.stat().st_mtime)
        print(f"resumed run finished; summary in {summaries[-1] if summaries else 'none'}")
    return rc

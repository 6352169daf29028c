#!/usr/bin/env python
"""Planning time, phase by phase: `python -m launcher ... mode=plan` in a fresh process per run,
cold (an empty cache directory: every trace is run) and warm (the cache filled by a run before),
with the median and spread over repeated runs and the peak RSS of each run.

    scripts/bench_plan                        # the cases of issue 20, 5 runs each
    scripts/bench_plan --runs 3 --cases llama-2-7b-cold,bloom-1b1-warm
    scripts/bench_plan --case "model=gpt2 gpus=2" --runs 3
    scripts/bench_plan --variant before=/tmp/old-checkout --variant after=.   # interleaved A/B
    scripts/bench_plan --cases llama-2-7b-cold --runs 1 --profile /tmp/prof   # + a cProfile run

Imports by module: `python -X importtime -m launcher ... 2> imports.txt` (the `imports` phase
below is their total).

Each run is a child process started by this script (`--child`): it times, exclusively (a phase
that calls another or imports a module is not charged for that time), the phases of a plan by
wrapping the functions that do them:

  imports        every module imported for the first time (importlib's _find_and_load)
  config         Hydra composition, the command-line checks and OmegaConf -> LauncherConfig
  model spec     launcher.model.load_spec
  trace <phase>  launcher.trace.trace_step, cut at its phases (build, forward, backward,
                 optimizer, record: turning the recorded rows into a StepTrace)
  trace cache    reading and writing the cached traces, their keys
  layouts        launcher.memory.estimate.estimate (framework layouts, allocator replay, runtime)
  speed          launcher.speed.estimate_speed and the host-time counts
  planner        the rest of launcher.planner.plan (enumeration, ranking, explanations)
  report         plan.json, exports, plan.html, the printed report
  other          what is left inside the child (Hydra's run directory, launch preparation...)
  startup        interpreter start-up and exit: the parent's wall time minus the child's own

Peak RSS is the child's ru_maxrss (os.wait4). Children run as users run them: with
PYTHONDONTWRITEBYTECODE removed from their environment, so modules are loaded from __pycache__. Wall time is measured by this script around the
child. The numbers depend on the machine and its load: the load average is printed with the table.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # name -> (overrides, cold?)
    "llama-2-7b-cold": ("model=llama-2-7b gpus=8 hardware=a100-80g", True),
    "llama-2-7b-warm": ("model=llama-2-7b gpus=8 hardware=a100-80g", False),
    "llama-2-70b-cold": ("model=llama-2-70b gpus=64 nodes=8 hardware=a100-80g", True),
    "llama-2-70b-warm": ("model=llama-2-70b gpus=64 nodes=8 hardware=a100-80g", False),
    "bloom-1b1-warm": ("model=bloom-1b1 gpus=4", False),
}
TARGETS = {"llama-2-7b-cold": 2.5, "llama-2-70b-cold": 4.0}  # issue 20; warm: 0.3 s
WARM_TARGET_S, RSS_TARGET_MIB = 0.3, 300
VARIANTS: dict[str, str | None] = {"this": None}  # variant name -> checkout (None: this one)
PHASES = ("startup", "imports", "config", "model spec", "trace build", "trace forward", "trace backward",
          "trace optimizer", "trace record", "trace cache", "layouts", "speed", "planner", "report", "other")


# ----------------------------------------------------------------------------- the child

class _Clock:
    """Exclusive time per phase: a stack of open phases; a phase's time excludes its children's."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.stack: list[list] = []  # [name, start, time spent in children]

    def enter(self, name: str) -> None:
        self.stack.append([name, time.perf_counter(), 0.0])

    def leave(self) -> None:
        name, start, inner = self.stack.pop()
        elapsed = time.perf_counter() - start
        self.totals[name] = self.totals.get(name, 0.0) + elapsed - inner
        if self.stack:
            self.stack[-1][2] += elapsed

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self.enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave()
        timed.__wrapped__ = fn
        return timed


def _patch(clock: _Clock, module: str, attr: str, phase: str) -> None:
    """Wrap `module.attr` (a function or a method 'Class.method') once the module is imported;
    a name that no longer exists (code moved) is skipped."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    owner, _, name = attr.rpartition(".")
    target = getattr(mod, owner) if owner else mod
    fn = getattr(target, name, None)
    if fn is not None and not hasattr(fn, "__wrapped__"):
        setattr(target, name, clock.wrap(phase, fn))


def child(argv: list[str], out_path: str) -> None:
    """Run `python -m launcher argv` in this process with its phases timed; write them as JSON."""
    import runpy
    import importlib._bootstrap as bootstrap

    clock = _Clock()
    t0 = time.perf_counter()
    clock.enter("other")
    find_and_load = bootstrap._find_and_load
    bootstrap._find_and_load = clock.wrap("imports", find_and_load)
    sys.modules["_frozen_importlib"]._find_and_load = bootstrap._find_and_load
    patches = [("hydra._internal.hydra", "Hydra.compose_config", "config"),
               ("launcher.cli", "prepare_argv", "config"), ("launcher.cli", "to_config", "config"),
               ("launcher.app", "to_config", "config"),
               ("launcher.model", "load_spec", "model spec"),
               ("launcher.trace", "_load", "trace cache"), ("launcher.trace", "_save", "trace cache"),
               ("launcher.trace", "cache_key", "trace cache"),
               ("launcher.memory.estimate", "estimate", "layouts"),
               ("launcher.speed", "estimate_speed", "speed"), ("launcher.host_time", "step_counts", "speed"),
               ("launcher.planner", "plan", "planner"),
               ("launcher.report", "plan_to_dict", "report"), ("launcher.report_table", "print_plan", "report"),
               ("launcher.exports", "write", "report"), ("launcher.report_html", "write", "report")]
    for module, attr, phase in patches:
        _patch(clock, module, attr, phase)
    _time_trace_phases(clock)
    sys.argv = ["launcher", *argv]
    code = 0
    profile_path = os.environ.get("BENCH_PLAN_PROFILE")
    profiler = None
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        runpy.run_module("launcher", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile_path)
        sys.modules["_frozen_importlib"]._find_and_load = find_and_load
        while clock.stack:
            clock.leave()
        totals = dict(clock.totals, inside_s=time.perf_counter() - t0)
        Path(out_path).write_text(json.dumps(totals))
    sys.stdout.flush()
    os._exit(code)


def _time_trace_phases(clock: _Clock) -> None:
    """Charge each traced step's time to its phases: the tracer marks the event where each phase
    starts (`marks`); the wrapped `_run_step` notes the clock at each mark through the recorder."""
    try:
        from launcher import trace
    except ImportError:
        return
    run_step, trace_step = getattr(trace, "_run_step", None), getattr(trace, "trace_step", None)
    if run_step is None or trace_step is None:
        return

    class _TimedMarks(dict):
        """`marks` of one step: each phase start switches the clock to that phase."""

        def __setitem__(self, name, value):
            if name in ("build", "forward", "backward", "optimizer"):
                clock.leave()
                clock.enter(f"trace {name}")
            elif name == "zero_grad":
                clock.leave()
                clock.enter("trace optimizer")
            elif name == "end":
                clock.leave()
                clock.enter("trace record")
            super().__setitem__(name, value)

    def timed_run_step(key, rec, marks, grads):
        timed = _TimedMarks(marks)
        clock.enter("trace build")
        try:
            return run_step(key, rec, timed, grads)
        finally:
            marks.update(timed)

    def timed_trace_step(key):
        clock.enter("trace record")
        try:
            return trace_step(key)
        finally:
            clock.leave()

    trace._run_step = timed_run_step
    trace.trace_step = timed_trace_step


# ----------------------------------------------------------------------------- the parent

def run_once(overrides: str, cache_dir: Path, out_dir: Path, python: str, profile: str | None = None,
             source: str | None = None) -> dict:
    """One fresh child process planning `overrides` with the launcher of `source` (a checkout;
    default: this one); its phases, wall time and peak RSS. Every cache the child may use by
    default lives under `cache_dir` too (XDG_CACHE_HOME), so a cold run is cold everywhere."""
    times = out_dir.with_suffix(".times.json")
    argv = [python, str(Path(__file__).resolve()), "--child", str(times), "--",
            *shlex.split(overrides), "mode=plan", "report=json", f"cache_dir={cache_dir}",
            f"hydra.run.dir={out_dir}"]
    # as a user runs it: compiled modules are cached (__pycache__), whatever this shell says
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(HF_HUB_OFFLINE="1", XDG_CACHE_HOME=str(cache_dir / "xdg"), PYTHONPATH=source or str(ROOT))
    if profile:
        env["BENCH_PLAN_PROFILE"] = profile
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall_s = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{overrides}: exit {proc.returncode}: {stderr.decode()[-2000:]}")
    phases = json.loads(times.read_text())
    inside = phases.pop("inside_s")
    phases["startup"] = wall_s - inside
    return {"wall_s": wall_s, "rss_mib": usage.ru_maxrss / 1024, "phases": phases}


def bench_case(name: str, overrides: str, cold: bool, runs: int, tmp: Path, python: str,
               variants: dict[str, str | None]) -> dict[str, list[dict]]:
    """`runs` runs of the case per variant (name -> source checkout), interleaved run by run so
    that every variant sees the same machine load."""
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for v, source in variants.items():
        if not cold:  # fill the variant's cache once, untimed
            run_once(overrides, tmp / f"{name}-{v}-cache", tmp / f"{name}-{v}-fill", python, source=source)
    for i in range(runs):
        for v, source in variants.items():
            cache = tmp / f"{name}-{v}-cold-{i}" if cold else tmp / f"{name}-{v}-cache"
            r = run_once(overrides, cache, tmp / f"{name}-{v}-run-{i}", python, source=source)
            results[v].append(r)
            print(f"  {name} {v} run {i + 1}/{runs}: {r['wall_s']:.2f} s, {r['rss_mib']:.0f} MiB",
                  file=sys.stderr, flush=True)
    return results


def print_profile(name: str, overrides: str, cold: bool, tmp: Path, out_dir: Path, python: str) -> None:
    """One run of the case under cProfile (cold: a fresh cache; warm: the timed runs' cache)."""
    import pstats

    out_dir.mkdir(parents=True, exist_ok=True)
    safe = name.replace(" ", "_").replace("=", "-")
    prof = out_dir / f"{safe}.prof"
    cache = tmp / f"{safe}-profile-cache" if cold else tmp / f"{safe}-{next(iter(VARIANTS))}-cache"
    run_once(overrides, cache, tmp / f"{safe}-profile", python, profile=str(prof), source=VARIANTS[next(iter(VARIANTS))])
    print(f"\n{name}: cProfile, 20 functions with the most own time ({prof})", file=sys.stderr)
    pstats.Stats(str(prof), stream=sys.stderr).sort_stats("tottime").print_stats(20)


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def table(rows: dict[tuple[str, str], list[dict]]) -> str:
    """A markdown table: one row per case and variant (median wall, spread, peak RSS, target) and
    the phases' medians as columns."""
    shown = [p for p in PHASES if any(r["phases"].get(p, 0) > 0.005 for rs in rows.values() for r in rs)]
    many = len({v for _, v in rows}) > 1
    head = ["case", *(["variant"] if many else []), "wall s (median)", "min-max", "peak RSS MiB", "target", *shown]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * (5 if many else 4) + "---|" + "---:|" * len(shown)]
    for (name, variant), results in rows.items():
        walls = [r["wall_s"] for r in results]
        rss = max(r["rss_mib"] for r in results)
        target = TARGETS.get(name, WARM_TARGET_S if name.endswith("warm") else None)
        verdict = "" if target is None else (f"<= {target} s " + ("ok" if statistics.median(walls) <= target else "MISSED"))
        verdict += f", <= {RSS_TARGET_MIB} MiB " + ("ok" if rss <= RSS_TARGET_MIB else "MISSED")
        cells = [name, *([variant] if many else []), f"{statistics.median(walls):.2f}", spread(walls),
                 f"{rss:.0f}", verdict]
        cells += [f"{statistics.median(r['phases'].get(p, 0.0) for r in results):.2f}" for p in shown]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[4:], sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="runs per case (median and spread over them)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--case", action="append", default=[],
                    help="an extra case: overrides in quotes, planned cold and warm")
    ap.add_argument("--json", help="also write every run's numbers to this file")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=CHECKOUT",
                    help="plan with the launcher of another checkout too (e.g. before=/tmp/old); the "
                         "variants' runs are interleaved so each sees the same load. Default: this one")
    ap.add_argument("--profile", metavar="DIR",
                    help="after the timed runs, one more run per case under cProfile: DIR/<case>.prof, "
                         "and the 20 functions with the most own time printed")
    args = ap.parse_args()
    cases = {n: CASES[n] for n in args.cases.split(",") if n}
    for extra in args.case:
        cases[f"{extra} cold"], cases[f"{extra} warm"] = (extra, True), (extra, False)
    variants = {"this": None} if not args.variant else {
        v.partition("=")[0]: str(Path(v.partition("=")[2]).resolve()) for v in args.variant}
    VARIANTS.clear()
    VARIANTS.update(variants)
    rows: dict[tuple[str, str], list[dict]] = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_plan-") as tmp:
        for name, (overrides, cold) in cases.items():
            print(f"{name}: {overrides}", file=sys.stderr, flush=True)
            by_variant = bench_case(name.replace(" ", "_").replace("=", "-"), overrides, cold, args.runs,
                                    Path(tmp), sys.executable, variants)
            rows.update({(name, v): results for v, results in by_variant.items()})
        if args.profile:
            for name, (overrides, cold) in cases.items():
                print_profile(name, overrides, cold, Path(tmp), Path(args.profile), sys.executable)
    load_after = os.getloadavg()
    print(f"plan time per phase, median of {args.runs} runs (fresh process each; cold = empty cache_dir); "
          f"{os.cpu_count()} cores, load average {load_before[0]:.1f} before, {load_after[0]:.1f} after\n")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({f"{n} [{v}]": r for (n, v), r in rows.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

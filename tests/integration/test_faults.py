"""Faults on real 2-process CPU runs through the launcher: out-of-memory fallback that continues
from the last checkpoint with the next plan, a rank killed with SIGKILL then `resume=<run dir>`
(the resumed loss curve equals an uninterrupted run's, step for step). Kill-and-resume per backend,
through torchrun's elastic restart: tests/integration/test_resume_backends.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BASE = ["model=tiny-llama", "hardware=cpu", "gpus=2", "mode=run", "strategy=ddp", "training.seq_len=64",
        "training.precision=32-true"]
KILL_STEPS = 24
ROOT = Path(__file__).resolve().parents[2]
KILL_RUN = [*BASE, "training.micro_batch_size=2", f"training.max_steps={KILL_STEPS}", "checkpoint.every_steps=3"]


@pytest.fixture
def cache(trace_cache) -> str:
    return trace_cache


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def run_cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=cwd, env={**_env(), **(env or {})},
                          capture_output=True, text=True, timeout=300)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def effective(records: list[dict]) -> tuple[list[dict], list[int]]:
    """The trajectory the model followed: a resumed run restarts at some step s, so records of
    steps >= s written before the resume are superseded. Also returns the resume points."""
    out: list[dict] = []
    starts = []
    for r in records:
        if out and r["step"] <= out[-1]["step"]:
            starts.append(r["step"])
            out = [o for o in out if o["step"] < r["step"]]
        out.append(r)
    return out, starts


_REFERENCE: dict[str, list[dict]] = {}


def reference_metrics(run_json: Path, tmp: Path) -> list[dict]:
    """metrics.jsonl of the same run.json trained without interruption (torchrun directly)."""
    spec = json.loads(run_json.read_text())
    key = json.dumps({k: v for k, v in spec.items() if k not in ("run_dir", "resume")}, sort_keys=True)
    if key not in _REFERENCE:
        ref = tmp / "reference"
        ref.mkdir()
        (ref / "run.json").write_text(json.dumps({**spec, "run_dir": str(ref), "resume": False}))
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "-m", "launcher.worker", str(ref / "run.json")]
        result = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        _REFERENCE[key] = read_metrics(ref)
    return _REFERENCE[key]


def worker_pid(run_json: Path, rank: int) -> int | None:
    """The pid of the training worker of `rank` started for this run.json (not the --check run)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"launcher.worker" in cmd and str(run_json).encode() in cmd and b"--check" not in cmd
                and f"RANK={rank}".encode() in environ):
            return int(proc.name)
    return None


def kill_rank_after_checkpoint(proc: subprocess.Popen, run_dir: Path, checkpoint_step: int, rank: int = 1) -> int:
    """SIGKILL one rank once checkpoint `step-N` is complete and a later step has been logged."""
    marker = run_dir / "checkpoints" / f"step-{checkpoint_step}" / "COMPLETE"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if marker.exists() and len(read_metrics(run_dir)) > checkpoint_step:
            pid = worker_pid(run_dir / "run.json", rank)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                return len(read_metrics(run_dir))
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"the run ended or stalled before step {checkpoint_step + 1}: {proc.communicate()[1][-3000:]}")


def start(cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher", *args], cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def assert_same_trajectory(run_dir: Path, tmp: Path) -> list[int]:
    """Every step 1..N exactly once in the followed trajectory, reading the same batches with the
    same losses as an uninterrupted run of the same run.json."""
    records, starts = effective(read_metrics(run_dir))
    reference = reference_metrics(run_dir / "run.json", tmp)
    assert [r["step"] for r in records] == list(range(1, KILL_STEPS + 1))
    samples_per_step = 2 * 2  # world x micro-batch
    assert [r["data_positions"] for r in records] == [[(s - 1) * samples_per_step, s * samples_per_step]
                                                     for s in range(1, KILL_STEPS + 1)]
    assert [r["block_ids"] for r in records] == [r["block_ids"] for r in reference]
    # model, optimizer, scheduler and RNG restored: same losses as without the fault
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference], abs=1e-5)
    return starts


def files_except(run_dir: Path, *continued: str) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run_dir.rglob("*")
            if p.is_file() and not str(p.relative_to(run_dir)).startswith(continued)}


def test_kill_one_rank_then_resume_run_dir(tmp_path: Path, cache: str) -> None:
    run = tmp_path / "run"
    proc = start(tmp_path, *KILL_RUN, cache, f"hydra.run.dir={run}")
    logged = kill_rank_after_checkpoint(proc, run, checkpoint_step=3)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "training exited with code" in stderr, stderr[-2000:]
    assert logged < KILL_STEPS and not (run / "summary.json").exists()
    before = files_except(run, "metrics.jsonl", "checkpoints")

    resumed = run_cli(f"resume={run}", cache, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    after = files_except(run, "metrics.jsonl", "checkpoints")
    assert {k: v for k, v in after.items() if k in before} == before  # nothing of the first run rewritten
    assert {"run-resume-1.json", "launch_command-resume-1.sh", "summary.json"} <= set(after)
    assert any(k.startswith(".hydra-resume-1/") for k in after)
    starts = assert_same_trajectory(run, tmp_path)
    last_checkpoint = int(resumed.stdout.split("resumed from ")[1].split(" at step ")[1].split()[0])
    assert starts == [last_checkpoint + 1] and last_checkpoint % 3 == 0

    # resuming a finished run, or one whose checkpoints are all truncated: one line, exit 2, nothing written
    listing = sorted(p.name for p in run.rglob("*"))
    finished = run_cli(f"resume={run}", cache, cwd=tmp_path)
    assert finished.returncode == 2 and f"already training.max_steps={KILL_STEPS}" in finished.stderr
    assert sorted(p.name for p in run.rglob("*")) == listing
    for ckpt in (run / "checkpoints").glob("step-*"):
        model = ckpt / "model.pt"
        model.write_bytes(model.read_bytes()[:1000])
    listing = sorted(p.name for p in run.rglob("*"))
    corrupt = run_cli(f"resume={run}", f"training.max_steps={KILL_STEPS + 6}", cache, cwd=tmp_path)
    lines = [ln for ln in corrupt.stderr.splitlines() if ln.strip()]
    assert corrupt.returncode == 2 and len(lines) == 1, corrupt.stderr
    assert "no complete checkpoint" in lines[0] and "model.pt has 1000 bytes" in lines[0]
    assert sorted(p.name for p in run.rglob("*")) == listing


def test_out_of_memory_continues_from_checkpoint_with_next_plan(tmp_path: Path, cache: str) -> None:
    """The cap plays a device that is smaller than the estimate of the fastest candidate (micro-batch
    4) but larger than the next one's (micro-batch 2), as the planner estimated them, from step
    OOM_STEP on: the first plan runs out of memory there, and the next plan continues from the
    checkpoint of the step before, with the same data position and RNG states."""
    from launcher import app, cli, planner
    from launcher.hardware import cluster_from

    oom_step, steps = 3, 5
    args = [*BASE, "planner.max_micro_batch_size=4", f"training.max_steps={steps}", "checkpoint.every_steps=1",
            "training.learning_rate=3e-3", cache]
    config = cli.compose(args)
    plan = planner.plan(config, app.model_spec(config), cluster_from(config.hardware, config.gpus, config.nodes))
    first = plan.candidates[plan.chosen]
    smaller = [c for c in plan.candidates if c.fits and c.memory.device_total_bytes < first.memory.device_total_bytes]
    assert first.micro_batch_size == 4 and smaller, plan
    second = smaller[0]
    cap = (first.memory.device_total_bytes + second.memory.device_total_bytes) // 2

    run = tmp_path / "run"
    result = run_cli(*args, f"worker.simulate_oom_above_bytes={cap}", f"hydra.run.dir={run}", cwd=tmp_path,
                     env={"LAUNCHER_SIMULATE_OOM_FROM_STEP": str(oom_step)})
    assert result.returncode == 0, result.stderr[-3000:]
    attempts = json.loads((run / "fallback.json").read_text())["attempts"]
    assert [a["result"] for a in attempts] == ["out_of_memory", "finished"]
    assert attempts[0]["steps_lost"] == 0
    assert attempts[1]["resumed_from"]["step"] == oom_step - 1
    assert attempts[1]["resumed_from"]["checkpoint"] == str(run / "checkpoints" / f"step-{oom_step - 1}")
    oom = json.loads((run / "oom.json").read_text())
    assert sorted(oom["ranks"]) == ["0", "1"] and oom["step"] == oom_step
    assert all(r["peak_allocated_bytes"] > cap for r in oom["ranks"].values())
    assert oom["estimate"]["device_total_bytes"] == first.memory.device_total_bytes
    # first attempt's files untouched: its run.json still has micro-batch 4 and its metrics stop before the failure
    assert json.loads((run / "run.json").read_text())["micro_batch_size"] == 4
    first_records = read_metrics(run)
    assert [r["step"] for r in first_records] == list(range(1, oom_step))
    second_dir = run / "attempt-2"
    assert json.loads((second_dir / "run.json").read_text())["micro_batch_size"] == second.micro_batch_size
    records = read_metrics(second_dir)
    # step oom_step follows with the next plan, reading on from where the first plan stopped
    assert [r["step"] for r in records] == list(range(oom_step, steps + 1))
    assert records[0]["data_positions"][0] == first_records[-1]["data_positions"][1] == (oom_step - 1) * 2 * 4
    assert records[0]["data_positions"][1] - records[0]["data_positions"][0] == 2 * second.micro_batch_size
    assert all(max(r["peak_allocated_bytes"]) <= cap for r in records)
    # the weights and optimizer state came along: the loss goes on from the first plan's, not from the start
    assert records[0]["loss"] < first_records[0]["loss"] - 0.2, (first_records, records)
    assert f"resumed from {run / 'checkpoints' / f'step-{oom_step - 1}'} at step {oom_step - 1}" in result.stdout
    assert "steps lost: 0" in result.stderr and "attempt 2" in result.stdout and "finished" in result.stdout
    summary = json.loads((second_dir / "summary.json").read_text())
    assert summary["resumed_from"]["step"] == oom_step - 1 and summary["first_step"] == oom_step

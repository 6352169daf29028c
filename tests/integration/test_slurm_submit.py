"""Real Slurm jobs through the launcher's command line on the local cluster (scripts/slurm-local):
2-process CPU fine-tuning submitted with launch=slurm, a cancelled job that must not hang the
launcher, the standalone sbatch script submitted by hand, and a -m sweep submitting one job per point."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from slurm_cluster import default_partition

pytestmark = [pytest.mark.slurm, pytest.mark.integration]

TRAIN = ["model=tiny-llama", "hardware=cpu", "gpus=2", "nodes=1", "strategy=ddp", "training.seq_len=64",
         "training.micro_batch_size=2", "training.learning_rate=3e-3", "training.precision=32-true"]


def _slurm(cli_args: list[str]) -> list[str]:
    return [*cli_args, "launch=slurm", f"launch.partition={default_partition()}", "launch.cpus_per_task=2",
            "launch.mem_gb=2", "launch.time_min=10"]


def _sacct(job_id: str) -> str:
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True,
                          text=True, timeout=30).stdout.split()
    return out[0] if out else ""


def _trained(run_dir: Path, steps: int) -> None:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    losses = [r["loss"] for r in records]
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["last_step"] == steps and len(summary["measured_peak_allocated_bytes"]) == 2


def test_launch_slurm_trains_and_completes(slurm_cluster, cli):
    r = cli(*_slurm(TRAIN), "training.max_steps=8", "mode=run", timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (run_dir,) = (cli.cwd / "runs").glob("*/*")
    job_id = (run_dir / "slurm_job_id").read_text().strip()
    assert f"Slurm job {job_id}: COMPLETED" in r.stdout
    assert _sacct(job_id) == "COMPLETED"
    _trained(run_dir, 8)
    assert "loss" in (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()  # rank 0's progress, in the job log


def test_cancelled_job_does_not_hang_the_launcher(slurm_cluster, tmp_path, trace_cache):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "launcher", *_slurm(TRAIN), "training.max_steps=100000",
                             "mode=run", trace_cache, f"hydra.run.dir={tmp_path / 'run'}"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        id_file = tmp_path / "run" / "slurm_job_id"
        deadline = time.monotonic() + 240
        while not (id_file.exists() and (tmp_path / "run" / "metrics.jsonl").exists()):  # training has started
            assert proc.poll() is None and time.monotonic() < deadline, "job never started training"
            time.sleep(1)
        job_id = id_file.read_text().strip()
        subprocess.run(["scancel", job_id], check=True, timeout=30)
        out, err = proc.communicate(timeout=120)  # bounded: the launcher must notice the cancellation
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    assert proc.returncode == 1, err[-2000:]
    assert f"Slurm job {job_id} ended CANCELLED" in err
    assert _sacct(job_id) == "CANCELLED"


def test_sbatch_script_submitted_by_hand_trains(slurm_cluster, cli):
    r = cli(*TRAIN, "training.max_steps=6", "mode=run", "launch=sbatch_script", "launch.cpus_per_task=2",
            "launch.mem_gb=2", "launch.time_min=10", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (run_dir,) = (cli.cwd / "runs").glob("*/*")
    assert not (run_dir / "metrics.jsonl").exists()  # written, not started
    assert f"submit with: sbatch {run_dir / 'sbatch.sh'}" in r.stdout
    job_id = subprocess.run(["sbatch", "--parsable", str(run_dir / "sbatch.sh")], capture_output=True, text=True,
                            check=True, timeout=30).stdout.strip().split(";")[0]
    deadline = time.monotonic() + 300
    while _sacct(job_id) in ("", "PENDING", "RUNNING", "COMPLETING"):
        assert time.monotonic() < deadline, f"job {job_id} did not end"
        time.sleep(2)
    assert _sacct(job_id) == "COMPLETED", (run_dir / f"slurm-{job_id}.out").read_text()[-2000:]
    _trained(run_dir, 6)


def test_multirun_submits_one_job_per_point(slurm_cluster, cli):
    r = cli("-m", *_slurm(TRAIN), "training.max_steps=4", "training.seq_len=32,64", "mode=run",
            "launch.wait=false", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dirs = sorted(p.parent for p in (cli.cwd / "runs").glob("*/*/*/slurm_job_id"))
    assert len(run_dirs) == 2
    seq_lens = sorted(json.loads((d / "run.json").read_text())["seq_len"] for d in run_dirs)
    assert seq_lens == [32, 64]
    for d in run_dirs:
        job_id = (d / "slurm_job_id").read_text().strip()
        deadline = time.monotonic() + 300
        while _sacct(job_id) in ("", "PENDING", "RUNNING", "COMPLETING"):
            assert time.monotonic() < deadline, f"job {job_id} did not end"
            time.sleep(2)
        assert _sacct(job_id) == "COMPLETED"
        assert json.loads((d / "summary.json").read_text())["last_step"] == 4

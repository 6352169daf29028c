"""The local Slurm cluster runs batch jobs, keeps accounting, and serves submitit end to end."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from slurm_cluster import default_partition

pytestmark = [pytest.mark.slurm, pytest.mark.integration]

JOB_TIMEOUT_S = 30  # sbatch jobs finish in ~1 s on this cluster; submitit jobs in a few seconds


def _sacct_state(job_id: str) -> str:
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True,
                         text=True, check=True, timeout=30).stdout.split("\n")
    return out[0].strip()


def _final_sacct_state(job_id: str) -> str:
    """The accounting state once the job has left PENDING/RUNNING/COMPLETING."""
    busy = {"", "PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "RESIZING", "SUSPENDED"}
    return _wait(lambda: (s := _sacct_state(job_id)) not in busy and s, f"end of job {job_id} in sacct")


def _wait(predicate, what: str, timeout_s: float = JOB_TIMEOUT_S):
    """Poll `predicate` until it returns a truthy value; fail (never hang) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"{what} not reached within {timeout_s} s")


def _executor(folder: Path):
    import submitit

    executor = submitit.AutoExecutor(folder=folder)
    assert executor.cluster == "slurm"
    executor.update_parameters(slurm_partition=default_partition(), timeout_min=5, cpus_per_task=1, mem_gb=1)
    return executor


def test_sbatch_job_completes_and_is_accounted(slurm_cluster, tmp_path):
    out_path = tmp_path / "job.out"
    job_id = subprocess.run(["sbatch", "--parsable", f"--output={out_path}", "--wrap", "echo hi"],
                            capture_output=True, text=True, check=True, timeout=30).stdout.strip().split(";")[0]
    assert _final_sacct_state(job_id) == "COMPLETED"
    assert out_path.read_text() == "hi\n"


def test_submitit_returns_function_result(slurm_cluster, tmp_path):
    def job_identity(x: int) -> tuple[str, int]:
        return os.environ["SLURM_JOB_ID"], x * 7

    job = _executor(tmp_path / "submitit").submit(job_identity, 6)
    _wait(lambda: job.done(force_check=True), f"end of submitit job {job.job_id}")
    assert job.result() == (job.job_id, 42)
    assert _final_sacct_state(job.job_id) == "COMPLETED"


def test_cancelled_job_is_done(slurm_cluster, tmp_path):
    job = _executor(tmp_path / "submitit").submit(time.sleep, 600)
    _wait(lambda: job.watcher.get_state(job.job_id, mode="force") == "RUNNING", f"job {job.job_id} running")
    job.cancel(check=True)
    _wait(lambda: job.done(force_check=True), f"done() after cancelling job {job.job_id}")
    assert job.state.startswith("CANCELLED")
    assert _final_sacct_state(job.job_id).startswith("CANCELLED")

"""A launch=slurm job on the local cluster (scripts/slurm-local) that runs out of memory falls
back to the next plan inside its allocation, is then preempted (submitit's own test hook: SIGTERM
then USR2, as Slurm preemption does), checkpoints, is requeued, and continues from that
checkpoint to the end."""
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

STEPS = 60
ARGS = ["model=tiny-llama", "hardware=cpu", "gpus=2", "nodes=1", "strategy=ddp", "training.seq_len=32",
        "training.precision=32-true", "planner.max_micro_batch_size=4", f"training.max_steps={STEPS}",
        "checkpoint.every_steps=1"]


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def _squeue(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30).stdout


def _accounting(job_id: str) -> str:
    """Every run of the job as sacct recorded it, to say why a failed job ended."""
    return "\nsacct:\n" + subprocess.run(
        ["sacct", "-X", "-D", "-P", "-j", job_id, "-o", "JobID,State,ExitCode,Reason,Start,End"],
        capture_output=True, text=True, timeout=30).stdout


def _cap(cache: str) -> int:
    """A device between the estimates of the fastest candidate (micro-batch 4) and the next."""
    from launcher import app, cli, planner
    from launcher.hardware import cluster_from

    config = cli.compose([*ARGS, cache])
    plan = planner.plan(config, app.model_spec(config), cluster_from(config.hardware, config.gpus, config.nodes))
    first = plan.candidates[plan.chosen]
    second = next(c for c in plan.candidates if c.fits and c.memory.device_total_bytes < first.memory.device_total_bytes)
    assert first.micro_batch_size == 4
    return (first.memory.device_total_bytes + second.memory.device_total_bytes) // 2


def test_out_of_memory_falls_back_in_the_job_and_requeue_continues(slurm_cluster, tmp_path, trace_cache):
    import submitit

    cache = trace_cache
    run = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "LAUNCHER_SIMULATE_OOM_FROM_STEP": "3"}
    proc = subprocess.Popen([sys.executable, "-m", "launcher", *ARGS, f"worker.simulate_oom_above_bytes={_cap(cache)}",
                             "mode=run", "launch=slurm", f"launch.partition={default_partition()}",
                             "launch.cpus_per_task=2", "launch.mem_gb=2", "launch.time_min=10", cache,
                             f"hydra.run.dir={run}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    second = run / "attempt-2"
    try:
        deadline = time.monotonic() + 300
        while len(_records(second / "metrics.jsonl")) < 4:  # the fallback's attempt is training
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.5)
        job_id = (run / "slurm_job_id").read_text().strip()
        submitit.SlurmJob(folder=run / "slurm", job_id=job_id)._interrupt()  # preemption: SIGTERM, then USR2
        # Slurm holds a requeued job for about two minutes before it may start again; let it start
        # sooner, but not in the second its last run ended: a credential created no later than the
        # second the old one was revoked is refused (src/common/slurm_cred.c: ctime <= revoked), and
        # slurmctld then ends the job FAILED ("Killing non-startable batch JobId=1: Job credential
        # revoked") without running it
        while not (second / "stopped-1.json").exists() and "PENDING" not in _squeue(job_id):
            assert proc.poll() is None and time.monotonic() < deadline + 120, proc.communicate()[1][-3000:]
            time.sleep(0.5)
        if "PENDING" in _squeue(job_id):
            time.sleep(2)
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True, timeout=30)
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    assert proc.returncode == 0, out[-2000:] + err[-3000:] + _accounting(job_id)
    assert f"Slurm job {job_id}: COMPLETED" in out

    # the fallback ran inside the job: attempt 2 continued from attempt 1's step-2 checkpoint
    attempts = json.loads((run / "fallback.json").read_text())["attempts"]
    assert [a["result"] for a in attempts] == ["out_of_memory", "finished"]
    assert attempts[1]["resumed_from"]["step"] == 2 and attempts[0]["steps_lost"] == 0
    assert json.loads((run / "run.json").read_text())["micro_batch_size"] == 4
    assert json.loads((second / "run.json").read_text())["micro_batch_size"] == 2

    # preempted: the ranks checkpointed the step they were at, the job was requeued and continued there
    stopped = json.loads((second / "stopped-1.json").read_text())
    assert stopped["signals"] and Path(stopped["checkpoint"]).name == f"step-{stopped['step']}"
    records = _records(second / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(3, STEPS + 1))  # nothing redone, nothing skipped
    assert 3 <= stopped["step"] < STEPS
    assert all(a["data_positions"][1] == b["data_positions"][0] for a, b in zip(records, records[1:]))
    states = subprocess.run(["sacct", "-n", "-X", "-D", "-P", "-j", job_id, "-o", "State"], capture_output=True,
                            text=True, timeout=30).stdout.split()
    assert "REQUEUED" in states and states[-1] == "COMPLETED", states
    log = (run / "slurm" / f"{job_id}_0_log.out").read_text()
    assert f"resumed from {stopped['checkpoint']} at step {stopped['step']}" in log
    assert json.loads((second / "summary.json").read_text())["last_step"] == STEPS

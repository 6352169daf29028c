"""How the launcher decides a Slurm job has ended (launcher/slurm.py `wait_for_end`, `in_queue`):
a requeue after preemption passes through moments where the job's last run reads FAILED and
squeue does not list it; only a job gone from the queue on two polls in a row has ended."""
from __future__ import annotations

import subprocess

from launcher import slurm


class _Job:
    job_id = "7"

    def done(self, force_check: bool = False) -> bool:
        return True  # submitit reads sacct: the last run's FAILED says done during a requeue


def _wait(monkeypatch, timeline: list[tuple[bool, str]]) -> str:
    """Poll a job whose (listed by squeue, sacct state) follows `timeline`, one entry per poll."""
    now = {"poll": -1}

    def in_queue(job_id):
        now["poll"] = min(now["poll"] + 1, len(timeline) - 1)
        return timeline[now["poll"]][0]

    monkeypatch.setattr(slurm, "in_queue", in_queue)
    monkeypatch.setattr(slurm, "sacct_state", lambda job_id: timeline[now["poll"]][1])
    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    return slurm.wait_for_end(_Job(), timeout_s=60)


def test_a_requeue_in_progress_is_not_the_end(monkeypatch):
    # running; a moment out of squeue with the last run FAILED while slurmctld requeues it; pending
    # and running again; then gone, completed
    timeline = [(True, "RUNNING"), (False, "FAILED"), (True, "PENDING"), (True, "RUNNING"),
                (False, "COMPLETED"), (False, "COMPLETED")]
    assert _wait(monkeypatch, timeline) == "COMPLETED"


def test_a_job_gone_twice_has_ended_with_its_accounting_state(monkeypatch):
    assert _wait(monkeypatch, [(True, "RUNNING"), (False, "FAILED"), (False, "FAILED")]) == "FAILED"


def test_squeue_failures_count_as_queued_unless_the_job_is_unknown(monkeypatch):
    def squeue(returncode: int, stdout: str = "", stderr: str = ""):
        return lambda *a, **k: subprocess.CompletedProcess(a, returncode, stdout, stderr)

    monkeypatch.setattr(slurm.subprocess, "run", squeue(0, "RUNNING\n"))
    assert slurm.in_queue("7")
    monkeypatch.setattr(slurm.subprocess, "run", squeue(0, "REQUEUED\n"))  # on its way back to PENDING
    assert slurm.in_queue("7")
    monkeypatch.setattr(slurm.subprocess, "run", squeue(0, "COMPLETED\n"))  # --states=all lists ended jobs too
    assert not slurm.in_queue("7")
    monkeypatch.setattr(slurm.subprocess, "run", squeue(1, stderr="slurm_load_jobs error: Socket timed out"))
    assert slurm.in_queue("7")
    monkeypatch.setattr(slurm.subprocess, "run", squeue(1, stderr="slurm_load_jobs error: Invalid job id specified"))
    assert not slurm.in_queue("7")
    monkeypatch.setattr(slurm.subprocess, "run", squeue(0, ""))
    assert not slurm.in_queue("7")

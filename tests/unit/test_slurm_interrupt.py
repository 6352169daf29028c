"""Ctrl-C while the launcher waits for a Slurm job asks whether to cancel it."""
from __future__ import annotations

import pytest

from launcher import slurm


class FakeJob:
    job_id = "4242"

    def __init__(self) -> None:
        self.cancelled = 0

    def cancel(self, check: bool = True) -> None:
        self.cancelled += 1


@pytest.mark.parametrize("answer, cancelled", [("y", 1), ("yes", 1), ("n", 0), ("", 0)])
def test_ctrl_c_asks_whether_to_cancel(monkeypatch, capsys, answer, cancelled):
    job, prompts = FakeJob(), []
    monkeypatch.setattr("builtins.input", lambda prompt: prompts.append(prompt) or answer)
    assert slurm.interrupted(job) == 130
    assert job.cancelled == cancelled
    assert prompts == ["\nstopped waiting for Slurm job 4242; cancel the job too? [y/N] "]
    err = capsys.readouterr().err
    assert ("cancelled Slurm job 4242" in err) == bool(cancelled)
    assert ("keeps running (scancel 4242" in err) == (not cancelled)


def test_no_terminal_keeps_the_job(monkeypatch):
    def no_input(prompt):
        raise EOFError

    job = FakeJob()
    monkeypatch.setattr("builtins.input", no_input)
    assert slurm.interrupted(job) == 130 and job.cancelled == 0


def test_wait_interrupted_goes_through_the_question(monkeypatch, tmp_path):
    """slurm.run: a KeyboardInterrupt during the wait ends in `interrupted`, not a traceback."""
    from types import SimpleNamespace

    job = FakeJob()
    monkeypatch.setattr("launcher.launch.check", lambda j: None)
    monkeypatch.setattr(slurm, "submit", lambda *a, **k: job)
    monkeypatch.setattr(slurm, "wait_for_end", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    launch = SimpleNamespace(wait=True, wait_timeout_min=1, time_min=1)
    config = SimpleNamespace(launch=launch, nodes=1)
    assert slurm.run(config, SimpleNamespace(run_dir=tmp_path)) == 130
    assert job.cancelled == 1

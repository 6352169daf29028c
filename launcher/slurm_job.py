"""The body of a launch=slurm job: the out-of-memory fallback and the requeue on preemption or
time limit, inside the allocation.

`FallbackTask` is what submitit runs on each node (one task per node). It runs the plan's
torchrun through `launcher.fallback.run_with_fallback`, so an out-of-memory failure relaunches
the next plan from the last checkpoint in the same allocation, as a local run does.

Requeue: it is a `submitit.helpers.Checkpointable`. The job is submitted with `--requeue` and
`--signal=USR2@<launch.signal_delay_s>` (submitit's preemption/timeout signal). On that signal
submitit calls `checkpoint()`, which asks the training ranks to stop (SIGUSR1: they finish the
step, write a checkpoint and RUN_DIR/stopped.json, launcher/worker/stop.py), waits for them, and
returns the task itself; submitit then requeues the job (`scontrol requeue`). The requeued job
calls the task again, which continues the current attempt from its newest checkpoint. torchrun
ignores USR1/USR2 (it would die of them); the ranks handle them, and SIGTERM too (preemption).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path

import submitit

from launcher import fallback, launch
from launcher.runspec import RunSpec
from launcher.shell import resolve
from launcher.worker import checkpoint, stop

STOP_WAIT_S = 60.0
"""Longest `checkpoint()` waits for the ranks to write their checkpoint and exit."""


def _ignore_stop_signals() -> None:  # torchrun's preexec: the ranks handle these, torchrun must live
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)


def _ended(proc: subprocess.Popen) -> bool:
    """Whether torchrun has exited, also from inside a signal handler (where the interrupted
    poll may hold Popen's wait lock)."""
    import psutil

    if proc.poll() is not None:
        return True
    try:
        return psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class FallbackTask(submitit.helpers.Checkpointable):
    def __init__(self, plan, config, spec, job, env: dict) -> None:
        self.plan, self.config, self.spec, self.job, self.env = plan, config, spec, job, env
        self.index = plan.chosen
        self.requeues = 0
        self.state: dict = {}  # the fallback's attempts so far (launcher/fallback.py)
        self._proc = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_proc": None}

    def __call__(self) -> str:
        job = self._continue_job() if self.requeues else self.job
        plan = dataclasses.replace(self.plan, chosen=self.index)
        rc, final = fallback.run_with_fallback(plan, self.config, self.spec, job, execute=self._execute,
                                               state=self.state)
        if rc != 0:
            raise RuntimeError(f"training exited with code {rc}; logs in {final}")
        return str(final)

    def _values(self) -> dict:
        hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                               capture_output=True, text=True, check=True).stdout.split()
        return {"MASTER_ADDR": hosts[0], "RUN_ID": os.environ["SLURM_JOB_ID"]}

    def _execute(self, job, index: int) -> int:
        self.job, self.index = job, index
        values = self._values()
        env = {**os.environ, **self.env, **values, stop.STOP_ON_SIGTERM_ENV: "1"}
        self._proc = subprocess.Popen([resolve(a, values) for a in job.argv], env=env,
                                      preexec_fn=_ignore_stop_signals)
        while not _ended(self._proc):
            time.sleep(0.5)
        rc = self._proc.wait()
        marker = stop.read_marker(job.run_dir)
        if rc != 0 and marker is not None:
            # stopped on Slurm's signal with a checkpoint: submitit's handler requeues the job
            deadline = time.monotonic() + STOP_WAIT_S
            while time.monotonic() < deadline:
                time.sleep(0.5)
            raise RuntimeError(f"training stopped on {', '.join(marker['signals'])} at step {marker['step']} "
                               f"(checkpoint {marker['checkpoint']}) and the job was not requeued")
        return rc

    def checkpoint(self, *args, **kwargs):
        """Called by submitit on its preemption/timeout signal: checkpoint, then requeue."""
        import psutil

        proc = self._proc
        if proc is not None and not _ended(proc):
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + STOP_WAIT_S
            while not _ended(proc) and time.monotonic() < deadline:
                time.sleep(0.5)
        self.requeues += 1
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    def _continue_job(self):
        """The current attempt again, from its newest complete checkpoint (or from where it was
        started when it has saved none)."""
        run_dir = Path(self.job.run_dir)
        marker = run_dir / stop.STOP_FILE
        if marker.is_file():
            marker.rename(run_dir / f"stopped-{self.requeues}.json")
        spec = RunSpec.load(self.job.argv[-1])
        own = checkpoint.find_resume_dir(run_dir, True, warn=False)
        spec_path = run_dir / f"run-requeue-{self.requeues}.json"
        dataclasses.replace(spec, resume=True if own is not None else spec.resume).save(spec_path)
        return launch.Job((*self.job.argv[:-1], str(spec_path)), self.job.env, run_dir, self.job.world_size)

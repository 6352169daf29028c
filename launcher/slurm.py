"""Run the plan's torchrun command on a Slurm cluster.

launch=slurm submits a job with submitit (https://github.com/facebookincubator/submitit,
`submitit.AutoExecutor`): one task per node, each running `run_node`, which starts torchrun
against a c10d rendezvous hosted on the first node of the allocation (`scontrol show hostnames
$SLURM_JOB_NODELIST`, first line), with the Slurm job id as rendezvous id. This is the layout of
PyTorch's own Slurm example (pytorch/examples, distributed/ddp-tutorial-series/slurm/sbatch_run.sh:
`srun torchrun --nnodes ... --rdzv_backend c10d --rdzv_endpoint $head_node_ip:29500`). Under
c10d, torchrun assigns node ranks at rendezvous (torch/distributed/run.py uses --node-rank only
for the static backend), so every node runs the same command.

The submitted function is `launcher.slurm_job.FallbackTask`: the out-of-memory fallback runs
inside the allocation, and the job is requeued on preemption or time limit (`--requeue`,
`--signal=USR2@launch.signal_delay_s`), continuing from the checkpoint the ranks write on that
signal.

launch=sbatch_script writes the same job as RUN_DIR/sbatch.sh for submission by hand.

Waiting is bounded: the launcher polls submitit (which reads `sacct`) and `squeue`, stops waiting
when the job has left the queue (finished, failed or cancelled) or after
launch.wait_timeout_min, and reports the final state from `sacct`.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from launcher.shell import resolve, shell_word
from launcher.config import LauncherConfig
from launcher.errors import one_line
from launcher import launch

"""Variables of the torchrun argv (launcher/launch.py torchrun_argv) that only the job knows."""
SAFE_VALUE = re.compile(r"[A-Za-z0-9_.,:@+\-]+")
"""Characters allowed in a value written into an `#SBATCH` line (sbatch parses those lines
itself, not a shell, so values are restricted instead of quoted)."""
BUSY_STATES = {"", "PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "RESIZING",
               "SUSPENDED", "UNKNOWN", "READY"}
QUEUED_STATES = BUSY_STATES | {"REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT", "STOPPED", "SPECIAL_EXIT"}
"""squeue states of a job that has not ended: a requeued job passes through REQUEUED (or
REQUEUE_HOLD) on its way back to PENDING, which squeue lists only with --states=all."""
SCRIPT_NAME = "sbatch.sh"
REPO_ROOT = Path(__file__).resolve().parent.parent


def launch_problems(c: LauncherConfig) -> list[str]:
    """Every problem with the launch.* keys, each naming the key and the fix."""
    out: list[str] = []
    launch = c.launch
    for key in ("partition", "account"):
        value = getattr(launch, key)
        if value is not None and not SAFE_VALUE.fullmatch(value):
            out.append(f"launch.{key}={value!r}: use letters, digits and _.,:@+- only (a Slurm {key} name)")
    if launch.time_min < 1:
        out.append(f"launch.time_min={launch.time_min}: must be at least 1 (minutes)")
    for key in ("cpus_per_task", "mem_gb"):
        value = getattr(launch, key)
        if value is not None and value < 1:
            out.append(f"launch.{key}={value}: must be at least 1, or null for the cluster's default")
    if launch.gpus_per_node is not None and launch.gpus_per_node < 0:
        out.append(f"launch.gpus_per_node={launch.gpus_per_node}: must be zero or more, or null (gpus / nodes)")
    if launch.wait_timeout_min is not None and not launch.wait_timeout_min > 0:
        out.append(f"launch.wait_timeout_min={launch.wait_timeout_min}: must be positive, or null")
    if launch.signal_delay_s < 1:
        out.append(f"launch.signal_delay_s={launch.signal_delay_s}: must be at least 1 (seconds before the time limit)")
    if launch.kind.name != "torchrun" and c.mode.name in ("measure", "calibrate"):
        out.append(f"mode={c.mode.name} runs on this machine: use launch=torchrun (or mode=run / mode=plan)")
    if launch.kind.name != "torchrun" and isinstance(c.resume, str):
        out.append(f"resume with launch={launch.kind.name}: resuming runs on this machine; "
                   f"resume on a node of the cluster with launch=torchrun")
    return out


def gpus_per_node(config: LauncherConfig) -> int:
    if config.launch.gpus_per_node is not None:
        return config.launch.gpus_per_node
    return 0 if config.hardware.device == "cpu" else config.gpus // config.nodes


def task_env(config: LauncherConfig, env: dict) -> dict:
    """The job's environment on top of the launcher's: threads per rank from the CPUs Slurm gives
    the task, and the launcher package importable on the nodes."""
    out = dict(env)
    if config.launch.cpus_per_task:
        out["OMP_NUM_THREADS"] = str(max(1, config.launch.cpus_per_task // (config.gpus // config.nodes)))
    out["PYTHONPATH"] = str(REPO_ROOT)
    return out


def job_name(config: LauncherConfig) -> str:
    return "launcher-" + re.sub(r"[^A-Za-z0-9_.\-]", "_", config.model.name)


# ---- the standalone sbatch script ----------------------------------------------------------

def sbatch_options(config: LauncherConfig, run_dir: Path) -> list[str]:
    """The #SBATCH options of the job (sbatch(1) of Slurm 22.05)."""
    launch = config.launch
    opts = [f"--job-name={job_name(config)}", f"--nodes={config.nodes}", "--ntasks-per-node=1"]
    if gpus_per_node(config):
        opts.append(f"--gpus-per-node={gpus_per_node(config)}")
    if launch.cpus_per_task:
        opts.append(f"--cpus-per-task={launch.cpus_per_task}")
    if launch.mem_gb:
        opts.append(f"--mem={launch.mem_gb}G")
    opts.append(f"--time={launch.time_min}")
    opts += [f"--{key}={getattr(launch, key)}" for key in ("partition", "account") if getattr(launch, key)]
    output = f"{run_dir}/slurm-%j.out"
    if SAFE_VALUE.fullmatch(output.replace("/", "").replace("%", "")):
        opts.append(f"--output={output}")
    return opts


def render_sbatch_script(config: LauncherConfig, argv: list[str], env: dict, run_dir: Path,
                         description: str) -> str:
    """A readable, standalone sbatch script running `argv` (the torchrun command) once per node."""
    out = ["#!/usr/bin/env bash", f"# {description}", f"# Written by `python -m launcher` into {run_dir}.",
           "# Submit with:", f"#   sbatch {shlex.quote(str(run_dir / SCRIPT_NAME))}"]
    opts = sbatch_options(config, run_dir)
    if not any(o.startswith("--output=") for o in opts):
        out.append(f"#   (add --output={shlex.quote(str(run_dir / 'slurm-%j.out'))}: the run directory's "
                   f"path cannot be written into an #SBATCH line)")
    out += [f"#SBATCH {o}" for o in opts]
    out += ["set -euo pipefail", ""]
    out += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    out += ["# The first node of the allocation hosts torchrun's c10d rendezvous; the job id names it.",
            'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            'RUN_ID="$SLURM_JOB_ID"', "export MASTER_ADDR RUN_ID", "",
            f"# One task per node; each runs torchrun, which starts {config.gpus // config.nodes} rank(s) "
            f"on its node.", "srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\"]
    lines = command_lines(argv)
    out += [f"  {ln} \\" for ln in lines[:-1]] + [f"  {lines[-1]}", ""]
    return "\n".join(out)


def command_lines(argv: list[str]) -> list[str]:
    """The quoted command, one option per line; `-m MODULE ...` and positional words stay on the line."""
    lines: list[str] = []
    for arg in argv:
        word = shell_word(arg)
        if not lines or arg.startswith("--") or arg == "-m":
            lines.append(word)
        else:
            lines[-1] += " " + word
    return lines


def write_sbatch_script(config: LauncherConfig, job, description: str) -> Path:
    path = job.run_dir / SCRIPT_NAME
    path.write_text(render_sbatch_script(config, list(job.argv), task_env(config, job.env), job.run_dir,
                                         description))
    path.chmod(0o755)
    return path


# ---- submission with submitit --------------------------------------------------------------

def run_node(argv: list[str], env: dict) -> int:
    """Body of each Slurm task (one per node): torchrun with the rendezvous on the first node.
    Raises when torchrun fails, so that submitit and sacct record the task as failed."""
    hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()
    values = {"MASTER_ADDR": hosts[0], "RUN_ID": os.environ["SLURM_JOB_ID"]}
    rc = subprocess.run([resolve(a, values) for a in argv], env={**os.environ, **env, **values}).returncode
    if rc != 0:
        raise RuntimeError(f"torchrun exited with code {rc} on node {os.environ.get('SLURMD_NODENAME', '?')}")
    return rc


def submit(config: LauncherConfig, job, plan=None, spec=None):
    """Submit `job` (launcher.launch.Job) as a Slurm job; return the submitit Job. With the plan
    and model spec, the job carries the out-of-memory fallback and requeues itself
    (launcher/slurm_job.py); without, it runs the one torchrun command (`run_node`)."""
    import submitit

    executor = submitit.AutoExecutor(folder=job.run_dir / "slurm", cluster="slurm")
    launch = config.launch
    params = dict(name=job_name(config), nodes=config.nodes, tasks_per_node=1, timeout_min=launch.time_min,
                  gpus_per_node=gpus_per_node(config), slurm_partition=launch.partition,
                  slurm_account=launch.account, cpus_per_task=launch.cpus_per_task, mem_gb=launch.mem_gb,
                  slurm_signal_delay_s=launch.signal_delay_s, slurm_additional_parameters={"requeue": True})
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    if plan is None:
        return executor.submit(run_node, list(job.argv), task_env(config, job.env))
    from launcher.slurm_job import FallbackTask  # submitit's classes: imported only to submit

    return executor.submit(FallbackTask(plan, config, spec, job, task_env(config, job.env)))


def submission_error(err: BaseException) -> str | None:
    """sbatch's own reason for refusing a job (its last `error:` or `fatal:` line, as submitit's
    FailedJobError carries sbatch's output), or why sbatch could not run; None for any other error."""
    from submitit.core.utils import FailedJobError

    if not isinstance(err, (FailedJobError, OSError)):
        return None
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    reason = next((line for line in reversed(lines) if "fatal" in line or "error" in line), lines[-1] if lines else "")
    return one_line(reason or type(err).__name__)


def sacct_state(job_id: str) -> str:
    """The job's accounting state (first word: 'CANCELLED by 0' -> 'CANCELLED'), '' if unknown."""
    try:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = out.strip().splitlines()
    return lines[0].split()[0] if lines and lines[0].strip() else ""


def in_queue(job_id: str) -> bool:
    """Whether the job has not ended: squeue (every state) lists it in a state of `QUEUED_STATES`.
    A job squeue no longer knows ('Invalid job id') has left; any other failure (slurmctld busy,
    e.g. while it requeues the job) counts as still queued."""
    try:
        proc = subprocess.run(["squeue", "-h", "--states=all", "-j", job_id, "-o", "%T"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True
    if proc.returncode != 0:
        return "invalid job id" not in proc.stderr.lower()
    return any(state.strip() in QUEUED_STATES - {""} for state in proc.stdout.split())


def wait_for_end(sjob, timeout_s: float, poll_s: float = 2.0, settle_s: float = 30.0) -> str:
    """Poll until the job has ended (submitit done and out of squeue, or gone from squeue) or
    `timeout_s` passed; return the final sacct state, 'UNKNOWN' without accounting, or
    'WAIT_TIMEOUT'. A job requeued after preemption can show its last run's FAILED in sacct while it
    waits in the queue again, so the queue decides."""
    deadline = time.monotonic() + timeout_s
    gone_polls = 0
    while True:
        queued = in_queue(sjob.job_id)
        gone_polls = gone_polls + 1 if not queued else 0
        # a requeued job is back in the queue: not done; two polls apart, so that a requeue in
        # progress (the last run ended, the job not yet pending again) is not taken for the end
        if gone_polls >= 2 and sjob.done(force_check=True):
            break
        if gone_polls >= 3:  # left the queue, but neither a result nor accounting says so yet
            break
        if time.monotonic() > deadline:
            return "WAIT_TIMEOUT"
        time.sleep(poll_s)
    settle = time.monotonic() + settle_s  # sacct lags the end of the job by up to a few seconds
    while (state := sacct_state(sjob.job_id)) in BUSY_STATES and time.monotonic() < settle:
        time.sleep(1.0)
    return state if state not in BUSY_STATES else "UNKNOWN"


def ask(prompt: str) -> str:
    """One answer from the terminal, lower-case; '' when there is none (no input, or Ctrl-C again)."""
    try:
        return input(prompt).strip().lower()
    except (EOFError, KeyboardInterrupt):
        return ""


def interrupted(sjob) -> int:
    """Ctrl-C while waiting: ask whether to cancel the job; keep it running unless the answer is yes."""
    answer = ask(f"\nstopped waiting for Slurm job {sjob.job_id}; cancel the job too? [y/N] ")
    if answer in ("y", "yes"):
        sjob.cancel(check=False)
        print(f"cancelled Slurm job {sjob.job_id}", file=sys.stderr)
    else:
        print(f"Slurm job {sjob.job_id} keeps running (scancel {sjob.job_id} to stop it)", file=sys.stderr)
    return 130


def run(config: LauncherConfig, job, quiet: bool = False, plan=None, spec=None) -> int:
    """Check the inputs here, submit, wait (bounded) and report; 0 when the job COMPLETED."""
    launch.check(job)
    try:
        sjob = submit(config, job, plan, spec)
    except Exception as err:  # noqa: BLE001 - only a refused submission is reported here
        why = submission_error(err)
        if why is None:
            raise
        print(f"error: launch.kind=slurm: the job was not submitted: {why}; the plan and launch command stay in "
              f"{job.run_dir} (check launch.partition and launch.account, or write the script with "
              "launch.kind=sbatch_script)", file=sys.stderr)
        return 1
    log = job.run_dir / "slurm" / f"{sjob.job_id}_0_log.out"
    info = sys.stderr if quiet else sys.stdout
    (job.run_dir / "slurm_job_id").write_text(f"{sjob.job_id}\n")
    print(f"submitted Slurm job {sjob.job_id} ({config.nodes} node(s)); log: {log}\n"
          f"follow: sacct -j {sjob.job_id}    cancel: scancel {sjob.job_id}", file=info)
    if not config.launch.wait:
        return 0
    timeout_min = config.launch.wait_timeout_min or config.launch.time_min + 30
    try:
        state = wait_for_end(sjob, timeout_min * 60)
    except KeyboardInterrupt:
        return interrupted(sjob)
    if state == "WAIT_TIMEOUT":
        print(f"error: Slurm job {sjob.job_id} had not ended after {timeout_min:g} min "
              f"(launch.wait_timeout_min); it keeps running: sacct -j {sjob.job_id}", file=sys.stderr)
        return 1
    print(f"Slurm job {sjob.job_id}: {state}", file=info)
    if state != "COMPLETED":
        print(f"error: Slurm job {sjob.job_id} ended {state}; log: {log}", file=sys.stderr)
        return 1
    return 0


def describe(config: LauncherConfig, candidate) -> str:
    """One line saying what the job fine-tunes on what hardware."""
    unit = "CPU process(es)" if config.hardware.device == "cpu" else f"{config.hardware.name} GPU(s)"
    return (f"Fine-tune {config.model.name} with {candidate.strategy.name} ({config.training.precision.name}, "
            f"micro-batch {candidate.micro_batch_size} x {candidate.grad_accum_steps} accumulation step(s), "
            f"seq_len {config.training.seq_len}) on {config.nodes} node(s) x {config.gpus // config.nodes} {unit}.")


def dispatch(config: LauncherConfig, job, candidate, mode: str, quiet: bool, plan=None, spec=None) -> int:
    """launch=sbatch_script: write the script; launch=slurm: submit it when mode is run."""
    info = sys.stderr if quiet else sys.stdout
    plan_text = describe(config, candidate)
    if config.launch.kind.name == "sbatch_script":
        path = write_sbatch_script(config, job, plan_text)
        print(f"sbatch script: {path}\nsubmit with: sbatch {shlex.quote(str(path))}", file=info)
        return 0
    write_sbatch_script(config, job, plan_text)  # the same job, readable, next to the submission
    if mode != "run":
        print("planned only (mode=plan): add mode=run to submit the Slurm job", file=info)
        return 0
    return run(config, job, quiet, plan, spec)

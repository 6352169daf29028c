"""A real single-node Slurm cluster (with slurmdbd accounting) for tests, via scripts/slurm-local.

tests/conftest.py registers the session fixture once, so every test module shares one cluster::

    def test_x(slurm_cluster): ...          # SLURM_CONF is set; slurm_cluster is the state dir

The cluster lives in a fresh state directory, so job ids restart at 1 in each session: give every
submitit executor a fresh folder, or results of an earlier session's job 1 would be read back.
If the Debian packages cannot be installed or the daemons do not come up in time, the
fixture skips with the script's reason ("Slurm unavailable: apt-get install failed: ...").
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "slurm-local"
READY_TIMEOUT_S = 90  # per readiness wait inside the script (munged, MariaDB, slurmdbd, node, sacct)
INSTALL_ALLOWANCE_S = 300  # apt-get update + install measured at ~50 s; the rest is slack


class SlurmUnavailable(RuntimeError):
    """The local cluster could not be installed or started; the message says why."""


def _script(action: str, state_dir: Path, timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLURM_LOCAL_TIMEOUT_S": str(READY_TIMEOUT_S)}
    return subprocess.run(["bash", str(SCRIPT), action, str(state_dir)], capture_output=True,
                          text=True, timeout=timeout_s, env=env)


def _reason(proc: subprocess.CompletedProcess) -> str:
    """The script's last `slurm-local: ...` complaint, without the prefix."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("slurm-local: ")]
    return lines[-1].removeprefix("slurm-local: ") if lines else (proc.stderr.strip() or f"exit {proc.returncode}")


def start(state_dir: Path) -> Path:
    """Start (or reuse) the cluster in `state_dir`; return the path of its slurm.conf."""
    timeout_s = INSTALL_ALLOWANCE_S + 5 * READY_TIMEOUT_S
    try:
        proc = _script("start", state_dir, timeout_s)
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"scripts/slurm-local start did not finish in {timeout_s} s") from None
    if proc.returncode != 0:
        raise SlurmUnavailable(_reason(proc))
    exports = [ln for ln in proc.stdout.splitlines() if ln.startswith("export SLURM_CONF=")]
    if not exports:
        raise SlurmUnavailable(f"no SLURM_CONF in the output of scripts/slurm-local: {proc.stdout!r}")
    return Path(exports[-1].removeprefix("export SLURM_CONF="))


def stop(state_dir: Path) -> None:
    """Stop every daemon started for `state_dir` (safe on a partly started cluster)."""
    proc = _script("stop", state_dir, timeout_s=120)
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/slurm-local stop {state_dir} failed: {_reason(proc)}")


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


@contextlib.contextmanager
def local_slurm_cluster(state_dir: Path) -> Iterator[Path]:
    """Run the cluster for the duration of the block with SLURM_CONF set; yield `state_dir`."""
    try:
        conf = start(state_dir)
    except SlurmUnavailable:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            stop(state_dir)  # whatever did start; the start failure is the reason to report
        raise
    try:
        with _environ("SLURM_CONF", str(conf)):
            yield state_dir
    finally:
        stop(state_dir)


def default_partition() -> str:
    """Name of the default partition, as `sinfo` reports it (marked with a trailing '*')."""
    names = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True,
                           check=True, timeout=30).stdout.split()
    return next(n.rstrip("*") for n in names if n.endswith("*"))


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Path]:
    """Session fixture: a running cluster in a fresh state dir; skips when Slurm is unavailable.

    The state dir is made with `tempfile.mkdtemp` rather than pytest's tmp_path_factory because
    munged runs as the munge user, who cannot enter pytest's root-only (0700) base directory.
    """
    state_dir = Path(tempfile.mkdtemp(prefix="launcher-slurm-"))
    state_dir.chmod(0o755)
    try:
        cluster = local_slurm_cluster(state_dir)
        path = cluster.__enter__()
    except SlurmUnavailable as exc:
        shutil.rmtree(state_dir, ignore_errors=True)
        pytest.skip(f"Slurm unavailable: {exc}")
    yield path
    cluster.__exit__(None, None, None)  # raises if a daemon would not stop: keep its logs
    shutil.rmtree(state_dir, ignore_errors=True)

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config import register_schema
from slurm_cluster import slurm_cluster  # noqa: F401  (one local Slurm cluster for the whole session)

register_schema()  # tests compose conf/ through Hydra directly, as the entry points do

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m launcher ARGS` in a subprocess, as a user runs it."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=full_env)


@pytest.fixture(scope="session")
def trace_cache(tmp_path_factory) -> str:
    """`cache_dir=...` shared by every CLI run of the session, in every pytest-xdist worker. Traces,
    model specs and candidate memos are keyed by everything they depend on (launcher/trace.py
    `_cache_key`) and written atomically, so a run reads only what an identical cold plan would
    compute; each distinct workload is traced once."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory above the workers' own
    path = root / "trace-cache"
    path.mkdir(exist_ok=True)
    return f"cache_dir={path}"


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (`--dist loadgroup`), the tests that use the local Slurm cluster run in
    one worker, so the session starts one cluster."""
    for item in items:
        if item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.xdist_group("slurm"))


@pytest.fixture
def cli(tmp_path, trace_cache):
    """Run the CLI with a private run directory root and the session's trace cache."""
    def _run(*args: str, **kw):
        return run_cli(*args, trace_cache, cwd=tmp_path, **kw)
    _run.cwd = tmp_path
    return _run


# CI replays the same Hypothesis examples every run (a red build names a reproducible input);
# developers' runs keep exploring new ones.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    _hypothesis_settings.load_profile("ci")

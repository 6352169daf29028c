"""Facts about the machine a plan is made on, gathered once at the edge (launcher/app.py) and
handed to the planner as a value: which optional packages are installed, their versions, and
whether a Python that runs ColossalAI's shardformer (transformers 4.x) is at hand."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional

OPTIONAL = ("colossalai", "deepspeed", "bitsandbytes", "liger_kernel")
COLOSSALAI_PYTHON_ENV = "LAUNCHER_COLOSSALAI_PYTHON"  # launcher/backends/colossalai/runtime.py
COLOSSALAI_VENV = ".venv-colossalai"  # built by scripts/setup next to .venv
COLOSSALAI_TRANSFORMERS_MAJOR = 4  # ColossalAI 0.5.0 pins transformers==4.51.3
SHARDFORMER = "colossalai_shardformer"  # Env.installed flag: some Python here runs ColossalAI's shardformer
DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "launcher" / "traces"
"""Traces; the model specs, candidate memos and allocator replays live next to them (`cache_dir`
replaces its parent)."""


def cache_dir_problem(cache_dir: Optional[str]) -> str:
    """Why `cache_dir` (default: DEFAULT_CACHE_DIR) cannot hold the caches, or ''. Makes the
    directory when it can (every cache writes into it)."""
    path = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR
    key = f"cache_dir={cache_dir}" if cache_dir else f"cache_dir (default {path})"
    return writable_dir_problem(path, key, "e.g. cache_dir=/tmp/launcher-cache")


def writable_dir_problem(path: Path, key: str, example: str) -> str:
    """Why `path` cannot be made a writable directory (making it when it can), or '': the one-line
    answer for the key `key` that names it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"{key}: cannot be made a directory ({err.strerror}); give a writable directory, {example}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{key}: not writable; give a writable directory, {example}"
    return ""


@dataclass(frozen=True)
class Env:
    installed: frozenset = frozenset()  # optional packages present, plus flags ('colossalai_shardformer')
    versions: dict = field(default_factory=dict)  # distribution -> version

    def major(self, package: str) -> int:
        return int(str(self.versions.get(package, "0")).split(".")[0] or 0)


def detect() -> Env:
    """The installed optional packages (found without importing them) and versions."""
    installed = {name for name in OPTIONAL if importlib.util.find_spec(name) is not None}
    versions = {name: v for name in ("torch", "transformers", *OPTIONAL) if (v := installed_version(name))}
    if "colossalai" in installed and shardformer_python(versions.get("transformers", "0")) is not None:
        installed.add(SHARDFORMER)
    return Env(frozenset(installed), versions)


def colossalai_python() -> Optional[str]:
    """The Python of the ColossalAI environment: $LAUNCHER_COLOSSALAI_PYTHON, else
    `.venv-colossalai/bin/python` in the repository this package is loaded from; None if absent."""
    named = os.environ.get(COLOSSALAI_PYTHON_ENV)
    if named:
        return named if os.path.exists(named) else None
    path = Path(__file__).resolve().parents[1] / COLOSSALAI_VENV / "bin" / "python"
    return str(path) if path.exists() else None


def shardformer_python(transformers_version: str) -> Optional[str]:
    """The Python that runs ColossalAI's shardformer: '' for this one (its transformers is 4.x),
    the ColossalAI environment's path, or None when there is none."""
    if int((transformers_version or "0").split(".")[0]) == COLOSSALAI_TRANSFORMERS_MAJOR:
        return ""
    return colossalai_python()


def installed_version(dist: str) -> str:
    """The version of an installed distribution, read once per process from its metadata (so a
    cached plan never imports torch or transformers; `importlib.metadata.version` parses the
    METADATA file on every call, ~2 ms each)."""
    if dist not in _VERSIONS:
        try:
            _VERSIONS[dist] = version(dist)
        except PackageNotFoundError:
            _VERSIONS[dist] = ""
    return _VERSIONS[dist]


_VERSIONS: dict[str, str] = {}

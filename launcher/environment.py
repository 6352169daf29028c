"""Facts about the machine a plan is made on, gathered once at the edge (launcher/app.py) and
handed to the planner as a value: which optional packages are installed, their versions, and
whether ColossalAI's CPU test layer is preloaded."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

OPTIONAL = ("colossalai", "deepspeed", "bitsandbytes")
COLOSSALAI_CPU_COMPAT_ENV = "LAUNCHER_COLOSSALAI_TEST_PRELOAD"  # launcher/backends/colossalai/worker.py


@dataclass(frozen=True)
class Env:
    installed: frozenset = frozenset()  # optional packages present, plus flags ('colossalai_cpu')
    versions: dict = field(default_factory=dict)  # distribution -> version

    def major(self, package: str) -> int:
        return int(str(self.versions.get(package, "0")).split(".")[0] or 0)


def detect() -> Env:
    """The installed optional packages (found without importing them) and versions."""
    installed = {name for name in OPTIONAL if importlib.util.find_spec(name) is not None}
    if os.environ.get(COLOSSALAI_CPU_COMPAT_ENV):
        installed.add("colossalai_cpu")
    versions = {name: installed_version(name) for name in ("torch", "transformers", *OPTIONAL)}
    return Env(frozenset(installed), {name: v for name, v in versions.items() if v})


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

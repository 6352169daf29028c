"""The backend registry: every backend the planner, the emitter and the worker know, and the
strategies derived from them. A new backend is one folder and one line in `_BACKENDS`."""
from __future__ import annotations

import importlib

from launcher.backends import colossalai, ddp, deepspeed, fsdp1, fsdp2
from launcher.backends.base import Backend
from launcher.config import LauncherConfig
from launcher.errors import ConfigError
from launcher.types import Strategy

_BACKENDS = (ddp.BACKEND, deepspeed.BACKEND, fsdp2.BACKEND, colossalai.BACKEND, fsdp1.BACKEND)

REGISTRY: dict[str, Backend] = {}
STRATEGIES: dict[str, Strategy] = {}


def register(backend: Backend) -> None:
    """Add a backend; a name or strategy already registered raises."""
    if backend.name in REGISTRY:
        raise ValueError(f"backend {backend.name!r} is registered twice")
    for name, strategy in backend.strategies.items():
        if name in STRATEGIES:
            raise ValueError(f"strategy {name!r} of backend {backend.name!r} is already registered")
        if strategy.backend != backend.name or strategy.name != name:
            raise ValueError(f"strategy {name!r} names backend {strategy.backend!r}, not {backend.name!r}")
    REGISTRY[backend.name] = backend
    STRATEGIES.update(backend.strategies)


for _backend in _BACKENDS:
    register(_backend)


def get(name: str) -> Backend:
    """The backend called `name`; an unknown name raises, listing the known ones."""
    if name not in REGISTRY:
        raise ConfigError(f"backend={name!r} is not registered; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def backend_of(strategy: Strategy) -> Backend:
    return get(strategy.backend)


def strategy(name: str) -> Strategy:
    """The strategy template called `name`; an unknown name raises."""
    if name not in STRATEGIES:
        raise ConfigError(f"strategy={name} is not registered; use auto or one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def load(path: str):
    """The object a 'module:attribute' path names (a backend's worker parts, imported only by the worker)."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def knobs(config: LauncherConfig | None = None, **given) -> dict:
    """Config group name -> its dataclass, for every group a registered backend reads (Backend.knobs),
    from `config` (default: every group's defaults); `given` groups replace those (None keeps it)."""
    config = config or LauncherConfig()
    out = {name: getattr(config, name) for backend in REGISTRY.values() for name in backend.knobs}
    out.update({name: value for name, value in given.items() if value is not None})
    return out

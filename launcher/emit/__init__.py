"""Framework configuration for a chosen candidate, from its backend's emitter
(launcher/backends/<name>/ `emit`): (file name, config dict); the app writes the file into the
run directory and puts the dict into run.json's `framework_config`.
"""
from __future__ import annotations

from launcher.backends.base import EmitInput
from launcher.backends.registry import REGISTRY, backend_of
from launcher.backends.registry import knobs as registry_knobs
from launcher.config import TrainingConfig
from launcher.types import Strategy


def emit(strategy: Strategy, *, training: TrainingConfig, micro_batch_size: int, grad_accum_steps: int,
         dp_size: int, device: str = "cuda", vocab_size: int = 0, knobs: dict | None = None) -> tuple[str, dict]:
    """(file name, config) for the strategy's backend; `knobs`: config group name -> its dataclass
    (a group absent from it: its defaults)."""
    knobs = registry_knobs(**(knobs or {}))
    backend = backend_of(strategy)
    return backend.emit_file, backend.emit(EmitInput(strategy, training, knobs, micro_batch_size, grad_accum_steps,
                                                     dp_size, device, vocab_size))


EMITTERS = {name: b.emit_file for name, b in REGISTRY.items()}
"""Backend name -> the file its emitter writes."""

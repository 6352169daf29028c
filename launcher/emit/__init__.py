"""Framework configuration for a chosen candidate: one emitter per backend, in a registry.

`emit` returns (file name, config dict); the app writes the file into the run directory and puts
the dict into run.json's `framework_config`. A new backend (e.g. ColossalAI, which would write
`colossalai_plugin.json`) adds one module with a pure function and one `EMITTERS` entry.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from launcher.config import ColossalAIConfig, DDPConfig, DeepSpeedConfig, TrainingConfig
from launcher.backends.colossalai.emit import plugin_config
from launcher.backends.ddp.emit import ddp_settings
from launcher.backends.deepspeed.emit import deepspeed_config
from launcher.types import Strategy


@dataclass(frozen=True)
class EmitInput:
    """Everything an emitter may read about the chosen candidate."""

    strategy: Strategy
    training: TrainingConfig
    deepspeed: DeepSpeedConfig
    ddp: DDPConfig
    micro_batch_size: int
    grad_accum_steps: int
    dp_size: int
    colossalai: ColossalAIConfig = field(default_factory=ColossalAIConfig)
    device: str = "cuda"
    vocab_size: int = 0  # the model's vocabulary (ColossalAI TP picks its padding multiple from it)


@dataclass(frozen=True)
class Emitter:
    file_name: str
    build: Callable[[EmitInput], dict]


EMITTERS: dict[str, Emitter] = {
    "deepspeed": Emitter("ds_config.json", lambda x: deepspeed_config(
        x.strategy, x.training, x.deepspeed, x.micro_batch_size, x.grad_accum_steps, x.dp_size)),
    "ddp": Emitter("ddp_config.json", lambda x: ddp_settings(x.ddp)),
    "colossalai": Emitter("colossalai_plugin.json", lambda x: plugin_config(
        x.strategy, x.training, x.colossalai, x.ddp, x.device, x.grad_accum_steps, x.vocab_size)),
}
"""Backend name (Strategy.backend) -> emitter."""


def emit(strategy: Strategy, *, training: TrainingConfig, deepspeed: DeepSpeedConfig,
         ddp: DDPConfig, micro_batch_size: int, grad_accum_steps: int,
         dp_size: int, colossalai: ColossalAIConfig | None = None,
         device: str = "cuda", vocab_size: int = 0) -> tuple[str, dict]:
    """(file name, config) for the strategy's backend."""
    if strategy.backend not in EMITTERS:
        raise ValueError(f"no emitter for backend {strategy.backend!r}; known: {sorted(EMITTERS)}")
    emitter = EMITTERS[strategy.backend]
    return emitter.file_name, emitter.build(EmitInput(
        strategy, training, deepspeed, ddp, micro_batch_size, grad_accum_steps, dp_size,
        colossalai or ColossalAIConfig(), device, vocab_size))

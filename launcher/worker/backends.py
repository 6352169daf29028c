"""Training backends behind one small interface, looked up in the backend registry
(launcher/backends/registry.py; each backend's `worker` hook).

    backend.micro_step(input_ids, last)  forward + backward of one micro-batch -> loss (detached)
    backend.optimizer_step()             clip, step, schedule, zero grads
    backend.lr, backend.save(dir, rank), backend.load(dir)
    backend.load_neutral(dir)             optimizer and scheduler from the layout-neutral form
                                          (launcher/worker/layout.py; the weights are loaded
                                          into the model before it is wrapped)

Every backend uses the worker's torch optimizer (launcher/worker/optim.py). With DeepSpeed this is deliberate:
its own FusedAdam / DeepSpeedCPUAdam are C++ ops compiled on first use (~150 s on CPU), and
ZeRO wraps any torch optimizer just as well ("zero_allow_untested_optimizer": true), so a torch
optimizer keeps start-up fast and the optimizer identical across backends. Optimizer names are
HF TrainingArguments' `optim` names.
"""
from __future__ import annotations

from launcher.backends import registry
from launcher.backends.base import Ask, in_backward_problem, peft_kind
from launcher.environment import detect
from launcher.errors import ConfigError
from launcher.types import Strategy
from launcher.worker.optim import OPTIMIZERS

def check_backend(spec, world_size: int) -> None:
    """Reject what the worker cannot run before any process group exists: the backend's capability
    table (the one the planner consults, launcher/backends/<name>/rules.py), then its own check of
    the framework config."""
    if spec.backend not in registry.REGISTRY:
        raise ConfigError(f"backend={spec.backend!r} is not supported by the worker yet; "
                          f"use one of {', '.join(registry.REGISTRY)}")
    if spec.optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer={spec.optimizer!r} is not supported by the worker; "
                          f"use one of {', '.join(OPTIMIZERS)}")
    quant = (getattr(spec, "peft", None) or {}).get("quant_type")
    if quant == "torchao_nf4":
        raise ConfigError("peft.quant_type=torchao_nf4: a torchao NF4 base is planned only; the worker quantizes "
                          "with bitsandbytes (use peft.quant_type=nf4)")
    if str(quant).startswith("gptq"):
        raise ConfigError(f"peft.quant_type={quant}: a GPTQ base is planned only; the worker quantizes with "
                          "bitsandbytes (use peft.quant_type=nf4)")
    backend = registry.get(spec.backend)
    name = getattr(spec, "strategy", None)
    strategy = registry.STRATEGIES.get(name) if name in backend.strategies else Strategy(str(name), spec.backend)
    in_backward = getattr(spec, "optimizer_in_backward", False)
    ask = Ask(spec.precision, spec.optimizer, peft_kind(getattr(spec, "peft", None)), getattr(spec, "device", "cpu"),
              world_size, detect().installed, in_backward, getattr(spec, "zero_grad_set_to_none", True))
    problem = backend.run_refusal(strategy, ask) or (in_backward and in_backward_problem(
        spec.max_grad_norm, spec.precision, spec.grad_accum_steps))
    if problem:
        raise ConfigError(problem)
    registry.load(backend.check_worker_config)(spec, world_size)


def make_backend(model, spec, env, plan, meter):
    check_backend(spec, env.world_size)
    return registry.load(registry.get(spec.backend).worker)(model, spec, env, plan, meter)


def moves_model(spec) -> bool:
    """True when the backend's worker takes the model as built on the host and moves it to the
    device itself, a part at a time (its class's `MOVES_MODEL`: a bool, or a function of the run
    spec), so the whole model is never on the device at once; else the worker moves the whole
    model before the backend wraps it."""
    moves = getattr(registry.load(registry.get(spec.backend).worker), "MOVES_MODEL", False)
    return bool(moves(spec) if callable(moves) else moves)

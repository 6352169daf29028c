"""Training backends: torch DDP and DeepSpeed, behind one small interface.

    backend.micro_step(input_ids, last)  forward + backward of one micro-batch -> loss (detached)
    backend.optimizer_step()             clip, step, schedule, zero grads
    backend.lr, backend.save(dir, rank), backend.load(dir)
    backend.load_neutral(dir)             optimizer and scheduler from the layout-neutral form
                                          (launcher/worker/layout.py; the weights are loaded
                                          into the model before it is wrapped)

Both use a torch optimizer (`torch.optim.AdamW` / `SGD`). With DeepSpeed this is deliberate:
its own FusedAdam / DeepSpeedCPUAdam are C++ ops compiled on first use (~150 s on CPU), and
ZeRO wraps any torch optimizer just as well ("zero_allow_untested_optimizer": true), so a torch
optimizer keeps start-up fast and the optimizer identical across backends. Optimizer names are
HF TrainingArguments' `optim` names.
"""
from __future__ import annotations


from launcher.errors import ConfigError
from launcher.worker.optim import OPTIMIZERS

SINGLE = "single"  # the strategy that runs one process without a data-parallel wrapper


def _ddp_backend(model, spec, env, plan, meter):
    from launcher.backends.ddp.worker import DDPBackend

    return DDPBackend(model, spec, env, plan, meter)


def _deepspeed_backend(model, spec, env, plan, meter):
    from launcher.backends.deepspeed.worker import DeepSpeedBackend

    return DeepSpeedBackend(model, spec, env, plan, meter)


def _colossalai_backend(model, spec, env, plan, meter):
    """ColossalAI is optional: imported only when a run uses it (launcher/backends/colossalai/worker.py)."""
    from launcher.backends.colossalai.worker import ColossalAIBackend

    return ColossalAIBackend(model, spec, env, plan, meter)


BACKENDS = {"ddp": _ddp_backend, "deepspeed": _deepspeed_backend, "colossalai": _colossalai_backend}


def check_backend(spec, world_size: int) -> None:
    """Reject a backend, optimizer or framework_config the worker cannot run, before any
    process group exists."""
    if spec.backend not in BACKENDS:
        raise ConfigError(f"backend={spec.backend!r} is not supported by the worker yet; "
                          f"use one of {', '.join(BACKENDS)}")
    if spec.optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer={spec.optimizer!r} is not supported by the worker; "
                          f"use one of {', '.join(OPTIMIZERS)}")
    quant = (getattr(spec, "peft", None) or {}).get("quant_type")
    if quant and spec.device != "cuda":
        raise ConfigError(f"QLoRA ({quant} base) needs bitsandbytes' GPU kernels; device={spec.device} "
                          "has none: use peft=lora on CPU")
    if str(quant).startswith("gptq"):
        raise ConfigError(f"peft.quant_type={quant}: a GPTQ base is planned only; the worker quantizes with "
                          "bitsandbytes (use peft.quant_type=nf4)")
    if quant and spec.backend != "ddp":
        raise ConfigError(f"QLoRA runs with torch DDP only, not backend={spec.backend}")
    if getattr(spec, "strategy", None) == SINGLE and world_size != 1:
        raise ConfigError(f"strategy=single runs one process, not {world_size}; use strategy=ddp for several")
    if spec.backend == "ddp":
        from launcher.backends.ddp.worker import _check_ddp_kwargs

        _check_ddp_kwargs(spec.framework_config)
    elif spec.backend == "colossalai":
        from launcher.backends.colossalai.worker import check_plugin_config

        check_plugin_config(spec.framework_config)
    else:
        from launcher.backends.deepspeed.worker import deepspeed_config

        deepspeed_config(spec, world_size)


def make_backend(model, spec, env, plan, meter):
    check_backend(spec, env.world_size)
    return BACKENDS[spec.backend](model, spec, env, plan, meter)

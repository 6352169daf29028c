"""The planner never chooses what the worker refuses: over every registered strategy, precision,
optimizer, PEFT method, device and process count, a combination the planner accepts passes the
emitter and the worker's own checks (launcher/worker/backends.py `check_backend`, which reads the
emitted framework config; launcher/worker/model.py `precision_plan`; launcher/worker/optim.py
`make_optimizer`, run on a real parameter)."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from launcher.backends import registry
from launcher.backends.base import DEVICES, OPTIMIZERS, PRECISIONS, in_backward_problem
from launcher.config import LauncherConfig, Optimizer, Precision
from launcher.emit import emit
from launcher.environment import detect
from launcher.errors import ConfigError
from launcher.planner import unsupported
from launcher.runspec import RunSpec
from launcher.types import Cluster
from launcher.worker.backends import check_backend
from launcher.worker.model import precision_plan
from launcher.worker.optim import make_optimizer

PEFT = {"none": {}, "lora": {"r": 8, "alpha": 16}, "qlora": {"r": 8, "alpha": 16, "quant_type": "nf4"}}


def _cluster(device: str, gpus: int) -> Cluster:
    return Cluster("test", device, gpus, 1, 80 * 2**30, 2**40, {"fp32": 1.0, "bf16": 1.0, "fp16": 1.0}, 0.5,
                   1.0, 1.0, 1.0, 1.0, 80, 0)


def _strategies():
    for s in registry.STRATEGIES.values():
        yield s
        if s.name == "cai_tp":
            yield replace(s, zero_stage=1)


@pytest.fixture(scope="module")
def optimizer_problems() -> dict:
    """What the worker's optimizer factory does with each name, on a real parameter."""
    out = {}
    for name in OPTIMIZERS:
        p = torch.nn.Parameter(torch.randn(64, 64))
        try:
            opt = make_optimizer(name, [p], 1e-3, 0.0)
            p.grad = torch.randn_like(p)
            opt.step()
            out[name] = ""
        except Exception as err:  # noqa: BLE001 - any failure is a refusal
            out[name] = f"{type(err).__name__}: {err}"
    return out


def test_planner_accepts_only_what_the_worker_runs(optimizer_problems):
    env = detect()
    checked, estimate_only, disagreements = 0, 0, []
    for strategy, precision, optimizer, peft, device, gpus, in_backward, set_to_none in itertools.product(
            _strategies(), PRECISIONS, OPTIMIZERS, PEFT, DEVICES, (1, 2), (False, True), (True, False)):
        if in_backward and (in_backward_problem(0.0, precision, 1) or not set_to_none):
            continue  # refused with the config, before any planning (launcher/validate.py)
        config = LauncherConfig()
        config.gpus = gpus
        config.training.precision = Precision[precision]
        config.training.optimizer = Optimizer[optimizer]
        config.training.optimizer_in_backward = in_backward
        config.training.zero_grad_set_to_none = set_to_none
        config.training.max_grad_norm = 0.0 if in_backward else 1.0
        cluster = _cluster(device, gpus)
        if unsupported(strategy, config, cluster, None, env, peft=peft):
            continue
        checked += 1
        try:
            file_name, framework = emit(strategy, training=config.training, knobs=registry.knobs(config),
                                        micro_batch_size=1, grad_accum_steps=1,
                                        dp_size=gpus // (strategy.tp_size * strategy.pp_size) or 1, device=device)
            spec = RunSpec(run_dir=".", backend=strategy.backend, strategy=strategy.name, model_name="m", hf_config={},
                           device=device, precision=precision, optimizer=optimizer, framework_config=framework,
                           peft=PEFT[peft], optimizer_in_backward=in_backward, zero_grad_set_to_none=set_to_none,
                           max_grad_norm=config.training.max_grad_norm)
            if registry.backend_of(strategy).rules(strategy).estimate_only.get(peft):
                # planned as an estimate only: the planner never launches it (planner.launch_problem)
                # and the worker refuses it in one line
                with pytest.raises(ConfigError, match="estimate only"):
                    check_backend(spec, gpus)
                estimate_only += 1
                continue
            check_backend(spec, gpus)
            precision_plan(precision, strategy.backend, device)
            if optimizer_problems[optimizer]:
                raise ConfigError(optimizer_problems[optimizer])
        except ConfigError as err:
            disagreements.append(f"{strategy.name} {precision} {optimizer} {peft} {device} gpus={gpus} "
                                 f"in_backward={in_backward} set_to_none={set_to_none}: {err}")
    assert checked > 500 and estimate_only > 0  # the walk reached the surface
    assert not disagreements, "\n".join(disagreements[:20])


def test_the_worker_refuses_what_the_planner_refuses_for_precision():
    """The one table: a precision the planner refuses for a strategy is refused by the worker too."""
    config, cluster = LauncherConfig(), _cluster("cpu", 2)
    config.gpus = 2
    config.training.precision = Precision["16-true"]
    ddp = registry.strategy("ddp")
    why = unsupported(ddp, config, cluster, None, detect())
    assert "16-true" in why and "GradScaler" in why
    spec = RunSpec(run_dir=".", backend="ddp", strategy="ddp", model_name="m", hf_config={}, precision="16-true")
    with pytest.raises(ConfigError, match="16-true"):
        check_backend(spec, 2)


def test_the_worker_refuses_kept_gradients_where_the_planner_does():
    """training.zero_grad_set_to_none=false is laid out and run where the capability table says so
    (ddp, single, fsdp2, fsdp1): the planner refuses it for the others, and so does their worker,
    rather than run set_to_none=True."""
    config, cluster = LauncherConfig(), _cluster("cpu", 2)
    config.gpus = 2
    config.training.zero_grad_set_to_none = False
    for name in ("ddp", "fsdp2", "fsdp1"):
        assert not unsupported(registry.strategy(name), config, cluster, None, detect())
    tp = registry.strategy("fsdp2_tp")
    why = unsupported(tp, config, cluster, None, detect())
    assert "strategy=fsdp2_tp does not run training.zero_grad_set_to_none=false" in why
    spec = RunSpec(run_dir=".", backend="fsdp2", strategy="fsdp2_tp", model_name="m", hf_config={},
                   precision="bf16-mixed", zero_grad_set_to_none=False)
    with pytest.raises(ConfigError, match="zero_grad_set_to_none=false"):
        check_backend(spec, 2)


def test_unknown_backend_and_strategy_raise():
    with pytest.raises(ConfigError, match="backend='mesh' is not registered"):
        registry.get("mesh")
    with pytest.raises(ConfigError, match="strategy=zero9 is not registered"):
        registry.strategy("zero9")
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(registry.get("ddp"))


def test_strategy_names_of_the_config_are_the_registry():
    from launcher.config import StrategyName

    assert {m.name for m in StrategyName} - {"auto"} == set(registry.STRATEGIES)

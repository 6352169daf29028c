"""training.optimizer_in_backward: each parameter stepped in its gradient hook.

The worker's `OptimizerInBackward` must train exactly as one ordinary optimizer does (same
parameters after the same steps, same checkpoint format both ways), free every gradient during
backward, and the planner, the config check and the worker must refuse the same runs."""
from __future__ import annotations

import copy

import pytest
import torch

from launcher.backends import registry
from launcher.backends.base import in_backward_problem
from launcher.cli import compose
from launcher.environment import detect
from launcher.errors import ConfigError
from launcher.planner import grad_accum, micro_batch_sizes, unsupported
from launcher.runspec import RunSpec
from launcher.types import Cluster
from launcher.worker.backends import check_backend
from launcher.worker.optim import OptimizerInBackward, make_optimizer, make_scheduler


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, 32))


def _loss(model, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 32, (4, 8), generator=g)
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


@pytest.mark.parametrize("name", ["adamw_torch", "adamw_torch_fused", "sgd", "adafactor"])
def test_trains_exactly_as_one_optimizer(name):
    ref, fused = _model(), _model()
    opt = make_optimizer(name, ref.parameters(), 1e-2, 0.1)
    sched = make_scheduler(opt, warmup_steps=2)
    inb = OptimizerInBackward(name, fused.parameters(), 1e-2, 0.1, warmup_steps=2)
    for step in range(3):
        _loss(ref, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        _loss(fused, step).backward()
        assert all(p.grad is None for p in fused.parameters())  # stepped and freed in backward
        inb.scheduler.step()
    for a, b in zip(ref.parameters(), fused.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert inb.scheduler.get_last_lr() == sched.get_last_lr()


def test_checkpoints_are_one_optimizers_both_ways():
    """Its state_dict is an ordinary AdamW's (same keys, parameter order and tensors), and an
    ordinary AdamW's loads into it and continues identically."""
    ref, fused = _model(), _model()
    opt = make_optimizer("adamw_torch", ref.parameters(), 1e-2, 0.0)
    make_scheduler(opt, warmup_steps=0)  # as every backend makes one (it adds 'initial_lr')
    inb = OptimizerInBackward("adamw_torch", fused.parameters(), 1e-2, 0.0, warmup_steps=0)
    for step in range(2):
        _loss(ref, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _loss(fused, step).backward()
    a, b = opt.state_dict(), inb.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for k, v in a["state"][i].items():
            torch.testing.assert_close(v, b["state"][i][k])

    resumed_model = copy.deepcopy(ref)
    resumed = OptimizerInBackward("adamw_torch", resumed_model.parameters(), 1e-2, 0.0, warmup_steps=0)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))  # as read back from a checkpoint file
    _loss(ref, 5).backward()
    opt.step()
    _loss(resumed_model, 5).backward()
    for p, q in zip(ref.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(p, q)


def test_a_checkpoint_of_another_model_is_refused_in_one_line():
    inb = OptimizerInBackward("adamw_torch", _model().parameters(), 1e-2, 0.0, warmup_steps=0)
    other = make_optimizer("adamw_torch", torch.nn.Linear(2, 2).parameters(), 1e-2, 0.0)
    with pytest.raises(ConfigError, match="resume the run it was saved by"):
        inb.load_state_dict(other.state_dict())


def _cluster(gpus: int) -> Cluster:
    return Cluster(hardware="cpu", device="cpu", num_gpus=gpus, num_nodes=1, memory_bytes=2**34,
                   host_memory_bytes=2**36, peak_tflops={"fp32": 1.0}, matmul_efficiency=0.5,
                   memory_bandwidth_gbps=10.0, intra_node_bandwidth_gbps=10.0, inter_node_bandwidth_gbps=10.0,
                   host_link_bandwidth_gbps=10.0, sm_arch=0, cuda_context_bytes=0)


def test_planner_config_and_worker_refuse_the_same_runs():
    base = ["model=tiny-llama", "hardware=cpu", "training.optimizer_in_backward=true"]
    # clipping (the default max_grad_norm=1.0) and fp16 loss scaling need every gradient first
    with pytest.raises(ConfigError, match="set training.max_grad_norm=0"):
        compose(base)
    with pytest.raises(ConfigError, match="16-mixed.*optimizer_in_backward"):
        compose([*base, "training.max_grad_norm=0", "training.precision=16-mixed"])
    # a gradient freed in its hook cannot also be kept by zero_grad(set_to_none=False)
    with pytest.raises(ConfigError, match="zero_grad_set_to_none=false.*frees each gradient"):
        compose([*base, "training.max_grad_norm=0", "training.zero_grad_set_to_none=false"])
    config = compose([*base, "training.max_grad_norm=0"])

    # a data-parallel wrapper reduces gradients after their hooks: refused by planner and worker alike
    ddp = registry.strategy("ddp")
    config.gpus = 2
    why = unsupported(ddp, config, _cluster(2), None, detect())
    assert "optimizer_in_backward" in why and "strategy=single" in why
    spec = RunSpec(run_dir=".", backend="ddp", strategy="ddp", model_name="m", hf_config={}, precision="bf16-mixed",
                   optimizer_in_backward=True, max_grad_norm=0.0)
    with pytest.raises(ConfigError, match="optimizer_in_backward"):
        check_backend(spec, 2)
    single = registry.strategy("single")
    config.gpus = 1
    assert not unsupported(single, config, _cluster(1), None, detect())
    check_backend(RunSpec(run_dir=".", backend="ddp", strategy="single", model_name="m", hf_config={},
                          precision="bf16-mixed", optimizer_in_backward=True, max_grad_norm=0.0), 1)

    # no gradient accumulation: the micro-batch search keeps only one-micro-batch steps
    config.training.global_batch_size = 8
    assert micro_batch_sizes(config, 1) == [8]
    with pytest.raises(ConfigError, match="training.global_batch_size=8"):
        grad_accum(config, 2, 1)
    assert "micro-batches per step" in in_backward_problem(0.0, "bf16-mixed", 4)
    with pytest.raises(ConfigError, match="micro-batches per step"):
        check_backend(RunSpec(run_dir=".", backend="ddp", strategy="single", model_name="m", hf_config={},
                              precision="bf16-mixed", optimizer_in_backward=True, max_grad_norm=0.0,
                              grad_accum_steps=4), 1)

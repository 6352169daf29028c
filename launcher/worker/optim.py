"""The worker's torch optimizer and learning-rate schedule, shared by every backend. Optimizer
names are HF TrainingArguments' `optim` names."""
from __future__ import annotations

from launcher.backends.base import OPTIMIZERS
from launcher.errors import ConfigError


def make_optimizer(name: str, params, learning_rate: float, weight_decay: float, sgd_momentum: float = 0.9):
    """adamw_torch, adamw_torch_foreach: AdamW with foreach=True (one multi-tensor kernel per
    group, on every device); adamw_torch_fused: AdamW(fused=True); sgd: SGD with momentum
    `sgd_momentum`; adamw_bnb_8bit / paged_adamw_8bit / paged_adamw_32bit:
    bitsandbytes.optim.AdamW8bit / PagedAdamW8bit / PagedAdamW32bit; adafactor: transformers'
    Adafactor with HF Trainer's optim="adafactor" settings (scale_parameter=False,
    relative_step=False: the learning rate is the given one)."""
    import torch

    params = [p for p in params if p.requires_grad]
    if name in ("adamw_torch", "adamw_torch_foreach"):
        return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, foreach=True)
    if name == "adamw_torch_fused":
        return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, fused=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=learning_rate, momentum=sgd_momentum, weight_decay=weight_decay)
    if name in ("adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit"):
        import bitsandbytes as bnb

        cls = {"adamw_bnb_8bit": bnb.optim.AdamW8bit, "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
               "paged_adamw_32bit": bnb.optim.PagedAdamW32bit}[name]
        return cls(params, lr=learning_rate, weight_decay=weight_decay)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=learning_rate, weight_decay=weight_decay, scale_parameter=False,
                         relative_step=False, warmup_init=False)
    raise ConfigError(f"optimizer={name!r} is not supported by the worker; use one of {', '.join(OPTIMIZERS)}")


def lr_factor(step: int, warmup_steps: int) -> float:
    """Linear warmup from 1/(warmup+1) to 1 over `warmup_steps` optimizer steps, then constant."""
    return min(1.0, (step + 1) / (warmup_steps + 1)) if warmup_steps > 0 else 1.0


def make_scheduler(optimizer, warmup_steps: int):
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup_steps))


class OptimizerInBackward:
    """One optimizer per trainable parameter, stepped in the parameter's post-accumulate-grad hook,
    its gradient freed right after (training.optimizer_in_backward): at most the gradients of the
    parameters autograd is finishing are alive, never all of them. Sources: torch's tutorial "How
    to save memory by fusing the optimizer step into the backward pass"
    (`Tensor.register_post_accumulate_grad_hook`); torchtune's `optimizer_in_bwd`
    (training/memory.py `register_optim_in_bwd_hooks`, `OptimizerInBackwardWrapper`).

    `state_dict`/`load_state_dict` speak one torch optimizer's format (one parameter group over the
    parameters in order), so its checkpoints are those of an ordinary optimizer: a run resumes
    with or without stepping in backward. Each parameter's optimizer has its own LambdaLR; they
    step together once per optimizer step (`scheduler`)."""

    def __init__(self, name: str, params, learning_rate: float, weight_decay: float, warmup_steps: int,
                 sgd_momentum: float = 0.9):
        self.params = [p for p in params if p.requires_grad]
        self.optimizers = [make_optimizer(name, [p], learning_rate, weight_decay, sgd_momentum) for p in self.params]
        self.scheduler = _Schedulers([make_scheduler(o, warmup_steps) for o in self.optimizers])
        for p, opt in zip(self.params, self.optimizers):
            p.register_post_accumulate_grad_hook(lambda p, opt=opt: _step_and_free(opt, p))

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def state_dict(self) -> dict:
        state, group = {}, {}
        for i, opt in enumerate(self.optimizers):
            one = opt.state_dict()
            if 0 in one["state"]:
                state[i] = one["state"][0]
            group = one["param_groups"][0]
        return {"state": state, "param_groups": [{**group, "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state_dict: dict) -> None:
        group = state_dict["param_groups"][0]
        if len(group["params"]) != len(self.params):
            raise ConfigError(f"the checkpoint's optimizer holds {len(group['params'])} parameters, this model trains "
                              f"{len(self.params)}: resume the run it was saved by")
        for opt, index in zip(self.optimizers, group["params"]):
            state = state_dict["state"].get(index, state_dict["state"].get(str(index)))
            opt.load_state_dict({"state": {0: state} if state is not None else {},
                                 "param_groups": [{**group, "params": [0]}]})


class _Schedulers:
    """The per-parameter LambdaLRs of `OptimizerInBackward` as one scheduler (they are identical)."""

    def __init__(self, schedulers: list) -> None:
        self.schedulers = schedulers

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> list:
        return self.schedulers[0].get_last_lr()

    def state_dict(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        for s in self.schedulers:
            s.load_state_dict(state_dict)


def _step_and_free(opt, p) -> None:
    opt.step()
    opt.zero_grad(set_to_none=True)

"""The worker hook of the FSDP1 backend: wraps the model with `FullyShardedDataParallel`, runs the
micro-steps and the optimizer step, and checkpoints with `torch.distributed.checkpoint` (sharded:
every rank writes its own shards) as the FSDP2 worker does.

Same interface as launcher/worker/backends.py `DDPBackend`: micro_step(input_ids, last) -> loss,
optimizer_step(), lr, save(dir, rank), load(dir), load_neutral(dir).

What runs (the emitted plan JSON, emit.py `plan_config`, is `spec.framework_config`):
- `FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy(decoder block classes),
  sharding_strategy, use_orig_params=True, limit_all_gathers=True,
  backward_prefetch=BACKWARD_PRE, mixed_precision, device_id)`: one unit per decoder block and
  the root, as Accelerate's `TRANSFORMER_BASED_WRAP` builds them; on CPU processes `device_id` is
  the CPU (FSDP1 asks for an accelerator otherwise, _init_utils.py `_init_device_handle`);
- gradient accumulation without `no_sync`: every micro-batch reduce-scatters and adds into the
  sharded gradient (`_saved_grad_shard`), as the FSDP2 worker does;
- the torch optimizer over the original parameters, views of each rank's shard
  (`use_orig_params=True`).

On CPU processes FSDP1 all-gathers with `dist.all_gather` into chunk views of the unsharded flat
parameter (_flat_param.py `_all_gather_flat_param`), for which gloo allocates a flat output of the
unit's size inside its worker thread and copies out of it: host memory the allocation tracker
(launcher/worker/storage_tracker.py, tensors the ops return) does not see, and not a GPU term.
"""
from __future__ import annotations

from launcher.backends.fsdp2.worker import FSDP2Backend
from launcher.errors import ConfigError
from launcher.worker.optim import make_optimizer, make_scheduler


def check_config(spec, world_size: int) -> None:
    """The plan JSON against the run, before any process group exists (the capability table,
    rules.py, is checked by launcher/worker/backends.py `check_backend`)."""
    world = int(spec.framework_config.get("world", world_size))
    if world != world_size:
        raise ConfigError(f"fsdp1 plan for {world} processes does not match the {world_size} processes")
    if spec.framework_config.get("sharding_strategy", "FULL_SHARD") not in ("FULL_SHARD", "SHARD_GRAD_OP"):
        raise ConfigError(f"fsdp1 sharding_strategy={spec.framework_config['sharding_strategy']}: "
                          "use FULL_SHARD or SHARD_GRAD_OP")


def gloo_reduce_scatter_hook():
    """(state, hook) for `FullyShardedDataParallel.register_comm_hook` on gloo (CPU processes):
    FSDP1's reduce-scatter (_runtime_utils.py `_reduce_grad`: `dist.reduce_scatter_single`) made
    an in-place all-reduce of the padded unsharded gradient followed by a copy of this rank's chunk
    into the sharded output, with the default hook's pre- and post-division
    (torch/distributed/algorithms/_comm_hooks/default_hooks.py `reduce_scatter_hook`). gloo's own
    reduce-scatter reduces into a copy of the whole input that its worker thread releases at a
    moment the scheduler picks (launcher/backends/fsdp2/worker.py `gloo_reduce_scatter`, the same
    for FSDP2): on a small-llama run the copy of the root's 65.5 MB gradient was alive at the
    peak. The all-reduce allocates nothing, as NCCL's reduce-scatter (a CPU test path)."""
    import torch.distributed as dist
    from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

    def hook(state, grad, output):
        if state.gradient_predivide_factor > 1:
            grad.div_(state.gradient_predivide_factor)
        dist.all_reduce(grad, group=state.process_group)
        output.copy_(grad.view(state.world_size, -1)[dist.get_rank(state.process_group)])
        if state.gradient_postdivide_factor > 1:
            output.div_(state.gradient_postdivide_factor)

    return DefaultState(dist.distributed_c10d._get_default_group()), hook


def _dtype(name):
    import torch

    return getattr(torch, name) if name else None


def block_classes(model) -> set:
    """The decoder block classes (transformers' `_no_split_modules`) found among the modules."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    for m in model.modules():  # a peft model: the base model's list
        names |= set(getattr(m, "_no_split_modules", None) or ())
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ConfigError(f"fsdp1: no decoder block class of {type(model).__name__} found "
                          "(transformers' _no_split_modules); use strategy=ddp or fsdp2")
    return classes


class FSDP1Backend:
    # The model arrives as built on the host: FSDP1 moves each unit's parameters to `device_id`
    # as it wraps it, before flattening and sharding them (_init_utils.py `_move_module_to_device`),
    # so the device holds one unit unsharded at a time, never the whole model
    MOVES_MODEL = True

    def __init__(self, model, spec, env, plan, meter) -> None:
        import torch
        from torch.distributed.fsdp import (BackwardPrefetch, FullyShardedDataParallel, MixedPrecision,
                                            ShardingStrategy)
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        config = spec.framework_config
        mp = config.get("mixed_precision", {})
        mixed = (MixedPrecision(param_dtype=_dtype(mp.get("param_dtype")), reduce_dtype=_dtype(mp.get("reduce_dtype")))
                 if mp.get("param_dtype") else None)
        device = torch.device(env.device) if env.device == "cpu" else torch.device("cuda", torch.cuda.current_device())
        self.model = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy(block_classes(model)),
            sharding_strategy=ShardingStrategy[config.get("sharding_strategy", "FULL_SHARD")],
            mixed_precision=mixed, device_id=device, use_orig_params=True,
            limit_all_gathers=bool(config.get("limit_all_gathers", True)),
            backward_prefetch=BackwardPrefetch[config.get("backward_prefetch", "BACKWARD_PRE")],
            forward_prefetch=bool(config.get("forward_prefetch", False)))
        if env.device == "cpu" and env.world_size > 1:
            self.model.register_comm_hook(*gloo_reduce_scatter_hook())
        self.module = self.model
        self.optimizer = make_optimizer(spec.optimizer, self.model.parameters(), spec.learning_rate,
                                        spec.weight_decay, spec.sgd_momentum)
        self.scheduler = make_scheduler(self.optimizer, spec.warmup_steps)
        self._spec, self._meter = spec, meter

    def micro_step(self, input_ids, last: bool):
        with self._meter.phase("forward"):
            loss = self.model(input_ids=input_ids, labels=input_ids).loss
        with self._meter.phase("backward"):
            (loss / self._spec.grad_accum_steps).backward()
        return loss.detach().float()

    def optimizer_step(self) -> None:
        with self._meter.phase("optimizer"):
            if self._spec.max_grad_norm > 0:
                self.model.clip_grad_norm_(self._spec.max_grad_norm)  # FSDP1's norm over every shard
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=self._spec.zero_grad_set_to_none)  # false: kept (torch 1.x)
            self.scheduler.step()

    # sharded checkpoints as the FSDP2 worker writes and reads them: `torch.distributed.checkpoint`
    # through `get_state_dict` / `set_state_dict`, which take FSDP1 modules as they take FSDP2's
    lr = FSDP2Backend.lr
    save = FSDP2Backend.save
    load = FSDP2Backend.load
    load_neutral = FSDP2Backend.load_neutral

"""The worker hook of the FSDP2 backend: wraps the model with `fully_shard` (and
`parallelize_module` for tensor parallelism), runs the micro-steps and the optimizer step, and
checkpoints with `torch.distributed.checkpoint` (sharded: every rank writes its own shards).

Same interface as launcher/worker/backends.py `DDPBackend`: micro_step(input_ids, last) -> loss,
optimizer_step(), lr, save(dir, rank), load(dir), load_neutral(dir).

What runs (the emitted plan JSON, emit.py `plan_config`, is `spec.framework_config`):
- a DeviceMesh ("dp",) or ("dp", "tp") over the world (torch/distributed/device_mesh.py
  `init_device_mesh`), on "cpu" with gloo or "cuda" with NCCL;
- with tp > 1, `parallelize_module` per the plan (tp_plan.py), then FSDP over the "dp" dimension;
- `fully_shard(block, mesh, reshard_after_forward, mp_policy, offload_policy)` for every decoder
  block (the last one with its own `reshard_after_forward`), then for the root (embeddings, final
  norm, LM head), as torchtitan's `apply_fsdp`;
- gradient accumulation as FSDP2 does by default and torchtitan runs it: every micro-batch
  reduce-scatters and adds into the sharded gradients (_fsdp_collectives.py `foreach_reduce`), so
  no unsharded gradient outlives its block's backward (what the memory layout assumes);
- the torch optimizer over the sharded DTensor parameters (its states are sharded DTensors too).
"""
from __future__ import annotations

from pathlib import Path

from launcher.backends.fsdp2 import tp_plan
from launcher.backends.fsdp2.loss import vocab_parallel_loss
from launcher.backends.fsdp2.rules import TP_FAMILIES
from launcher.errors import ConfigError
from launcher.worker import layout
from launcher.worker.optim import make_optimizer, make_scheduler

DCP_DIR = "dcp"  # the sharded model + optimizer checkpoint (torch.distributed.checkpoint)
SCHEDULER = "scheduler.pt"


def check_config(spec, world_size: int) -> None:
    """The plan JSON against the run, before any process group exists (the capability table,
    rules.py, is checked by launcher/worker/backends.py `check_backend`)."""
    mesh = spec.framework_config.get("mesh", {})
    dp, tp = int(mesh.get("dp", world_size)), int(mesh.get("tp", 1))
    if dp * tp != world_size:
        raise ConfigError(f"fsdp2 plan mesh dp={dp} x tp={tp} does not cover the {world_size} processes")
    model_type = spec.hf_config.get("model_type")
    if tp > 1 and model_type is not None and model_type not in TP_FAMILIES:
        raise ConfigError(f"no tensor-parallel plan for model_type={spec.hf_config.get('model_type')} "
                          f"(have {', '.join(TP_FAMILIES)}); use strategy=fsdp2")


def gloo_reduce_scatter():
    """FSDP2's reduce-scatter on gloo (CPU processes) as an in-place all-reduce of the input
    followed by a copy of this rank's chunk into the output, through FSDP2's own hook for a custom
    collective (`FSDPModule.set_custom_reduce_scatter`, _fsdp_collectives.py `ReduceScatter`).
    gloo's `reduce_scatter_single` reduces into a copy of the whole input that its worker thread
    releases at a moment the scheduler picks (the future a blocking call waits on completes in the
    thread's `runLoop` before the work object holding the copy is destroyed,
    torch/csrc/distributed/c10d/ProcessGroupGloo.cpp), so the peak of a real CPU run varied from
    run to run by one input's bytes. The all-reduce works in place on the input, which FSDP2 keeps
    alive past the call anyway (`reduce_scatter_states`): every buffer is then freed where FSDP2
    frees it, as with NCCL, at twice the reduce-scatter's traffic (a CPU test path)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class AllReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            dist.all_reduce(input_tensor, op=op, group=group)
            output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
            return None

    return AllReduceScatter()


def gloo_all_gather():
    """FSDP2's all-gather on gloo (CPU processes), returning only once gloo's worker thread has
    let go of its tensors (launcher/worker/gloo.py), through FSDP2's hook for a custom collective
    (`FSDPModule.set_custom_all_gather`, _fsdp_collectives.py `DefaultAllGather`). FSDP2 frees a
    block's all-gather output after the next block's copy-out; gloo's thread sometimes still held
    it then, so one rank of a real run read one block's unsharded parameters above the estimate
    (tiny-llama under fsdp2_grad_op: 184,832 bytes, -2.0%, in one run of three)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    from launcher.worker.gloo import references, settle

    class SettledAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            tensors = (output_tensor, input_tensor)
            counts = references(tensors)
            work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
            if work is None:  # FSDP2's own unshard; `unshard(async_op=True)` gets gloo's handle
                settle(tensors, counts)
            return work

    return SettledAllGather()


def _dtype(name):
    import torch

    return getattr(torch, name) if name else None


def clip_grad_norm(parameters, max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_` over gradients that live on different meshes: with
    FSDP x TP the tensor-parallel weights' gradients are 2D DTensors (dp, tp) and the norms' are
    1D (dp), which one `get_total_norm` cannot stack. The 2-norm is taken per (mesh, placements)
    group (`get_total_norm`, one reduction each), made a plain number with `full_tensor()`, and
    combined; every gradient is scaled by min(1, max_norm / (total + 1e-6)) as clip_grad_norm_
    does (torch/nn/utils/clip_grad.py `_clip_grads_with_norm_`)."""
    import torch

    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if hasattr(g, "device_mesh") else None
        groups.setdefault(key, []).append(g)
    total_sq = 0.0
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        total_sq += float(norm) ** 2
    total = total_sq ** 0.5
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


class FSDP2Backend:
    # The model arrives as built on the host: `fully_shard` moves each block's parameters and
    # buffers to the mesh's device as it shards them (_fully_shard/_fsdp_init.py
    # `_move_states_to_device`), and tensor parallelism's `distribute_tensor` moves each weight
    # before splitting it, so the device holds one block unsharded at a time, never the whole
    # model (which a model larger than one GPU would not fit)
    MOVES_MODEL = True

    def __init__(self, model, spec, env, plan, meter) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        config = spec.framework_config
        mesh_shape = config.get("mesh", {})
        dp, tp = int(mesh_shape.get("dp", env.world_size)), int(mesh_shape.get("tp", 1))
        if tp > 1:
            mesh = init_device_mesh(env.device, (dp, tp), mesh_dim_names=("dp", "tp"))
            tp_plan.apply(model, mesh["tp"], config["tp_plan"])
            dp_mesh = mesh["dp"]
        else:
            mesh = dp_mesh = init_device_mesh(env.device, (dp,), mesh_dim_names=("dp",))
        mp = config.get("mp_policy", {})
        kwargs = dict(mesh=dp_mesh,
                      mp_policy=MixedPrecisionPolicy(param_dtype=_dtype(mp.get("param_dtype")),
                                                     reduce_dtype=_dtype(mp.get("reduce_dtype"))),
                      offload_policy=CPUOffloadPolicy() if config.get("cpu_offload") else OffloadPolicy())
        reshard = bool(config.get("reshard_after_forward", True))
        last = bool(config.get("last_block_reshard_after_forward", reshard))
        blocks = tp_plan.decoder_layers(model)
        for i, block in enumerate(blocks):  # torchtitan's policy for the last block (rules.py `keep_last_block`)
            fully_shard(block, reshard_after_forward=last if i == len(blocks) - 1 else reshard, **kwargs)
        # the root: reshard_after_forward=None, FSDP2's default, which keeps the root's
        # parameters unsharded after forward (_fsdp_state.py `_lazy_init`: "For the root, do not
        # reshard after forward"): the LM head is the first module of backward
        fully_shard(model, reshard_after_forward=None, **kwargs)
        if env.device == "cpu" and dp > 1:
            reduce_scatter, all_gather = gloo_reduce_scatter(), gloo_all_gather()
            for module in [*tp_plan.decoder_layers(model), model]:
                module.set_custom_reduce_scatter(reduce_scatter)
                module.set_custom_all_gather(all_gather)
        self.model, self.module, self.mesh, self.tp = model, model, mesh, tp
        self.optimizer = make_optimizer(spec.optimizer, model.parameters(), spec.learning_rate,
                                        spec.weight_decay, spec.sgd_momentum)
        self.scheduler = make_scheduler(self.optimizer, spec.warmup_steps)
        self._spec, self._meter = spec, meter

    def _loss(self, input_ids):
        """The model's own loss (transformers' ForCausalLMLoss); with tensor parallelism the
        vocabulary-sharded logits (the LM head's `Shard(-1)` DTensor output) go through the
        vocab-parallel cross-entropy over the tp group (loss.py), the same shift and mean."""
        if self.tp == 1:
            return self.model(input_ids=input_ids, labels=input_ids).loss
        logits = self.model(input_ids=input_ids).logits
        tp_mesh = self.mesh["tp"]
        local = logits.to_local()
        start = tp_mesh.get_local_rank() * -(-logits.shape[-1] // tp_mesh.size())
        return vocab_parallel_loss(local, input_ids, tp_mesh.get_group(), start)

    def micro_step(self, input_ids, last: bool):
        with self._meter.phase("forward"):
            loss = self._loss(input_ids)
        with self._meter.phase("backward"):
            (loss / self._spec.grad_accum_steps).backward()
        loss = loss.detach()
        return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).float()

    def optimizer_step(self) -> None:
        with self._meter.phase("optimizer"):
            if self._spec.max_grad_norm > 0:
                clip_grad_norm(self.model.parameters(), self._spec.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=self._spec.zero_grad_set_to_none)  # false: kept (torch 1.x)
            self.scheduler.step()

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def save(self, directory: Path, rank: int) -> None:
        """Sharded: `dcp.save` of the model's and the optimizer's sharded state dicts
        (torch/distributed/checkpoint/state_dict.py `get_state_dict`): every rank writes its own
        shards under dcp/, rank 0 the metadata; the scheduler (identical on every rank) by rank 0."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(Path(directory) / DCP_DIR))
        if rank == 0:
            torch.save(self.scheduler.state_dict(), Path(directory) / SCHEDULER)

    def load(self, directory: Path) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(Path(directory) / DCP_DIR))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.scheduler.load_state_dict(torch.load(Path(directory) / SCHEDULER, weights_only=True))
        self._meter.track_external(self.model, self.optimizer)

    def load_neutral(self, directory: Path) -> None:
        """The layout-neutral optimizer (launcher/worker/layout.py: full tensors indexed by the
        trainable parameters' order) through `set_optimizer_state_dict` with full state dicts
        keyed by parameter name, which shards them (torch/distributed/checkpoint/state_dict.py)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        saved = layout.neutral_optimizer(directory)
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        state = {names[int(i)]: value for i, value in saved["state"].items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[int(i)] for i in g["params"]]}
                  for g in saved["param_groups"]]
        set_optimizer_state_dict(self.model, self.optimizer, {"state": state, "param_groups": groups},
                                 options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(layout.neutral_scheduler(directory))
        self._meter.track_external(self.model, self.optimizer)

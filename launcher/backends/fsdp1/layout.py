"""FSDP1 (`FullyShardedDataParallel`, torch 2.13 torch/distributed/fsdp/) on one rank, from the
traced step, on FSDP2's per-block layout machinery (launcher/backends/fsdp2/layout.py
`FSDP2Layout`: virtual events inserted at the traced block boundaries).

The trace is the step FSDP2 traces (the model in the compute dtype, no autocast, no optimizer);
its parameters are replaced by FSDP1's storages, one `FlatParameter` per unit: each decoder block
and the root (embeddings, final norm, LM head), as `ModuleWrapPolicy` wraps them:

- the flat parameter (_flat_param.py `_init_flat_param_and_metadata`, `use_orig_params=True`):
  the unit's parameters in registration order, each starting at a multiple of 16 bytes of the
  compute dtype (`_get_aligned_numel`: padding inserted before a parameter when the running numel
  is not a multiple), the total padded to a multiple of the world size; each rank keeps one equal
  chunk (`_get_shard`: `flatten().chunk(world)`), in the model's dtype, persistent;
- optimizer states: with `use_orig_params=True` the optimizer steps each original parameter's
  view of the local chunk (`_use_sharded_views`), so a rank's states cover the numel of each
  trainable parameter that falls in its chunk (ranks differ);
- unshard (`_runtime_utils.py` `_unshard`, `FlatParamHandle.pre_unshard` / `unshard` /
  `post_unshard`): with a `MixedPrecision` param_dtype the low-precision copy of the shard
  (`_use_low_precision_shard`: `_mp_shard`), then the all-gather output `_full_param_padded`
  (world x chunk, compute dtype), whose views are the unsharded parameters (no copy-out), then
  `_mp_shard` is freed (`_free_low_precision_sharded_param`);
- reshard: a decoder block's `_full_param_padded` is freed in its post-forward under FULL_SHARD
  (`_post_forward_reshard`; the root's is not: "Do not free the root's parameters in the
  post-forward for FULL_SHARD") and in its post-backward otherwise (`_post_backward_reshard`);
- backward, FULL_SHARD with `BACKWARD_PRE`: a unit's pre-backward hook unshards it and prefetches
  the next unit of the backward order (`_pre_backward_hook` -> `_prefetch_handle`): the root's
  prefetches the last block, block l's block l-1, so the root and two blocks are unsharded during a
  block's backward;
- gradients: the original parameters are views of the flat parameter in forward
  (`_use_unsharded_views(as_params=False)`), so autograd keeps each parameter's gradient until the
  unit's last one is ready, then the views' backward concatenates them into one unsharded flat
  gradient (world x chunk, compute dtype) and frees them; the post-backward hook
  (`_post_backward_hook`) then reshards, casts the flat gradient to the reduce dtype when it
  differs (a new tensor; the autograd one stays referenced until the hook returns), allocates the
  sharded output (`_get_reduce_scatter_tensors`: `empty_like(chunks[0])`), reduce-scatters and keeps
  it as `_saved_grad_shard` (`_accumulate_sharded_grad`), freeing the unsharded ones when the hook
  returns. The sharded gradients are the optimizer's (`_finalize_params`: `flat_param.grad`) until
  the next forward's root pre-forward frees them (`_reset_flat_param_grad_info_if_needed`;
  `zero_grad` only drops the original parameters' views of them), laid out as freed at the step's
  end, where nothing is allocated before that. The root's hook runs after the last traced backward
  event (its embedding gradient is the step's last).

Before the step (`Layout.init`, replayed through the allocator first: launcher/memory/replay.py
`init_events`), each unit in wrap order (the blocks, then the root) is put on the device by
`_init_param_handle_from_module` (_init_utils.py): `_move_module_to_device` copies the unit's
parameters still on the host to `device_id` one by one (the worker's model is built on the host;
with `training.built_on_device` they are all there already, built before wrapping), the
`FlatParamHandle` concatenates them into the flat parameter (`flatten_tensors`: `torch.cat`), the
parameters become its views (their storages freed), and `shard` clones this rank's chunk
(`_get_shard`: `chunk.clone()`) and frees the flat parameter (`_typed_storage()._resize_(0)`).

Under gradient accumulation every micro-batch reduce-scatters (the worker never skips the sync);
the laid-out micro-batch is the last, its new shard added into `_saved_grad_shard` and freed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from launcher.backends.base import LayoutSet
from launcher.backends.fsdp1.comm import as_fsdp2
from launcher.backends.fsdp1.rules import reshard_after_forward
from launcher.backends.fsdp2 import layout as fsdp2
from launcher.memory.common import (DTYPE_BYTES, Init, InitUnit, distinct_params, optimizer_state_numel_factor,
                                    optimizer_step_scalar_bytes, optimizer_step_temp_numel)
from launcher.steptrace import Kind, StepTrace
from launcher.types import Strategy

ROOT = -1
POST = 3  # virtual events of a unit's post-backward: flat gradient; reshard, cast and output; frees
AG_STREAM, RS_STREAM, PRE_STREAM = 1, 2, 3  # FSDP1's `_unshard_stream`, `_post_backward_stream`, `_pre_unshard_stream`
ALIGNMENT = 16  # bytes (_flat_param.py `_get_aligned_numel`)


@dataclass(frozen=True)
class FSDP1Setup:
    world: int
    rank: int
    reshard_after_forward: bool  # FULL_SHARD (True) or SHARD_GRAD_OP
    compute_bytes: int  # MixedPrecision param_dtype, else the model's dtype
    shard_bytes: int  # the model's dtype: the flat parameter and the optimizer states
    reduce_bytes: int  # MixedPrecision reduce_dtype, else the compute dtype
    optimizer: str = "adamw_torch"
    grad_accum_steps: int = 1
    built_on_device: bool = False  # training.built_on_device: the whole model on the device before wrapping
    kept_grads: bool = False  # training.zero_grad_set_to_none=false: the sharded gradients zeroed, not dropped


@dataclass
class Unit:
    """One FlatParameter: its parameters and, per parameter, (offset, numel) in the flat numel."""

    layer: int
    params: list
    spans: list
    numel: int  # padded flat numel, a multiple of the world size
    world: int = 1

    @property
    def shard(self) -> int:
        """Each rank's chunk (`_get_shard`: equal chunks of the world-padded flat numel)."""
        return self.numel // self.world

    def local(self, rank: int, trainable) -> list[int]:
        """Numel of each trainable parameter inside `rank`'s chunk (its optimizer view)."""
        a, b = rank * self.shard, (rank + 1) * self.shard
        return [max(0, min(b, o + n) - max(a, o)) for p, (o, n) in zip(self.params, self.spans) if trainable[p]]


def units(trace: StepTrace, world: int, compute_bytes: int) -> dict:
    """layer -> Unit over the distinct parameters (tied copies once), root = -1, with FSDP1's
    alignment and world-size padding (module docstring)."""
    aligned = ALIGNMENT // compute_bytes
    by_layer: dict = {}
    for i in distinct_params(trace):
        by_layer.setdefault(int(trace.params.layer[i]), []).append(i)
    out = {}
    for layer, params in by_layer.items():
        total, spans = 0, []
        for i in params:
            if total % aligned:
                total += aligned - total % aligned
            n = int(trace.params.numel[i])
            spans.append((total, n))
            total += n
        total += -total % world
        out[layer] = Unit(layer, params, spans, total, world)
    return out


def fsdp1_layout(trace: StepTrace, s: FSDP1Setup) -> fsdp2.FSDP2Layout:
    """This rank's storages under FSDP1 on the traced (shallow) model (module docstring)."""
    n, W, r = trace.num_layers, s.world, s.rank
    us = units(trace, W, s.compute_bytes)
    empty = Unit(ROOT, [], [], 0, W)
    root = us.get(ROOT, empty)
    blocks = [us.get(l, empty) for l in range(n)]
    F, B = fsdp2.block_events(trace)
    fs, bs = trace.phases["forward"][0], trace.phases["backward"][0]
    inserts = {fs: 2}
    for l in range(n):
        inserts[F[l]] = inserts.get(F[l], 0) + 2
    full_shard = s.reshard_after_forward
    if full_shard and n:
        inserts[bs] = inserts.get(bs, 0) + 2  # root's pre-backward prefetch of the last block
    for l in range(n):  # post-backward of block l, then block l-1's pre-backward prefetch of l-2
        inserts[B[l]] = inserts.get(B[l], 0) + POST + (2 if full_shard and l >= 2 else 0)
    if full_shard and n >= 2:  # the last block's pre-backward prefetches the one before it
        inserts[B[n]] = inserts.get(B[n], 0) + 2
    lay = fsdp2.FSDP2Layout.build(trace, inserts, reduce_events=POST, step_events=2)
    lay.drop(Kind.PARAM)
    cb, sb, rb = s.compute_bytes, s.shard_bytes, s.reduce_bytes
    cast = cb != sb
    trainable = trace.params.trainable

    lay.add("sharded_params", "parameters", sum(u.numel for u in us.values()) // W * sb)
    lay.init = Init(tuple(InitUnit(u.layer, tuple(int(trace.params.numel[i]) * sb for i in u.params),
                                   (u.shard * sb,), flat=u.numel * sb) for u in [*blocks, root] if u.params),
                    s.built_on_device, kept="sharded_params")
    locals_ = [x for u in us.values() for x in u.local(r, trainable)]
    lay.add("optimizer_states", "optimizer_states", optimizer_state_numel_factor(s.optimizer) * sum(locals_) * sb
            + optimizer_step_scalar_bytes(s.optimizer, sum(1 for x in locals_ if x)))

    def unshard(u: Unit, at: int, end: int) -> None:
        """`_mp_shard` (with a param_dtype) from `at` to `at + 1`, `_full_param_padded` from `at`."""
        if cast:
            lay.add("mp_shard", "buffers", u.shard * cb, at, at + 1, stream=PRE_STREAM)
        lay.add("unsharded_params", "parameters", u.numel * cb, at, end, stream=AG_STREAM)

    # forward: the root at the start, each block at its start; a block resharded at its end
    # (FULL_SHARD) or in its post-backward
    unshard(root, lay.at(fs, 0), lay.reduce_ev(1))
    for l, u in enumerate(blocks):
        end = lay.start(F[l + 1]) if full_shard else lay.at(B[l], 1)
        unshard(u, lay.at(F[l], 0), end)
    # backward prefetches (FULL_SHARD): the root's pre-backward gathers the last block, each block's
    # pre-backward the one before it, after the post-backward of the block whose backward ended
    if full_shard and n:
        unshard(blocks[n - 1], lay.at(bs, 0), lay.at(B[n - 1], 1))
        last_pre = 2 if B[n] == bs else 0  # the last block's pre-backward after the root's, same event
        for l in range(n - 2, -1, -1):  # block l gathered at block l+1's pre-backward
            at = lay.at(B[l + 2], POST) if l + 2 < n else lay.at(B[n], last_pre)
            unshard(blocks[l], at, lay.at(B[l], 1))
    for l in range(n - 1, -1, -1):
        _post_backward(lay, trace, blocks[l], s, lay.at(B[l], 0))
    _post_backward(lay, trace, root, s, lay.reduce_ev(0))
    step_bytes = sb
    lay.add("optimizer_step_temporaries", "optimizer_states",
            step_bytes * optimizer_step_temp_numel(s.optimizer, [x for x in locals_ if x]),
            lay.step_ev(0), lay.step_ev(1))
    return lay


def _post_backward(lay: fsdp2.FSDP2Layout, trace: StepTrace, u: Unit, s: FSDP1Setup, v0: int) -> None:
    """One unit's gradient path at its post-backward moment (virtual events v0..v0+2): v0 the
    unsharded flat gradient (the views' backward, the parameters' gradients still alive); v0+1 the
    parameters' gradients and the unsharded parameters freed, the reduce-dtype copy and the sharded
    output allocated; v0+2 the unsharded gradients freed."""
    if not any(trace.params.trainable[p] for p in u.params):
        return  # a frozen unit has no flat gradient (LoRA's embeddings)
    cb, rb = s.compute_bytes, s.reduce_bytes
    lay.add("unsharded_flat_grad", "gradients", u.numel * cb, v0, v0 + 2)
    if rb != cb:
        lay.add("reduce_dtype_grad", "gradients", u.numel * rb, v0 + 1, v0 + 2, stream=RS_STREAM)
    # kept gradients (`zero_grad(set_to_none=False)`): the zeroed sharded gradient becomes
    # `_saved_grad_shard` in the pre-backward (_flat_param.py `prepare_gradient_for_backward`), the
    # new one is added into it (_runtime_utils.py `_accumulate_sharded_grad`) and it lives on
    accumulated = s.grad_accum_steps > 1 or s.kept_grads
    layer = u.params[0] if accumulated and u.params else -1
    if accumulated:  # `_saved_grad_shard` from earlier micro-batches; this one's added and freed
        lay.add("reduce_scatter_output", "gradients", u.shard * rb, v0 + 1, v0 + 2, stream=RS_STREAM)
        lay.add("sharded_grads", "gradients", u.shard * rb, 0, None if s.kept_grads else lay.step_ev(1),
                stream=RS_STREAM, param=layer)
    else:
        lay.add("sharded_grads", "gradients", u.shard * rb, v0 + 1, lay.step_ev(1), stream=RS_STREAM)
    rows = (trace.kind == Kind.GRAD) & (trace.param >= 0) & np.isin(trace.param, fsdp2.with_tied(trace, u.params))
    lay.free[rows] = np.maximum(v0 + 1, lay.alloc[rows] + 1)


NOTES = (
    "FSDP1 (FullyShardedDataParallel, one FlatParameter per decoder block and the root, "
    "use_orig_params=True): each rank's equal chunk of the aligned, world-padded flat parameter; "
    "optimizer states on the original parameters' views of that chunk; the all-gathered flat "
    "parameter as the unsharded parameters (with MixedPrecision a low-precision copy of the shard "
    "before it); BACKWARD_PRE prefetch; the unsharded flat gradient concatenated from the "
    "parameters' gradients at the unit's end, cast to the reduce dtype, reduce-scattered into the "
    "sharded gradient (torch/distributed/fsdp/; launcher/backends/fsdp1/layout.py).",
    "Block boundaries: the traced layer range divided into equal parts (a repeated block "
    "allocates the same storages).",
)


INIT_SOURCE = "_init_utils.py `_move_module_to_device`, _flat_param.py `FlatParamHandle.shard`"


MIXED_UNIT_NOTE = (
    "LoRA under FSDP1: one unit per decoder layer holding the frozen base and the adapters (Accelerate's "
    "TRANSFORMER_BASED_WRAP, what the worker runs), so autograd computes the frozen weights' gradients too "
    "and keeps the inputs they need, and each unit's flat and sharded gradients cover the whole unit "
    "(launcher/trace.py `_flat_param_grads`). HF Trainer with a PEFT model (PEFT's fsdp_auto_wrap_policy) and "
    "torchtune wrap each adapter in a unit of its own, which computes no frozen gradient: their runs need less.")


def trace_request(strategy: Strategy, workload) -> dict:
    """The step FSDP2 traces (the model in the compute dtype, no autocast, no optimizer); with
    LoRA every parameter of a unit that holds adapters has a gradient (launcher/trace.py
    `_flat_param_grads`; the key ignores it when every parameter trains)."""
    return {**fsdp2.trace_request(as_fsdp2(strategy), workload), "flat_param_grads": True}


def setup(strategy: Strategy, workload, dp: int, rank: int) -> FSDP1Setup:
    s2 = fsdp2.setup(as_fsdp2(strategy), workload, dp, rank)
    return FSDP1Setup(world=dp, rank=rank, reshard_after_forward=reshard_after_forward(strategy),
                      compute_bytes=s2.compute_bytes, shard_bytes=s2.shard_bytes,
                      reduce_bytes=s2.reduce_bytes or s2.compute_bytes, optimizer=s2.optimizer,
                      grad_accum_steps=s2.grad_accum_steps, built_on_device=workload.built_on_device,
                      kept_grads=s2.kept_grads)


def memory(traces, strategy: Strategy, workload, knobs, dp: int, device: str) -> LayoutSet:
    """One layout pair per set of ranks whose chunks hold the same trainable numel (their
    optimizer states differ); the estimate reports every rank and the worst."""
    depths = (traces.depth1, traces.depth2)
    cb = DTYPE_BYTES[trace_request(strategy, workload)["param_dtype"]]
    per_depth = [list(units(t, dp, cb).values()) for t in depths]
    keyed: dict = {}
    for rank in range(dp):
        key = tuple(tuple(tuple(u.local(rank, t.params.trainable)) for u in us)
                    for us, t in zip(per_depth, depths))
        keyed.setdefault(key, []).append(rank)
    out = tuple((tuple(ranks) if len(keyed) > 1 else (),
                 tuple(fsdp1_layout(t, setup(strategy, workload, dp, ranks[0])) for t in depths))
                for ranks in keyed.values())
    t = traces.depth1
    init = (fsdp2.init_note("FSDP1", workload.built_on_device, INIT_SOURCE),)
    mixed = any(0 < sum(bool(t.params.trainable[p]) for p in u.params) < len(u.params) for u in per_depth[0])
    kept = (fsdp2.KEPT_GRADS_NOTE,) * (not workload.zero_grad_set_to_none)
    return LayoutSet(groups=out, traces=traces, notes=NOTES + init + (MIXED_UNIT_NOTE,) * mixed + kept)

"""FSDP2 (`fully_shard`, torch 2.13 torch/distributed/fsdp/_fully_shard/) on one rank, from the
traced step (launcher/memory/common.py `Layout` machinery, as launcher/memory/zero3.py models
DeepSpeed ZeRO-3).

The trace is one real step of the model in the dtype FSDP2 computes in (the `MixedPrecisionPolicy`
param_dtype, or the model's dtype), without an optimizer. Its activations and its gradients as
autograd allocates them are kept; its parameters are replaced by FSDP2's storages, one
`FSDPParamGroup` per decoder block plus the root (embeddings, final norm, LM head):

- sharded parameters (`FSDPParam._init_sharded_param`, _fsdp_param.py): each parameter is cut
  into `world` chunks along dim 0 (`_chunk_with_empty`, torch.chunk sizes) and every rank keeps a
  chunk padded to the first chunk's size (`padded_sharded_param_size`), in the model's dtype;
- optimizer states: `zeros_like` of the sharded DTensor parameter, i.e. of the rank's *unpadded*
  chunk (torch/optim/adamw.py `_init_group`): ranks differ when a dim 0 does not divide evenly;
- per group unshard (`FSDPParamGroup.unshard` / `wait_for_unshard`, _fsdp_param_group.py;
  `foreach_all_gather` / `foreach_all_gather_copy_out`, _fsdp_collectives.py): with a param_dtype,
  a flat cast copy of the shards (`flat_foreach_copy_input`, freed after the copy-in), the flat
  all-gather output (world x padded shard numel, param dtype), then the unsharded parameters
  (`alloc_all_gather_outputs`, the same size). In forward the all-gather output is kept until the
  next group's copy-out is done (implicit prefetch: `comm_ctx.all_gather_state`, released when the
  next `wait_for_unshard` returns, or in the root's post-forward); in backward it is freed right after the
  copy-out, and each block's pre-backward prefetches the previous block's all-gather
  (`_backward_prefetch`: `unshard` only, its copy-out at that block's own pre-backward);
- unsharded parameters are freed after the block's forward (`reshard_after_forward=True`) or after
  its backward; the root's stay unsharded from forward to the end of backward (`_lazy_init`: the
  root does not reshard after forward), and so do the last block's under torchtitan's policy
  (rules.py `keep_last_block`): the root's pre-backward prefetch of it and its own pre-backward
  unshard are then no-ops (`FSDPParamGroup.unshard` returns when `is_unsharded`), and its
  pre-backward still prefetches the block before it;
- per group post-backward (`FSDPParamGroup.post_backward`, `foreach_reduce`): reshard, free the
  previous group's reduce-scatter input (`reduce_scatter_max_input_buffers` = 1), allocate this
  group's reduce-scatter input (world x padded shard numel, reduce dtype), free the unsharded
  gradients, allocate the reduce-scatter output (padded shard numel, reduce dtype), whose views are
  the sharded gradients until `zero_grad`. The root's post-backward runs in the final callback
  (`_root_post_backward_final_callback`), which then frees the last reduce-scatter input.
- with a mesh of one rank (FSDP x TP on dp=1) the same storages exist without a collective: the
  unsharded copy is made per parameter (`all_gather_inputs` casts with a param_dtype) and the
  reduce-scatter input is copied to the output.

Dtypes per parameter (`own_bytes`): the model's dtype, except peft's fp32 adapters on a 16-bit
model and a sharded QLoRA base (its 4-bit weights stored as compute-dtype elements, its other
parameters in the compute dtype, `four_bit_params`). A MixedPrecisionPolicy param_dtype casts and
gathers every parameter in that dtype and reduces in its reduce_dtype; without one each parameter is
gathered, reduced and its optimizer states kept in its own dtype (the all-gather then runs on bytes,
_fsdp_collectives.py `_get_all_gather_input_metadatas`).

Streams (GPU allocator replay, launcher/memory/allocator.py): with implicit prefetching the
copy-in and the all-gather output are allocated on the all-gather copy-in stream
(`foreach_all_gather` under `comm_ctx.get_all_gather_streams` in forward and pre-backward), the
reduce-scatter output, whose views are the sharded gradients, on the reduce-scatter stream; the
reduce-scatter input and the unsharded parameters and gradients on the default stream. Each stream
caches its own blocks.

Block boundaries: the trace records where the decoder layers start and end in forward and in
backward (`StepTrace.layer_bounds`); a repeated block allocates and frees the same storages, so
block l spans the l-th equal part of that range. FSDP2's own steps at a boundary (copy-in,
all-gather output, copy-out, frees) are virtual events inserted before the traced event
(`FSDP2Layout.inserts`), in FSDP2's order, so each moment's live bytes are exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from launcher.backends.base import LayoutSet
from launcher.backends.fsdp2.rules import keep_last_block, mixed_precision, model_dtype, reshard_after_forward
from launcher.memory.common import (DTYPE_BYTES, Init, InitUnit, Layout, distinct_params, four_bit_params,
                                    grad_ready_order, optimizer_state_numel_factor, optimizer_step_scalar_bytes,
                                    optimizer_step_temp_numel)
from launcher.steptrace import Kind, StepTrace
from launcher.types import Strategy

ROOT = -1
POST = 3  # virtual events of a group's post-backward (u0, u1, u2)
AG_STREAM, RS_STREAM = 1, 2  # FSDPCommContext's all-gather copy-in and reduce-scatter streams


@dataclass(frozen=True)
class FSDP2Setup:
    world: int  # ranks of the FSDP (dp) mesh dimension
    rank: int  # this rank's index on it
    reshard_after_forward: bool
    keep_last: bool  # the last block does not reshard after forward (rules.py `keep_last_block`)
    compute_bytes: int  # bytes per element of the unsharded parameters (param_dtype or model dtype)
    shard_bytes: int  # bytes per element of sharded parameters and optimizer states (at least; `own_bytes`)
    reduce_bytes: int  # bytes per element of the reduce-scatter buffers and sharded gradients; 0: own dtype
    cast: bool  # a MixedPrecisionPolicy param_dtype differs from the sharded dtype
    optimizer: str = "adamw_torch"
    offload: bool = False  # CPUOffloadPolicy: shards, sharded gradients and the step on the host
    frozen_bytes: int = 0  # bytes per element of frozen parameters' shards; 0: shard_bytes (sharded QLoRA: compute)
    grad_accum_steps: int = 1  # micro-batches per step, each reduce-scattered (the worker never skips the sync)
    kept_grads: bool = False  # training.zero_grad_set_to_none=false: the sharded gradients zeroed, not dropped
    built_on_device: bool = False  # training.built_on_device: the whole model on the device before fully_shard
    replay_init: bool = True  # the initialization is replayed (`Layout.init`): not with offload or TP


def _shape(trace: StepTrace, i: int, four_bit: dict | None = None) -> tuple:
    """Parameter i's shape as fully_shard sees it: a 4-bit weight is its packed bytes stored as
    compute-dtype elements, shape (n, 1) (bitsandbytes `quantize_4bit` with `quant_storage`)."""
    p = trace.params
    if four_bit and i in four_bit:
        return (four_bit[i][0] // int(p.element_size[i]), 1)
    return tuple(p.shapes[i]) if p.shapes else (int(p.numel[i]),)


def chunk_numels(shape: tuple, world: int) -> tuple[int, list[int]]:
    """(padded shard numel, [each rank's unpadded chunk numel]) of one parameter: torch.chunk along
    dim 0 (`_chunk_with_empty`), padded to the first chunk (`padded_sharded_param_size`)."""
    rows = shape[0] if shape else 1
    rest = math.prod(shape[1:]) if len(shape) > 1 else 1
    c = -(-rows // world)
    return c * rest, [max(0, min(c, rows - r * c)) * rest for r in range(world)]


@dataclass
class Group:
    """One FSDPParamGroup: a decoder block (`layer` >= 0) or the root (`ROOT`)."""

    layer: int
    params: list = field(default_factory=list)
    padded_shard: int = 0  # numel per rank, padded
    local: list = field(default_factory=list)  # numel per rank, unpadded (optimizer states)
    numels: list = field(default_factory=list)  # per parameter padded shard numel
    trainable_padded: int = 0  # padded shard numel of the parameters with gradients (reduce-scatter)
    trainable_local: list = field(default_factory=list)  # unpadded, of the trainable ones (optimizer states)
    cast_numels: list = field(default_factory=list)  # padded shard numel of each parameter cast to the param dtype
    # with a setup, bytes: padded shards in their own dtypes; unsharded (gathered) parameters;
    # reduce-scatter output of the trainable ones; each rank's unpadded trainable chunks (optimizer states)
    shard_bytes: int = 0
    gather_bytes: int = 0
    reduce_bytes: int = 0
    trainable_local_bytes: list = field(default_factory=list)


def groups(trace: StepTrace, world: int, s: FSDP2Setup | None = None) -> dict:
    """layer -> Group over the distinct parameters (tied copies once), root = -1. With a setup,
    each parameter's bytes follow its own dtype (`own_bytes`): a MixedPrecisionPolicy param_dtype
    casts (`cast_numels`) and gathers every parameter in that dtype, and reduces in its
    reduce_dtype; without one, each is gathered and reduced in its own dtype
    (_fsdp_param.py `init_dtype_attrs`, _fsdp_collectives.py `_get_all_gather_input_metadatas`)."""
    out: dict = {}
    four_bit = four_bit_params(trace)
    for i in distinct_params(trace):
        layer = int(trace.params.layer[i])
        g = out.setdefault(layer, Group(layer, local=[0] * world, trainable_local=[0] * world,
                                        trainable_local_bytes=[0] * world))
        padded, local = chunk_numels(_shape(trace, i, four_bit), world)
        g.params.append(i)
        g.padded_shard += padded
        g.numels.append(padded)
        g.local = [a + b for a, b in zip(g.local, local)]
        trainable = bool(trace.params.trainable[i])
        if trainable:  # frozen ones (LoRA's base) are gathered, never reduced
            g.trainable_padded += padded
            g.trainable_local = [a + b for a, b in zip(g.trainable_local, local)]
        if s is None:
            continue
        own = own_bytes(trace, i, s)
        g.shard_bytes += padded * own
        g.gather_bytes += padded * (s.compute_bytes if s.cast else own)
        if s.cast and own != s.compute_bytes:
            g.cast_numels.append(padded)
        if trainable:
            g.reduce_bytes += padded * (s.reduce_bytes or own)
            g.trainable_local_bytes = [a + b * own for a, b in zip(g.trainable_local_bytes, local)]
    return out


def initialization(trace: StepTrace, units: list, s: FSDP2Setup) -> Init:
    """fully_shard's initialization of the units in wrap order (the blocks, then the root), for the
    allocator replay (`Layout.init`): `_move_states_to_device` (_fsdp_init.py) copies the unit's
    parameters still on the host to the device (`tensor.data = tensor.to(device)`; with
    `training.built_on_device` they are all there already), each `FSDPParam` allocates its padded
    shard and copies its chunk in (_fsdp_param.py `_init_sharded_param`: `new_zeros`, `copy_`),
    and the device copies are freed when `fully_shard` returns and drops its list of them."""
    return Init(tuple(InitUnit(g.layer, tuple(int(trace.params.numel[i]) * own_bytes(trace, i, s) for i in g.params),
                               tuple(n * own_bytes(trace, i, s) for n, i in zip(g.numels, g.params)))
                      for g in units if g.params), s.built_on_device, kept="sharded_params")


def own_bytes(trace: StepTrace, i: int, s: FSDP2Setup) -> int:
    """Bytes per element of parameter i as fully_shard holds it: the model's dtype (`shard_bytes`);
    a trainable parameter traced wider is that wide (peft's fp32 adapters on a 16-bit model, traced
    fp32 where no MixedPrecisionPolicy casts them: rules.py `adapter_autocast`); a frozen one of a
    sharded QLoRA base is in the compute dtype (`frozen_bytes`)."""
    if trace.params.trainable[i]:
        return max(s.shard_bytes, int(trace.params.element_size[i]))
    return s.frozen_bytes or s.shard_bytes


@dataclass
class FSDP2Layout(Layout):
    """A `Layout` with virtual events inserted before chosen traced events (FSDP2's steps at block
    boundaries): `inserts[p]` events come right after traced event p-1."""

    inserts: dict = field(default_factory=dict)
    _keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _cum: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @classmethod
    def build(cls, trace: StepTrace, inserts: dict, reduce_events: int, step_events: int) -> "FSDP2Layout":
        lay = cls(trace, np.ones(len(trace.nbytes), bool), trace.alloc.copy(), trace.free.copy(),
                  reduce_events, step_events, [], dict(inserts))
        keys = sorted(k for k, v in inserts.items() if v > 0)
        lay._keys = np.array(keys, np.int64)
        lay._cum = np.cumsum([inserts[k] for k in keys]).astype(np.int64)
        lay.alloc, lay.free = lay.ev(trace.alloc), lay.ev(trace.free)
        return lay

    def _inserted_upto(self, event):
        e = np.asarray(event)
        idx = np.searchsorted(self._keys, e, side="right") - 1
        return np.where(idx >= 0, self._cum[np.clip(idx, 0, None)] if len(self._cum) else 0, 0)

    @property
    def num_events(self) -> int:
        return int(self.trace.num_events + self.reduce_events + self.step_events
                   + (self._cum[-1] if len(self._cum) else 0))

    def ev(self, event):
        shift = self.reduce_events + self.step_events
        e = np.asarray(event)
        return np.where(e >= self.backward_end, e + shift, e) + self._inserted_upto(e)

    def at(self, p: int, k: int = 0) -> int:
        """Index of the k-th virtual event before traced event p."""
        return int(self.ev(p)) - self.inserts.get(p, 0) + k

    def start(self, p: int) -> int:
        """Index where traced event p's moment begins (its virtual events included)."""
        return int(self.ev(p)) - self.inserts.get(p, 0)

    def reduce_ev(self, k: int) -> int:
        return int(self.ev(self.backward_end)) - self.reduce_events - self.step_events + k

    def step_ev(self, k: int) -> int:
        return self.reduce_ev(self.reduce_events + k)

    @property
    def phases(self) -> dict:
        t = self.trace.phases
        b_end = self.reduce_ev(self.reduce_events)
        return {"forward": (self.start(t["forward"][0]), self.start(t["backward"][0])),
                "backward": (self.start(t["backward"][0]), b_end),
                "optimizer": (b_end, int(self.ev(t["optimizer"][1])))}

    def segments(self, phase: str) -> list[tuple[int, int]]:
        a, b = self.phases[phase]
        cuts = sorted(self.start(c) for c in self.trace.layer_bounds.get(phase, ()))
        edges = [a, *(c for c in cuts if a < c < b), b]
        return [(x, y) for x, y in zip(edges, edges[1:]) if y > x]


def block_events(trace: StepTrace) -> tuple[list[int], list[int]]:
    """(F, B): F[l] the traced event where block l's forward starts (F[n]: the last ends); B[l]
    where block l's backward ends (its post-backward; B[n]: the last block's backward starts).

    Without the traced backward boundaries (LoRA with frozen embeddings: the first block's input
    needs no gradient, so the tracer's 'bwd1' mark never fires) block l's backward ends after its
    last gradient is ready, and the last block's starts where the gradient of its output is
    computed (`layer_bounds['backward_start']`, where FSDP2's pre-backward hook on the block's
    outputs runs: _fsdp_state.py `_register_pre_backward_hook`), else one block period before its end."""
    n = trace.num_layers
    f0, f1 = trace.layer_bounds.get("forward", trace.phases["forward"])
    forward = [int(round(f0 + l * (f1 - f0) / n)) for l in range(n + 1)]
    if "backward" in trace.layer_bounds or n < 2:
        b0, b1 = trace.layer_bounds.get("backward", trace.phases["backward"])
        return forward, [int(round(b1 - l * (b1 - b0) / n)) for l in range(n + 1)]
    last_ready = {}
    for p, e in grad_ready_order(trace):
        layer = int(trace.params.layer[p])
        if layer >= 0:
            last_ready[layer] = max(last_ready.get(layer, -1), e)
    ends = [last_ready[l] + 1 for l in range(n)]
    start = trace.layer_bounds.get("backward_start", (ends[n - 1] - (ends[n - 2] - ends[n - 1]),))[0]
    return forward, ends + [start]


def fsdp2_layout(trace: StepTrace, s: FSDP2Setup) -> FSDP2Layout:
    """This rank's storages under FSDP2 on the traced (shallow) model (module docstring)."""
    n, W, r = trace.num_layers, s.world, s.rank
    gs = groups(trace, W, s)
    root = gs.get(ROOT, Group(ROOT, local=[0] * W))
    blocks = [gs.get(l, Group(l, local=[0] * W)) for l in range(n)]
    F, B = block_events(trace)
    fs, bs = trace.phases["forward"][0], trace.phases["backward"][0]
    inserts = {fs: 2}
    for l in range(n):
        inserts[F[l]] = inserts.get(F[l], 0) + 2
    if s.reshard_after_forward:
        inserts[bs] = inserts.get(bs, 0) + 2  # root's pre-backward prefetch of the last block
    for l in range(n):  # post-backward of block l, then pre-backward of block l-1 (same moment)
        inserts[B[l]] = inserts.get(B[l], 0) + POST + (3 if s.reshard_after_forward and l > 0 else 0)
    if s.reshard_after_forward and n:  # pre-backward of the last block
        inserts[B[n]] = inserts.get(B[n], 0) + 3
    lay = FSDP2Layout.build(trace, inserts, reduce_events=3, step_events=2)
    lay.drop(Kind.PARAM)
    cb, sb = s.compute_bytes, s.shard_bytes
    unsharded = lambda g: W * g.gather_bytes  # noqa: E731
    kept = lambda l: s.reshard_after_forward and s.keep_last and l == n - 1  # noqa: E731
    ag_out = lambda g: W * g.gather_bytes if W > 1 else 0  # noqa: E731

    def cast_temp(g) -> int:
        """With W > 1 the flat cast copy of the group's shards; with W = 1 one parameter's cast at
        a time (the previous one released when the next is assigned). With CPUOffloadPolicy each
        shard is copied to the device (`all_gather_inputs`: `sharded_param_data.to(device)`) and
        cast, all kept in `param_all_gather_inputs` until the copy-in."""
        if s.offload:
            return g.padded_shard * cb + (max(g.numels, default=0) * sb if s.cast else 0)
        if not g.cast_numels:
            return 0
        if W > 1:
            return sum(g.cast_numels) * cb
        pairs = [a + b for a, b in zip(g.cast_numels, g.cast_numels[1:])] or g.cast_numels
        return max(pairs, default=0) * cb

    # persistent: sharded parameters (padded) and optimizer states (unpadded local chunks of the
    # trainable parameters); in host memory under CPUOffloadPolicy (_fsdp_param.py
    # `_init_sharded_param`: `padded_sharded_param.cpu()`, pinned; the optimizer steps them there)
    lay.add("sharded_params", "parameters", sum(g.shard_bytes for g in gs.values()), host=s.offload)
    if s.replay_init and not four_bit_params(trace):
        lay.init = initialization(trace, [*blocks, root], s)
    quant_state = sum(q for _, q in four_bit_params(trace).values())
    if quant_state:  # replicated on every rank, outside the shards (`four_bit_params`)
        lay.add("quant_state", "parameters", quant_state)
    local = sum(g.trainable_local_bytes[r] for g in gs.values())  # states in each parameter's dtype
    trainable = [i for i in distinct_params(trace) if trace.params.trainable[i]]
    lay.add("optimizer_states", "optimizer_states", optimizer_state_numel_factor(s.optimizer) * local
            + optimizer_step_scalar_bytes(s.optimizer, len(trainable)), host=s.offload)

    def held(f: int) -> int:
        """Where the previous group's forward all-gather output is freed, at the unshard of the
        block starting at traced event `f`: after its copy-out (virtual event 1), when
        `wait_for_unshard` returns. It drops `comm_ctx.all_gather_state` before the copy-out, but
        its local `prev_all_gather_state` (the walrus in `if prev_all_gather_state := ...`) keeps
        the result alive until the function ends."""
        return lay.at(f, 2)

    # forward: root unshard at the start, then each block's unshard at its start
    lay.add("cast_copy", "buffers", cast_temp(root), lay.at(fs, 0), lay.at(fs, 1), stream=AG_STREAM)
    # a forward all-gather output lives until the next group's copy-out is done (`held`)
    lay.add("all_gather_output", "buffers", ag_out(root), lay.at(fs, 0), held(F[0]) if n else lay.start(bs),
            stream=AG_STREAM)
    root_end = lay.reduce_ev(0)
    lay.add("unsharded_params", "parameters", unsharded(root), lay.at(fs, 1), root_end)
    for l, g in enumerate(blocks):
        a0, a1 = lay.at(F[l], 0), lay.at(F[l], 1)
        lay.add("cast_copy", "buffers", cast_temp(g), a0, a1, stream=AG_STREAM)
        ag_end = held(F[l + 1]) if l + 1 < n else lay.start(bs)
        lay.add("all_gather_output", "buffers", ag_out(g), a0, ag_end, stream=AG_STREAM)
        end = lay.start(F[l + 1]) if s.reshard_after_forward and not kept(l) else lay.at(B[l], 0)
        lay.add("unsharded_params", "parameters", unsharded(g), a1, end)

    # backward
    if s.reshard_after_forward and n:
        # root pre-backward: prefetch the last block (unshard only; a no-op when it was kept)
        if not kept(n - 1):
            lay.add("cast_copy", "buffers", cast_temp(blocks[-1]), lay.at(bs, 0), lay.at(bs, 1), stream=AG_STREAM)
        prefetched_at = lay.at(bs, 0)
        for l in range(n - 1, -1, -1):
            g = blocks[l]
            pre = B[l + 1]  # this block's pre-backward moment
            k = 0 if l == n - 1 else POST  # after block l+1's post-backward steps at the same event
            copy_out, after_copy = lay.at(pre, k), lay.at(pre, k + 1)
            if not kept(l):  # a kept block is still unsharded from its forward
                lay.add("all_gather_output", "buffers", ag_out(g), prefetched_at, after_copy, stream=AG_STREAM)
                lay.add("unsharded_params", "parameters", unsharded(g), copy_out, lay.at(B[l], 0))
            if l > 0:  # prefetch block l-1
                h = blocks[l - 1]
                lay.add("cast_copy", "buffers", cast_temp(h), after_copy, after_copy + 1, stream=AG_STREAM)
                prefetched_at = after_copy
    # post-backward of each block: u0 reshard and reduce-scatter input; u1 gradients freed and
    # reduce-scatter output; u2 the last gradient freed
    for l in range(n - 1, -1, -1):
        g = blocks[l]
        u0, u1, u2 = lay.at(B[l], 0), lay.at(B[l], 1), lay.at(B[l], 2)
        rs_end = lay.at(B[l - 1], 0) if l > 0 else lay.reduce_ev(0)
        _reduce_terms(lay, trace, g, s, u0, u1, u2, rs_end)
    # root post-backward in the final callback (reduce events r0..r2), which then frees the last
    # reduce-scatter input
    r0, r1, r2 = lay.reduce_ev(0), lay.reduce_ev(1), lay.reduce_ev(2)
    _reduce_terms(lay, trace, root, s, r0, r1, r2, lay.reduce_ev(3))
    # optimizer step over the sharded parameters (local chunks): foreach temporaries
    locals_ = [chunk_numels(_shape(trace, i), W)[1][r] for i in trainable]
    step_bytes = max((own_bytes(trace, i, s) for i in trainable), default=sb)
    lay.add("optimizer_step_temporaries", "optimizer_states",
            step_bytes * optimizer_step_temp_numel(s.optimizer, locals_), lay.step_ev(0), lay.step_ev(1),
            host=s.offload)
    return lay


def _reduce_terms(lay: FSDP2Layout, trace: StepTrace, g: Group, s: FSDP2Setup, u0: int, u1: int, u2: int,
                  rs_end: int) -> None:
    """One group's `foreach_reduce` (_fsdp_collectives.py): the reduce-scatter input (world x padded
    shard numel, reduce dtype) from u0 until the next group's post-backward frees it
    (`reduce_scatter_states`, at most `reduce_scatter_max_input_buffers` = 1 kept); the unsharded
    gradients freed at u1 (`unsharded_grads.clear()`), except the group's last parameter's, which
    the loop variable `unsharded_grad` of the world > 1 pre-pass holds until `foreach_reduce`
    returns (u2); the reduce-scatter output from u1 to `zero_grad` (its views are the sharded
    gradients). On CPU processes the worker reduce-scatters by an in-place all-reduce of the input
    (worker.py `gloo_reduce_scatter`), which allocates nothing more, as NCCL's reduce-scatter."""
    W = s.world
    lay.add("reduce_scatter_input", "buffers", W * g.reduce_bytes, u0, rs_end)
    # with gradient accumulation the step laid out is the last micro-batch's: the sharded gradients of
    # the ones before it are alive from its start, and this one's output is added into them and
    # dropped (`fsdp_param.sharded_param.grad._local_tensor += new_sharded_grad`)
    # (`param`: the group's layer, so the full-depth rebuild holds one per layer); kept gradients
    # (`zero_grad(set_to_none=False)`) are added into the same way and live through the whole step
    accumulated = s.grad_accum_steps > 1 or s.kept_grads
    layer = g.params[0] if accumulated and g.params else -1
    end = None if s.kept_grads else lay.step_ev(1)
    if s.offload:  # the device output is copied to the host and dropped (`new_sharded_grad.to("cpu")`)
        lay.add("reduce_scatter_output", "gradients", g.reduce_bytes, u1, u2, stream=RS_STREAM)
        lay.add("sharded_grads", "gradients", g.reduce_bytes, 0 if accumulated else u1, end, host=True,
                param=layer)
    elif accumulated:
        lay.add("reduce_scatter_output", "gradients", g.reduce_bytes, u1, u2, stream=RS_STREAM)
        lay.add("sharded_grads", "gradients", g.reduce_bytes, 0, end, stream=RS_STREAM, param=layer)
    else:
        lay.add("sharded_grads", "gradients", g.reduce_bytes, u1, lay.step_ev(1), stream=RS_STREAM)
    g_rows = (trace.kind == Kind.GRAD) & (trace.param >= 0)
    with_grad = [p for p in g.params if trace.params.trainable[p]]
    last = with_grad[-1:] if W > 1 else []
    rows = g_rows & np.isin(trace.param, with_tied(trace, [p for p in g.params if p not in last]))
    lay.free[rows] = np.maximum(u1, lay.alloc[rows] + 1)
    rows = g_rows & np.isin(trace.param, with_tied(trace, last))
    lay.free[rows] = np.maximum(u2, lay.alloc[rows] + 1)


def with_tied(trace: StepTrace, params: list) -> list:
    """The parameters and their tied copies (which share their storage and gradient)."""
    tied = trace.params.tied_to
    return list(params) + [i for i in range(len(tied)) if tied[i] in set(params)]


NOTES = (
    "FSDP2 (fully_shard per decoder block and root): sharded parameters padded to the first "
    "chunk, optimizer states on each rank's unpadded chunk, all-gather outputs with implicit "
    "forward prefetch and explicit backward prefetch, unsharded parameters, reduce-scatter input "
    "and output per group (torch/distributed/fsdp/_fully_shard/; launcher/backends/fsdp2/layout.py).",
    "Block boundaries: the traced layer range divided into equal parts (a repeated block "
    "allocates the same storages).",
)


KEPT_GRADS_NOTE = (
    "training.zero_grad_set_to_none=false: zero_grad zeroes the sharded gradients in place (torch 1.x's default), "
    "so they live through the whole step; each reduce-scatter output is added into them and freed (FSDP2 "
    "`foreach_reduce`: `sharded_param.grad._local_tensor += new_sharded_grad`; FSDP1 `_saved_grad_shard`).")


def init_note(framework: str, built_on_device: bool, source: str) -> str:
    """The plan's note on the initialization replayed before the step (`Layout.init`)."""
    if built_on_device:
        return (f"GPU reserved: the whole model is on the GPU before {framework} wraps it "
                "(training.built_on_device), and that initialization is replayed through the allocator before "
                f"the step ({source}). Each parameter's own segment stays cached after {framework} shards it, "
                "and the step's requests larger than it cannot reuse it. Reserved and device total include "
                "what is left of it. The fit check counts only the segments the step's own blocks are split "
                "from: an out-of-memory retry releases a wholly free cached segment (CUDACachingAllocator.cpp "
                "release_cached_blocks).")
    return (f"GPU reserved: {framework}'s initialization is replayed through the allocator before the step: it "
            f"copies each unit's parameters from the host to the GPU and keeps this rank's shards ({source}); "
            "the blocks it frees stay cached for the step to reuse.")


INIT_SOURCE = "_fsdp_init.py `_move_states_to_device`, _fsdp_param.py `_init_sharded_param`"


QLORA_NOTE = (
    "Sharded QLoRA: the 4-bit weights are stored as compute-dtype elements (bitsandbytes quant_storage) "
    "and sharded, gathered and freed like the other frozen parameters; their quantization states "
    "(absmax, double-quantization constants) are replicated on every rank; the rest of the base stays in "
    "the compute dtype (launcher/memory/common.py `four_bit_params`).")


def trace_request(strategy: Strategy, workload) -> dict:
    """The `TraceKey` fields: the model in the dtype FSDP2 computes in (the MixedPrecisionPolicy
    param_dtype, else the model's dtype), no autocast (FSDP2 casts parameters, not ops), no traced
    optimizer (modelled here on the shards); with tp > 1 one tensor-parallel rank's shard."""
    compute = mixed_precision(workload.precision)["param_dtype"] or model_dtype(workload.precision)
    out = {"param_dtype": compute, "autocast_dtype": None, "optimizer": "none"}
    if strategy.tp_size > 1:
        out["tp_size"] = strategy.tp_size
    return out


def setup(strategy: Strategy, workload, dp: int, rank: int, frozen_bytes: int = 0, knobs=None) -> FSDP2Setup:
    """`frozen_bytes`: bytes per element of the frozen parameters when they are not in the model's
    dtype: a sharded QLoRA base is built in its compute dtype and not upcast (rules.py
    `peft_settings`); 0: the model's dtype. `knobs`: the fsdp2 config group (`keep_last_block`)."""
    mp = mixed_precision(workload.precision)
    shard = model_dtype(workload.precision)
    compute = mp["param_dtype"] or shard
    return FSDP2Setup(world=dp, rank=rank, reshard_after_forward=reshard_after_forward(strategy),
                      keep_last=keep_last_block(strategy, knobs),
                      compute_bytes=DTYPE_BYTES[compute], shard_bytes=DTYPE_BYTES[shard],
                      reduce_bytes=DTYPE_BYTES[mp["reduce_dtype"] or mp["param_dtype"]] if mp["param_dtype"] else 0,
                      cast=compute != shard,
                      optimizer=workload.state_optimizer, offload=strategy.offload_params,
                      frozen_bytes=frozen_bytes, grad_accum_steps=workload.grad_accum_steps,
                      kept_grads=not workload.zero_grad_set_to_none,
                      built_on_device=workload.built_on_device,
                      replay_init=not strategy.offload_params and strategy.tp_size == 1)


def memory(traces, strategy: Strategy, workload, knobs, dp: int, device: str) -> LayoutSet:
    """One layout pair per set of ranks with the same unpadded chunks (their optimizer states
    differ when a dimension does not divide); the estimate reports every rank and the worst."""
    depths = (traces.depth1, traces.depth2)
    keyed: dict = {}
    per_depth = [list(groups(t, dp).values()) for t in depths]  # the same for every rank
    for rank in range(dp):
        key = tuple(tuple(g.trainable_local[rank] for g in gs) for gs in per_depth)
        keyed.setdefault(key, []).append(rank)
    four_bit = four_bit_params(traces.depth1)  # sharded QLoRA: the base in the traced compute dtype
    frozen = int(traces.depth1.params.element_size[next(iter(four_bit))]) if four_bit else 0
    out = tuple((tuple(ranks) if len(keyed) > 1 else (),
                 tuple(fsdp2_layout(t, setup(strategy, workload, dp, ranks[0], frozen, knobs.get("fsdp2")))
                       for t in depths))
                for ranks in keyed.values())
    replayed = out[0][1][0].init is not None
    init = (init_note("FSDP2", workload.built_on_device, INIT_SOURCE),) if replayed else ()
    kept = (KEPT_GRADS_NOTE,) * (not workload.zero_grad_set_to_none)
    return LayoutSet(groups=out, traces=traces, notes=NOTES + init + (QLORA_NOTE,) * bool(four_bit) + kept)

"""ColossalAI 0.5.0 plugins on one rank. Paths below are under colossalai/ in the installed package.

- cai_ddp (booster/plugin/torch_ddp_plugin.py): torch DDP with the emitted kwargs -> ddp.py.
- cai_zero1/2 (low_level_zero_plugin.py + zero/low_level/low_level_optim.py): `lowlevel_zero_layout`.
- cai_tp (hybrid_parallel_plugin.py): the tensor-parallel shard model is traced (trace.py
  `tp_shard_config`); ZeRO 1/2 on the DP group is `lowlevel_zero_layout`, stage 0 is
  `hybrid_stage0_layout`; TP buffers are added in `tp_extra_bytes`.
- cai_pp: one layout per pipeline stage from the traced step (`pipeline_stage_layout`), its
  optimizer HybridParallel's mixed-precision one (zero_stage 0) or LowLevelZero on the stage's
  parameters (zero_stage 1: `lowlevel_zero_layout`).
- cai_gemini (gemini_plugin.py): chunk layout from gemini.py plus the traced activations.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from launcher.backends.base import LayoutSet
from launcher.backends.colossalai.emit import PARALLEL_OUTPUT, num_microbatches, overlap
from launcher.backends.colossalai.gemini import gemini_bytes, search_chunk_size
from launcher.backends.ddp.layout import DDP_NOTES, bucket_bytes, construction_peak, ddp_layout
from launcher.errors import ConfigError
from launcher.memory.common import (DTYPE_BYTES, Layout, accumulated_gradients, add_modelled_states, full_depth_numels,
                                    grad_ready_order, optimizer_state_numel_factor, optimizer_step_scalar_bytes,
                                    optimizer_step_temp_numel, trainable_params, trainable_shapes)
from launcher.backends.colossalai.rules import PLUGIN
from launcher.backends.colossalai.runtime import uses_shardformer
from launcher.precision import FRAMEWORK, torch_trace_request
from launcher.steptrace import Kind, Role, StepTrace

PLUGIN_DTYPE = {p: FRAMEWORK[p] for p in PLUGIN}  # the plugins' module dtype (launcher/precision.py)
MEGA = 1024**2


@dataclass(frozen=True)
class ZeroSetup:
    """LowLevelZeroOptimizer settings (low_level_optim.py `__init__`)."""

    stage: int  # 1 or 2 (partition_grad)
    model_bytes: int  # working parameter element size (plugin precision)
    dp: int
    bucket_numel: int  # reduce_bucket_size (LowLevelZeroPlugin: reduce_bucket_size_in_m * 2**20)
    overlap: bool  # overlap_communication (reduction hooks even at stage 1)
    optimizer: str
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    no_sync: bool = True  # the worker runs the micro-batches before the last under no_sync (stage 1 of
    #                       LowLevelZeroPlugin); HybridParallel's ZeRO reduces every micro-batch


def padded(numel: int, dp: int) -> int:
    """`_create_master_param_current_rank`: each parameter is padded to a multiple of dp."""
    return numel + (-numel % dp)


def buckets(order: list[tuple[int, int]], bucket_numel: int, dp: int) -> list[tuple[int, list[int]]]:
    """(index in `order` where the bucket is flushed or len(order) at the epilogue, padded numels of
    its parameters): `_add_to_bucket` flushes when `elements + param.numel() > reduce_bucket_size`
    (elements count the padding: bucket_store.py `add_param_grad`)."""
    out, elements, current = [], 0, []
    for k, (_, n) in enumerate(order):
        if current and elements + n > bucket_numel:
            out.append((k, current))
            elements, current = 0, []
        current.append(padded(n, dp))
        elements += padded(n, dp)
    return out + [(len(order), current)] if current else out


def lowlevel_zero_layout(trace: StepTrace, z: ZeroSetup, params: list[int] | None = None,
                         store_from_start: bool = False) -> Layout:
    """Stage 1/2 storages (low_level_optim.py):
    - working parameters: padded copies when numel % dp != 0 (`F.pad`, param.data = a view);
    - fp32 master partitions: `splited_params.detach().clone().float()` (padded numel / dp each);
    - torch AdamW states on the master partitions (steady state) and its step temporaries;
    - gradients: autograd's full gradients until their bucket is reduced (`_run_reduction`:
      `get_flatten_grad` makes one flat copy of the bucket; stage 1 keeps it whole
      (`_update_unpartitoned_grad`, every rank's slice in the gradient store), stage 2
      reduce-scatters into a new 1/dp tensor (`received_grad`) and keeps only that); stage 1
      without overlap reduces after backward in parameter order (`_sync_grad`), otherwise in
      the post-accumulate-grad hooks in ready order. The store is dropped at `zero_grad`.
      A bucket's gradients outlive `param.grad = None` (bookkeeping/bucket_store.py
      `build_grad_in_bucket`): every rank's slices of them, views of the gradient storages (or
      of their `F.pad` copies), stay in `_grad_in_bucket` through the flat copy and the
      collective; `sync_tensor` then points this rank's slices at the reduced tensor and
      `bucket_store.reset()` drops the rest. So while a bucket reduces its gradients, the flat
      copy and (stage 2) `received_grad` are all alive: with the bucket's gradients freed at the
      flush the estimate missed one bucket of gradients at the post-backward reduction, the
      peak of a step with gradient checkpointing (a real CPU run of the tiny Llama: -4% at fp32).
    - step: 16-bit gradients cast to fp32 per partition (`grad.to(master dtype)`; a no-op at fp32),
      `grad.double().norm()` per partition, AdamW, then the updated partitions are cast back and
      all-gathered through `TensorBucket`s (`gather_peak_numel`). `release_param_grad` drops the
      fp32 gradients after the update, but `step`'s loop variable `grad` still holds the last
      parameter's until `step` returns: alive through the all-gather with a 16-bit model.
    `params`: the parameters the optimizer holds (a pipeline stage's, `pipeline_stage_layout`).
    `store_from_start`: an earlier reduction of the same optimizer step filled the gradient store
    (a pipeline's earlier schedule), so stage 1's reduced gradients live from the step's start and
    the reduction adds into them (`_update_unpartitoned_grad`: `add_gradients_by_param_id`)."""
    p, e, dp = trace.params, z.model_bytes, z.dp
    # stage 1 reducing every micro-batch adds each into the store the first one filled
    store_from_start = store_from_start or (z.stage == 1 and z.grad_accum_steps > 1 and not z.no_sync)
    held = None if params is None else set(params)  # a pipeline stage's parameters only
    idx = [i for i in trainable_params(trace) if held is None or i in held]
    numels = [int(p.numel[i]) for i in idx]
    pads = [padded(n, dp) for n in numels]
    parts = [n // dp for n in pads]
    total_part = sum(parts)
    layout = Layout.of(trace, reduce_events=2, step_events=4)
    layout.hoist_persistent(Kind.OPTIM)
    extra_pad = sum(a - b for a, b in zip(pads, numels))
    layout.add("working_param_padding", "parameters", e * extra_pad)
    layout.add("fp32_master_partitions", "optimizer_states", 4 * total_part)
    k = optimizer_state_numel_factor(z.optimizer)
    layout.add("optimizer_states", "optimizer_states",
               4 * k * total_part + optimizer_step_scalar_bytes(z.optimizer, len(parts)))
    r0, r1 = layout.reduce_ev(0), layout.reduce_ev(1)
    s0, s1, s2, s3 = (layout.step_ev(j) for j in range(4))
    end = layout.num_events
    keep = (lambda b: b) if z.stage == 1 else (lambda b: b // dp)
    g = layout.rows(Kind.GRAD)
    hooks = z.stage == 2 or z.overlap
    if hooks:
        order = [(i, int(p.numel[i])) for i, _ in grad_ready_order(trace)]
        events = [ev for _, ev in grad_ready_order(trace)]
        param_row = {int(trace.param[r]): r for r in g.nonzero()[0]}
        for flush_k, sizes in buckets(order, z.bucket_numel, dp):
            at = int(layout.ev(events[flush_k])) if flush_k < len(order) else r0
            start = flush_k - len(sizes)
            for i, _ in order[start:flush_k]:
                if i in param_row:
                    layout.free[param_row[i]] = at + 1
            flat = e * sum(sizes)
            # the bucket's gradients are padded copies where numel % dp != 0 (`build_grad_in_bucket`)
            layout.add("grad_padding", "gradients", flat - e * sum(n for _, n in order[start:flush_k]), at, at + 1)
            if z.stage == 2:  # stage 1 keeps the flat copy itself as the reduced gradients
                layout.add("reduce_flat", "gradients", flat, at, at + 1)
            # stage 2 reduces every micro-batch into the same partitions: alive from the step's start
            accumulated = (z.stage == 2 and z.grad_accum_steps > 1) or store_from_start
            layout.add("reduced_grads", "gradients", keep(flat), 0 if accumulated else at, end)
    else:
        order = [(i, int(p.numel[i])) for i in idx]
        layout.free[g] = r1
        largest = max((e * sum(s) for _, s in buckets(order, z.bucket_numel, dp)), default=0)
        layout.add("reduce_flat", "gradients", largest, r0, r1)
        layout.add("reduced_grads", "gradients", e * sum(pads), 0 if store_from_start else r1, end)
    if z.stage == 1 and z.grad_accum_steps > 1 and z.no_sync:  # the worker's no_sync micro-batches sum in autograd
        accumulated_gradients(layout)
    if e != 4:
        layout.add("fp32_grad_partitions", "gradients", 4 * total_part, s0, s2)
    layout.add("grad_norm_double", "gradients", 8 * max(parts, default=0), s0, s1)
    layout.add("optimizer_step_temporaries", "optimizer_states",
               4 * optimizer_step_temp_numel(z.optimizer, parts), s1, s2)
    if e != 4:
        layout.add("last_fp32_grad_partition", "gradients", 4 * parts[-1] if parts else 0, s2, s3)
    layout.add("allgather_buffers", "parameters", e * gather_peak_numel(parts, dp, z.bucket_numel, e != 4), s2, s3)
    return layout


def gather_peak_numel(parts: list[int], dp: int, bucket_numel: int, cast: bool) -> int:
    """Peak elements of `step`'s all-gather of the updated partitions (low_level_optim.py `step`,
    bookkeeping/tensor_bucket.py), beyond the working parameters it writes into: in parameter
    order each partition (`param_to_gather`: a cast copy of the master partition when the model
    is 16-bit, `cast`; the master itself at fp32) joins a `TensorBucket` of `reduce_bucket_size`
    elements, which `all_gather`s when the next would overflow it (`add_to_bucket` raises) and at
    the end; a partition larger than the bucket is gathered directly into its padded parameter
    (`all_gather_into_flat_tensor_nd`). A bucket's `all_gather` holds its partitions, their flat
    copy, a dp x flat buffer and, rebuilding each parameter (`_flatten_dense_tensors` of its dp
    shards, padded numel), the previous parameter's rebuilt tensor next to the current one: two
    consecutive parameters', not the two largest (none at dp 1: one shard is rebuilt as a view).
    The cast copy of the partition that did not fit
    (or is gathered directly) already exists beside the bucket's."""
    best, bucket = 0, []
    copy = (lambda n: n) if cast else (lambda n: 0)

    def gather(members: list[int]) -> int:
        if not members:
            return 0
        flat = sum(members)
        # rebuilding from one shard (dp 1) is a view: `_flatten_dense_tensors` of a single tensor
        # returns it flattened, without a copy (torch/csrc/utils/tensor_flatten.h)
        pair = 0 if dp == 1 else max((dp * (a + b) for a, b in zip(members, members[1:])), default=dp * members[0])
        return copy(flat) + flat + dp * flat + pair

    for n in parts:
        if n > bucket_numel:
            best = max(best, copy(sum(bucket)) + copy(n))
            continue
        if sum(bucket) + n > bucket_numel:
            best, bucket = max(best, gather(bucket) + copy(n)), []
        bucket.append(n)
    return max(best, gather(bucket))


def hybrid_uses_torch_ddp(dp: int, pp_size: int, zero_stage: int) -> bool:
    """HybridParallelPlugin wraps the shard in torch DDP (hybrid_parallel_plugin.py
    `HybridParallelPlugin.configure`: `use_ddp = (dp_size > 1 and pp_size == 1 and zero_stage == 0)
    or (dp_size == 1 and pp_size == 1)`), so a pure tensor-parallel run (dp 1) has DDP buckets too:
    the reducer rebuilds them in the first forward after the first backward."""
    return pp_size == 1 and (dp == 1 or zero_stage == 0)


def hybrid_stage0_layout(trace: StepTrace, z: ZeroSetup, ddp_bucket_bytes: list[int],
                         params: list[int] | None = None, bucket_views: bool = False) -> Layout:
    """HybridParallelPlugin zero_stage 0 on the traced shard (hybrid_parallel_plugin.py): fp32 ->
    `HybridParallelNaiveOptimizer` stepping the torch optimizer on the shard's own parameters;
    16-bit -> `HybridParallelAMPOptimizer` (amp/naive_amp/mixed_precision_optimizer.py: an fp32
    master copy per parameter, gradients cast to fp32 in `step`); both clip with an fp64 norm of each
    gradient in turn. Where the plugin wraps the shard in
    torch DDP (`hybrid_uses_torch_ddp`) its gradient buckets (`ddp_bucket_bytes`, ddp.py) are added:
    with `bucket_views` (DDP `gradient_as_bucket_view=True`, as emitted) `param.grad` becomes a view
    of its bucket when the gradient is ready (torch/csrc/distributed/c10d/reducer.cpp
    `Reducer::mark_variable_ready_dense`: `bucket_view.copy_(grad); grad = bucket_view`), so
    autograd's gradient is freed there and the buckets are the gradients (as in
    launcher/backends/ddp/layout.py `ddp_layout`); without, the buckets are a second copy.
    `params`: the parameter indices the rank holds (a pipeline stage's, `pipeline_stage_params`);
    default every trainable one."""
    layout = Layout.of(trace, reduce_events=0, step_events=2)
    idx = trainable_params(trace) if params is None else params
    numels = [int(trace.params.numel[i]) for i in idx]
    total = sum(numels)
    for j, nbytes in enumerate(ddp_bucket_bytes):
        layout.add(f"ddp_bucket_{j}", "gradients" if bucket_views else "buffers", nbytes)
    # the torch optimizer steps each parameter (or its fp32 master) itself
    if not add_modelled_states(layout, z.optimizer, trainable_shapes(trace, idx)):
        k = optimizer_state_numel_factor(z.optimizer)
        layout.add("optimizer_states", "optimizer_states",
                   4 * k * total + optimizer_step_scalar_bytes(z.optimizer, len(numels)))
    s0, s1, s2 = layout.step_ev(0), layout.step_ev(1), layout.step_ev(2)
    # 16-bit: MixedPrecisionOptimizer.step (amp/naive_amp/mixed_precision_optimizer.py) sets each
    # master's `p.grad = working_param.grad.data.float()` and drops the working gradient at once,
    # before the norm
    layout.free[layout.rows(Kind.GRAD)] = s2 if z.model_bytes == 4 else s0
    if bucket_views and ddp_bucket_bytes:
        g = layout.rows(Kind.GRAD) & (trace.ready >= 0)
        layout.free[g] = layout.ev(trace.ready[g])
    if z.model_bytes != 4:
        layout.add("fp32_master", "optimizer_states", 4 * total)
        layout.add("fp32_grads", "gradients", 4 * total, s0, s2)
    # the clipping norm before the step (max_norm > 0, the default 1.0): `_compute_grad_norm`
    # (hybrid_parallel_plugin.py, both optimizers) takes `grad.data.double().norm()` one gradient at
    # a time, so the largest gradient's fp64 copy is the transient
    layout.add("grad_norm_double", "gradients", 8 * max(numels, default=0), s0, s1)
    layout.add("optimizer_step_temporaries", "optimizer_states",
               4 * optimizer_step_temp_numel(z.optimizer, numels), s1, s2)
    return layout


def tp_extra_bytes(tokens: int, tp_size: int, model_bytes: int, parallel_output: bool,
                   padded_vocab: int) -> int:
    """Bytes a TP rank holds beyond its traced shard model at the forward peak (independent of
    depth): `VocabParallelEmbedding1D.forward` (shardformer/layer/embedding.py) keeps an input
    mask (bool) and a masked copy of the token ids (int64) of the micro-batch; without
    `parallel_output`, `VocabParallelLMHead1D` all-gathers the logits over the vocabulary
    (`gather_forward_split_backward`: the other ranks' (tp-1)/tp of b x s x V). The row-parallel
    all-reduces (`reduce_forward`) and the column-parallel backward all-reduces run in place on
    tensors the shard model already allocates (Megatron-LM, arXiv:1909.08053 sec. 3: the f and g
    operators)."""
    if tp_size <= 1:
        return 0
    out = tokens * (1 + 8)
    if not parallel_output:
        out += model_bytes * tokens * padded_vocab * (tp_size - 1) // tp_size
    return out


# ----------------------------------------------------------------------------- dispatch

def trace_request(strategy, workload) -> dict:
    """TraceKey fields: cai_ddp runs the model as torch DDP does (launcher/precision.py); the other
    plugins cast the model to their precision themselves (LowLevelZeroModel / GeminiDDP /
    HybridParallelModule: `module.to(dtype)`), run it without autocast, and their optimizer
    memory is modelled here, so no optimizer is traced; cai_tp / cai_pp with tp_size > 1 trace the
    tensor-parallel shard, and both trace the model as transformers 4.51 runs it."""
    if strategy.name == "cai_ddp":
        return torch_trace_request(workload)
    if workload.precision not in PLUGIN_DTYPE:
        raise ConfigError(f"training.precision={workload.precision} is not supported by strategy="
                          f"{strategy.name}; use one of {', '.join(PLUGIN_DTYPE)}")
    out = {"param_dtype": PLUGIN_DTYPE[workload.precision], "autocast_dtype": None, "optimizer": "none"}
    if strategy.tp_size > 1:
        out["tp_size"] = strategy.tp_size
    if uses_shardformer(strategy):  # ColossalAI's forwards run under transformers 4.51 (runtime.py)
        out["transformers4"] = True
    return out


def _zero_setup(strategy, workload, cai, dp: int, device: str) -> ZeroSetup:
    return ZeroSetup(stage=strategy.zero_stage, model_bytes=DTYPE_BYTES[PLUGIN_DTYPE[workload.precision]],
                     dp=dp, bucket_numel=cai.reduce_bucket_size_in_m * MEGA, overlap=overlap(cai, device),
                     optimizer=workload.state_optimizer,
                     # a pipeline accumulates over its micro-batches and schedules (`pipeline_stage_layout`)
                     grad_accum_steps=workload.grad_accum_steps if strategy.pp_size == 1 else 1,
                     no_sync=strategy.tp_size == 1)  # worker.py: no_sync for LowLevelZeroPlugin stage 1 only


def memory(traces, strategy, workload, knobs, dp: int, device: str) -> LayoutSet:
    """The plugin's `LayoutSet`: every rank of the data-parallel group holds the same bytes; a
    pipeline has one group of ranks per stage (`pipeline_memory`)."""
    if strategy.pp_size > 1:
        return pipeline_memory(traces, strategy, workload, knobs["colossalai"], dp, device)
    traces, layouts, notes, extra = colossalai_memory(traces, strategy, workload, knobs["ddp"], knobs["colossalai"],
                                                      dp, device)
    return LayoutSet(groups=(((), tuple(layouts)),), traces=traces, notes=tuple(notes), extra=extra)


def colossalai_memory(traces, strategy, workload, ddp, cai, dp: int, device: str):
    """(traces as extrapolated, per-depth layouts, notes, extra bytes {phase: {category: bytes}})."""
    pair = (traces.depth1, traces.depth2)
    if strategy.name == "cai_ddp":
        return (traces, [ddp_layout(t, ddp, dp, workload.optimizer, True, workload.grad_accum_steps) for t in pair],
                DDP_NOTES, {"setup": construction_peak(traces, with_buffers=False)})  # emit.py: broadcast_buffers=False
    z = _zero_setup(strategy, workload, cai, dp, device)
    if strategy.name == "cai_gemini":
        return (traces, [gemini_activation_layout(t) for t in pair], GEMINI_NOTES,
                gemini_extra(full_depth_numels(traces.depth1, traces.num_layers), z, cai))
    if strategy.zero_stage in (1, 2) and (strategy.name != "cai_tp" or dp > 1):
        layouts = [lowlevel_zero_layout(t, z) for t in pair]
    else:
        wraps_ddp = hybrid_uses_torch_ddp(dp, strategy.pp_size, strategy.zero_stage)
        layouts = [hybrid_stage0_layout(t, z, bucket_bytes(t, ddp.bucket_cap_mb) if wraps_ddp else [],
                                        bucket_views=ddp.gradient_as_bucket_view)
                   for t in pair]
    extra = tp_activation_extra(traces, strategy.tp_size, z.model_bytes)
    notes = (f"ColossalAI {strategy.name}: plugin precision model traced without optimizer"
             + (f" (tensor-parallel shard, tp={strategy.tp_size})" if strategy.tp_size > 1 else "")
             + "; LowLevelZero/Hybrid storages modelled from colossalai/zero/low_level and "
             "booster/plugin (launcher/backends/colossalai/layout.py).",)
    return traces, layouts, notes, extra


def pipeline_stage_layers(num_layers: int, pp_size: int) -> list[int]:
    """Decoder layers per stage: pipeline/stage_manager.py `PipelineStageManager.distribute_layers`
    (num_layers // pp each, the remainder spread from the middle stage down)."""
    q, r = divmod(num_layers, pp_size)
    out = [q] * pp_size
    start = pp_size // 2 - r // 2
    for i in range(start, start + r):
        out[i] += 1
    return out


def pipeline_stage_ranks(stage: int, dp: int, pp_size: int, tp_size: int) -> tuple:
    """Global ranks of one stage: HybridParallelPlugin's default mesh is
    `ProcessGroupMesh(dp_size, pp_size, tp_size, sp_size)` (booster/plugin/hybrid_parallel_plugin.py,
    dp_outside=True), so rank = (dp_i * pp + stage) * tp + tp_i."""
    return tuple((d * pp_size + stage) * tp_size + t for d in range(dp) for t in range(tp_size))


def pipeline_stage_params(trace: StepTrace, stage: int, pp_size: int) -> list[int]:
    """Trainable parameters a stage holds (shardformer/policies/llama.py and bloom.py
    `get_held_layers`): the embedding (and BLOOM's `word_embeddings_layernorm`) on the first stage,
    the decoder layers on every stage (the traced layers stand for the stage's own), the final norm
    and the LM head on the last. A tied LM head is its own copy on the last stage (policies'
    `get_shared_params`): the embedding storage is counted there too."""
    p = trace.params
    first, last = stage == 0, stage == pp_size - 1
    out: list[int] = []
    for i in range(len(p.names)):
        role = int(p.role[i])
        held = (role == Role.EMBEDDING and first) or (role == Role.HEAD and last) or role in (Role.LAYER, Role.OTHER)
        j = int(p.tied_to[i]) if p.tied_to[i] >= 0 else i
        if held and p.trainable[j] and j not in out:
            out.append(j)
    return out


def pipeline_stage_layout(trace: StepTrace, z: ZeroSetup, stage: int, pp_size: int, micro: int,
                          earlier_pass: bool = False) -> Layout:
    """One pipeline stage of HybridParallelPlugin (no DDP wrap: `hybrid_uses_torch_ddp`) under 1F1B
    (pipeline/schedule/one_f_one_b.py `OneForwardOneBackwardSchedule.run_forward_backward`),
    from the traced step (the traced layers stand for the stage's own; depth is extrapolated to the
    largest stage's, `pipeline_memory`):
    - parameters, gradients and optimizer states of the stage's parameters only (`pipeline_stage_params`),
      under the mixed-precision optimizer (zero_stage 0, `hybrid_stage0_layout`) or LowLevelZero
      (zero_stage 1, `lowlevel_zero_layout`: `execute_pipeline` runs the schedule under the
      optimizer's `no_sync`, so gradients sum in autograd, and `sync_dp_grads` reduces them after
      it, in parameter order, whatever overlap_communication says);
    - activations by where the traced step allocated them (`StepTrace.layer_bounds`): the layers' rows
      are every stage's; rows allocated after the last layer in forward or before its backward
      (final norm, LM head, loss) are the last stage's; before the first layer, the rows up to the
      first layer's input hidden state (`layer_bounds['embedding']`: token embedding, BLOOM's
      embedding LayerNorm output) and every row of the embedding's backward are the first stage's,
      while what the model computes after it (rotary cos/sin, ALiBi, the 4D causal mask) is
      recomputed on every stage (shardformer/modeling/llama.py `llama_model_forward` and bloom.py
      `bloom_model_forward` build them on every stage; `get_held_layers` gives every stage
      `rotary_emb`);
    - a non-last stage's output (`output_obj`, the last layer's output hidden state,
      `layer_bounds['output']`) stays referenced until its `backward_step` returns, also where the
      traced final norm frees it in forward (a 16-bit model's RMSNorm keeps only its fp32 upcast); a tied LM head's gradient contribution waiting
      for the embedding's is not the last stage's (its LM head is its own parameter there and
      accumulates directly);
    - p2p buffers (pipeline/p2p.py `_create_recv_buffer`: `torch.empty` of the received shape): a
      non-first stage's received hidden state (`input_obj`, micro-batch x seq x hidden) alive until
      its layers' backward ends, a non-last stage's received output gradient (`recv_backward`) through
      its backward; the previous backward's `input_obj_grad`, referenced until the next backward
      returns, on a non-first stage with m > 1;
    - 1F1B: `num_warmup_microbatches = num_stages - stage - 1` forwards, then one forward per
      backward, so k = min(pp - stage, m) micro-batches' activations are alive at the stage's first
      backward (`input_objs`/`output_objs`): the k - 1 others (each the stage's rows allocated in
      forward and alive at its end) are added over forward and backward. Gradients accumulate over
      the micro-batches (`.grad` kept until `zero_grad`): when m > k a forward runs after a
      backward with every gradient alive, and later backwards start with them; so does every
      forward of the step's last schedule when an earlier one ran in the same optimizer step
      (`earlier_pass`: gradient accumulation over more micro-batches than `num_microbatches`, the
      worker's `_pipeline_micro_step` runs one schedule per `num_microbatches`; under LowLevelZero
      its `sync_dp_grads` moved them into the gradient store instead, alive from the step's start);
    - when m > k, that forward also runs with the previous backward's micro-batch still referenced
      by the steady-state loop's locals until `forward_step` returns (`output_obj` is rebound to its
      result; `output_obj_grad` only by the `send_forward_recv_backward` after it): on a non-last
      stage its output hidden state and received output gradient, and on a non-first stage its
      received hidden state, a leaf that the previous `output_obj`'s autograd graph keeps (its
      AccumulateGrad node holds the leaf after `backward` has freed the saved tensors);
    - the last stage's loss: shardformer/layer/loss.py `dist_cross_entropy` copies the shifted
      logits (`logits[..., :-1, :].contiguous()`) and labels, alive through the loss forward; with a
      16-bit model it runs `CrossEntropyLoss` on them in that dtype, so the traced loss's fp32 rows
      (transformers 4.51 `ForCausalLMLoss` upcasts the logits) become one 16-bit log-softmax;
    - the step's input: the worker (launcher/backends/colossalai/worker.py `_pipeline_micro_step`)
      keeps the m micro-batches' token ids and their concatenation (int64), of which the trace holds
      one micro-batch's."""
    params = pipeline_stage_params(trace, stage, pp_size)
    if z.stage:  # the schedule runs under the optimizer's no_sync; `sync_dp_grads` reduces after it
        layout = lowlevel_zero_layout(trace, replace(z, overlap=False), params, store_from_start=earlier_pass)
    else:
        layout = hybrid_stage0_layout(trace, z, [], params)
    earlier_grads = earlier_pass and not z.stage  # in autograd's .grad (zero_stage 1: in the store)
    t = layout.trace
    held = np.zeros(len(t.params.names), bool)
    held[params] = True
    owner = np.where(t.param >= 0, t.param, 0)
    owner = np.where(t.params.tied_to[owner] >= 0, t.params.tied_to[owner], owner)
    by_param = (t.param >= 0) & np.isin(t.kind, [Kind.PARAM, Kind.GRAD, Kind.OPTIM])
    layout.mask &= ~by_param | held[owner]
    fa, fb = t.phases["forward"]
    ba, bb = t.phases["backward"]
    lf0, lf1 = t.layer_bounds["forward"]
    lb0, lb1 = t.layer_bounds["backward"]
    other = ~by_param
    hidden = int(t.params.shapes[int(np.flatnonzero(t.params.role == Role.EMBEDDING)[0])][-1])
    tokens = t.micro_batch_size * t.seq_len
    boundary = tokens * hidden * z.model_bytes  # one micro-batch's hidden state
    head = ((t.alloc >= lf1) & (t.alloc < fb)) | ((t.alloc >= ba) & (t.alloc < lb0))
    e0, e1 = t.layer_bounds["embedding"]
    embed = (((t.alloc >= e0) & (t.alloc < e1)) | ((t.alloc >= lb1) & (t.alloc < bb)))
    if stage < pp_size - 1:
        layout.mask &= ~(other & head)
        # the stage's output (`output_obj`) stays referenced by the schedule until its
        # `backward_step` returns
        o0, o1 = t.layer_bounds["output"]
        out = other & (t.alloc >= o0) & (t.alloc < o1)
        layout.free[out] = np.maximum(layout.free[out], layout.ev(lb1))
    if stage > 0:
        # and rows made in the LM head's backward that wait for the embedding's (a tied weight's
        # gradient contribution): the last stage's LM head is its own parameter
        pending = (t.alloc >= ba) & (t.alloc < lb0) & (t.free >= lb1)
        layout.mask &= ~(other & (embed | pending))
    layers_end = int(layout.ev(lb1))
    layout.add("pipeline_batch", "buffers", (2 * micro - 1) * tokens * 8)
    if stage > 0:
        layout.add("p2p_recv_hidden_state", "activations", boundary, fa, layers_end)
    if stage < pp_size - 1:
        layout.add("p2p_recv_output_grad", "activations", boundary, ba, layers_end)
    kept = layout.mask & (layout.alloc >= fa) & (layout.alloc < fb) & (layout.free >= fb)
    saved = int(t.nbytes[kept].sum()) + (boundary if stage > 0 else 0)
    k = min(pp_size - stage, micro)
    inflight = (k - 1) * saved
    grads = layout.rows(Kind.GRAD)
    grad_bytes = int(t.nbytes[grads].sum())
    end = layout.reduce_ev(0)
    if micro > k or earlier_grads:
        layout.add("accumulated_gradients", "gradients", grad_bytes, fa, fb)
    if micro > 1 and stage > 0:
        # the previous backward's `input_obj_grad` stays referenced until the next `backward_step`
        # returns: through the next forward and the later backwards
        layout.add("previous_input_grad", "activations", boundary, fa, end)
    if micro > k:
        # a forward after a backward (one_f_one_b.py `run_forward_backward`, steady state): the
        # previous micro-batch's `output_obj` (and `output_obj_grad`) are rebound only after it
        if stage > 0:
            layout.add("previous_recv_hidden_state", "activations", boundary, fa, fb)
        if stage < pp_size - 1:
            layout.add("previous_output", "activations", boundary, fa, fb)
            layout.add("previous_output_grad", "activations", boundary, fa, fb)
    if stage == pp_size - 1:
        # shardformer/layer/loss.py `dist_cross_entropy` (the shardformer's causal-LM forwards):
        # `logits[..., :-1, :].contiguous()` and the shifted labels, alive through the loss forward
        vocab = int(t.params.shapes[int(np.flatnonzero(t.params.role == Role.EMBEDDING)[0])][0])
        shifted = t.micro_batch_size * (t.seq_len - 1)
        layout.add("shifted_logits", "activations", shifted * (vocab * z.model_bytes + 8), int(layout.ev(lf1)), fb)
        if z.model_bytes != 4 and t.itemsize is not None:
            # the traced loss (transformers 4.51 `ForCausalLMLoss`) upcasts the logits and takes an
            # fp32 log-softmax (and its fp32 gradients); `dist_cross_entropy` runs
            # `CrossEntropyLoss` on the 16-bit shifted logits: its log-softmax output is saved
            # until the loss backward
            fp32 = other & head & (t.itemsize == 4) & (t.nbytes % (tokens * vocab * 4) == 0) & (t.nbytes > 0)
            if fp32.any():
                layout.mask &= ~fp32
                layout.add("log_softmax_16bit", "activations", shifted * vocab * z.model_bytes,
                           int(layout.alloc[fp32].min()), int(layout.free[fp32].max()))
    if earlier_grads or (micro > 1 and (micro > k or grad_bytes > inflight)):
        layout.alloc[grads] = np.minimum(layout.alloc[grads], ba)
    if micro > k or inflight >= grad_bytes:
        layout.add("inflight_microbatches", "activations", inflight, fa, end)
    return layout


def tp_activation_extra(traces, tp_size: int, model_bytes: int) -> dict:
    """Per phase, the activation bytes tensor parallelism adds beside the traced shard: the
    parallel-output buffers (`tp_extra_bytes`); {} without tensor parallelism. The column-parallel
    layers' asynchronously all-reduced input gradient adds nothing: after `handle.wait()` NCCL
    keeps no reference to it (launcher/backends/colossalai/cpu.py, module docstring), so it is
    freed with its last autograd use, as the traced shard frees it."""
    if tp_size <= 1:
        return {}
    tokens = traces.depth1.micro_batch_size * traces.depth1.seq_len
    b = tp_extra_bytes(tokens, tp_size, model_bytes, PARALLEL_OUTPUT, 0)
    return {ph: {"activations": b} for ph in ("forward", "backward")}


def pipeline_memory(traces, strategy, workload, cai, dp: int, device: str) -> LayoutSet:
    """cai_pp: one group of ranks per stage (`pipeline_stage_ranks`), each with its own layout
    (`pipeline_stage_layout`), extrapolated to the largest stage's depth."""
    z = _zero_setup(strategy, workload, cai, dp, device)
    pp, m = strategy.pp_size, num_microbatches(cai, strategy.pp_size)
    depth = max(pipeline_stage_layers(traces.num_layers, pp))
    earlier = workload.grad_accum_steps > m  # the worker runs a schedule per m micro-batches
    groups = tuple((pipeline_stage_ranks(s, dp, pp, strategy.tp_size),
                    tuple(pipeline_stage_layout(t, z, s, pp, m, earlier) for t in (traces.depth1, traces.depth2)))
                   for s in range(pp))
    extra = tp_activation_extra(traces, strategy.tp_size, z.model_bytes)
    notes = (f"ColossalAI cai_pp: each of the {pp} stages from the traced step (its parameters, its "
             f"activations, p2p buffers, min(pp - stage, {m}) micro-batches in flight under 1F1B); "
             "launcher/backends/colossalai/layout.py `pipeline_stage_layout`.",)
    return LayoutSet(groups=groups, traces=replace(traces, num_layers=max(1, depth)), notes=notes, extra=extra)


def gemini_activation_layout(trace: StepTrace) -> Layout:
    """The traced 16-bit step without its parameter storages (they live in chunks) and with each
    gradient freed when ready (gemini_ddp.py `grad_handle` copies it into the parameter's chunk
    slot); chunk storages are added at full depth (`gemini_extra`)."""
    layout = Layout.of(trace, reduce_events=0, step_events=1)
    layout.drop(Kind.PARAM)
    g = layout.rows(Kind.GRAD) & (trace.ready >= 0)
    layout.free[g] = layout.ev(trace.ready[g])
    return layout


def gemini_extra(sizes: list[int], z: ZeroSetup, cai) -> dict:
    """Gemini chunk storages at full depth (gemini.py): 16-bit shards (also the gradients), fp32
    master shards and Adam states in every phase; the gathered chunks in forward and backward; in
    the step one chunk shard's gradient cast to fp32 (gemini_optimizer.py `_update_fp16_params` /
    `step`: per chunk `chunk16.cuda_shard.float()`)."""
    search = search_chunk_size(sizes, z.dp, cai.search_range_m, cai.min_chunk_size_m, cai.hidden_dim)
    static = cai.placement_policy == "static"
    gb = gemini_bytes(sizes, z.dp, z.model_bytes, search,
                      cai.shard_param_frac if static else 1.0,
                      cai.offload_optim_frac if static else 0.0,
                      cai.offload_param_frac if static else 0.0,
                      optimizer_state_numel_factor(z.optimizer))
    base = {"parameters": gb.param_shards, "optimizer_states": gb.master_shards + gb.optimizer_states}
    shard = search.chunk_size if search.keep_gathered else search.chunk_size // z.dp
    return {"forward": {**base, "parameters": gb.param_shards + gb.gathered},
            "backward": {**base, "parameters": gb.param_shards + gb.gathered},
            "optimizer": {**base, "gradients": 4 * shard}}


GEMINI_NOTES = (
    "ColossalAI Gemini: chunk size searched as search_chunk_configuration does; 16-bit and fp32 "
    "chunks sharded over the data-parallel ranks, gradients reuse the 16-bit chunks; the two "
    "largest chunks gathered during compute (launcher/backends/colossalai/gemini.py).",
    "placement_policy=auto is estimated as static with shard_param_frac=1 and no offload (auto "
    "moves chunks to host memory only under memory pressure).",
)

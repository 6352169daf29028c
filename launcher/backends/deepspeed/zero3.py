"""DeepSpeed 0.19 ZeRO stage 3 (deepspeed/runtime/zero/stage3.py `DeepSpeedZeroOptimizer_Stage3`,
partition_parameters.py, partitioned_param_coordinator.py) on one rank, optionally offloading the
optimizer and the parameters to host RAM.

Gathered parameters: when the real depth's forward and backward fit in `stage3_max_reuse_distance`
(`gathered_param_bytes` decides it at full depth), every parameter stays gathered from its module's
forward fetch until its own backward and is released there (`gathered_param_terms`: on the
per-depth curve). Otherwise parameters are re-gathered per module and `gathered_param_bytes` is
added at full depth to the forward and backward peaks after extrapolation.

Streams (GPU allocator replay, launcher/memory/allocator.py): with `overlap_comm` (stage 3's
default) the gathered parameters are allocated on the parameter coordinator's all-gather stream
(partitioned_param_coordinator.py `__all_gather_params_`: `all_gather_coalesced` under
`get_accelerator().stream(self.__allgather_stream)`) and each flush's reduce-scatter
concatenation on `reduce_and_partition_stream` (stage3.py `__reduce_and_partition_ipg_grads`);
each stream caches its own blocks.
"""
from __future__ import annotations

import math

from launcher.steptrace import Kind, Role, StepTrace

from launcher.memory.common import (Layout, distinct_params, four_bit_params, free_at_next_ready,  # noqa: F401
                     full_depth_numels, grad_ready_order, optimizer_step_temp_bytes, trainable_params)
from launcher.backends.deepspeed.layout import ZeroSetup, _states, numels


AG_STREAM, RS_STREAM = 1, 2  # the all-gather and reduce_and_partition streams (module docstring)


def partition_numel(numel: int, dp: int) -> int:
    """partition_parameters.py `_partition_param`: each parameter is padded to a multiple of dp
    (`_padding_size`) and split evenly: ceil(numel / dp) elements per rank."""
    return math.ceil(numel / dp)


def zero_numels(trace: StepTrace, four_bit: dict | None = None) -> dict:
    """{parameter index: numel} of the parameters whose partitioned numel is not the traced one: a
    QLoRA base weight stored with bitsandbytes `quant_storage` in the model's 16-bit dtype, as PEFT's
    DeepSpeed guide runs ZeRO-3 QLoRA (bnb_4bit_quant_storage=bfloat16), is a (packed bytes /
    element size, 1) tensor (bitsandbytes functional.py `quantize_4bit`), and ZeRO-3 partitions,
    gathers and releases that tensor like any frozen parameter of its dtype
    (partition_parameters.py `_partition_param` works on `param.ds_numel`). Its quantization state
    stays whole on every rank (`four_bit_params`, or `four_bit` when the caller has it)."""
    p = trace.params
    four_bit = four_bit_params(trace) if four_bit is None else four_bit
    return {i: packed // int(p.element_size[i]) for i, (packed, _) in four_bit.items()}


def forward_only_params(trace: StepTrace, input_grads: bool = False) -> set:
    """Frozen parameters that no backward fetches again: the token/position embeddings (and their
    norms) of a model whose embeddings are all frozen (LoRA's base) compute from integer ids, so
    their outputs need no gradient and their modules run no backward (DeepSpeed hooks a module's
    backward through its outputs, parameter_offload.py `_post_forward_module_hook` /
    `_run_before_backward_function`). An embedding tied to the LM head is used again there, and is
    not one of them. A probe of DeepSpeed 0.19.8 (a peft LoRA tiny Llama, 1 gloo rank, fp32 and
    bf16, steps 1-3 with a complete module trace) logged `__release_param` during forward: the
    embedding is released after its forward in every step.
    None with `input_grads` (gradient checkpointing: transformers makes the embedding's output
    require grad, `enable_input_require_grads`): DeepSpeed then hooks the embedding's backward, and
    its ids need no gradient, so no post-backward hook releases it; it stays gathered until
    backward ends (a real 2-rank ZeRO-3 LoRA run of small-llama with checkpointing held its 16 MB
    bf16 embedding at the backward peak: -10.4% without this).
    Not modelled: the same probe saw layer 0's q_proj base, k_proj and v_proj base (a q, v LoRA)
    released after their forward too, since their inputs need no gradient either: 0.8-0.9% of
    the tiny-llama runs' peak; 100 MB (bf16) on Llama-2-7B.
    """
    p = trace.params
    embeddings = [i for i in distinct_params(trace) if p.role[i] == Role.EMBEDDING]
    if input_grads or "embedding" not in trace.layer_bounds or any(p.trainable[i] for i in embeddings):
        return set()
    tied = {int(j) for j in p.tied_to if j >= 0}
    return {i for i in embeddings if i not in tied}


def sub_groups(part_sizes: list[int], sub_group_size: int) -> list[int]:
    """stage3.py `_create_fp16_sub_groups`: parameters are grouped in order until the group's
    partition numel reaches `sub_group_size`. Returns each group's numel."""
    total = sum(part_sizes)
    if sub_group_size >= total:
        return [total]
    out, acc = [], 0
    for n in part_sizes:
        acc += n
        if acc >= sub_group_size:
            out.append(acc)
            acc = 0
    return out + ([acc] if acc else [])


def flush_events(trace: StepTrace, bucket_numel: int, dp: int) -> list[tuple[int | None, int]]:
    """(traced ready event or None for the epilogue, padded numel) of each bucket reduction:
    `reduce_independent_p_g_buckets_and_remove_grads` flushes when `bucket.elements + ds_numel >
    reduce_bucket_size and bucket.elements > 0`; the epilogue flushes the rest."""
    out, elements, padded = [], 0, 0
    for i, event in grad_ready_order(trace):
        n = int(trace.params.numel[i])
        if elements and elements + n > bucket_numel:
            out.append((event, padded))
            elements, padded = 0, 0
        elements += n
        padded += dp * partition_numel(n, dp)
    return out + [(None, padded)] if padded else out


def zero3_layout(trace: StepTrace, z: ZeroSetup) -> Layout:
    """Per-rank storages of stage 3 on the traced (shallow) model."""
    e, m, dp = z.model_bytes, z.master_bytes, z.dp
    sizes = numels(trace)
    parts = [partition_numel(n, dp) for n in sizes]
    total_part = sum(parts)
    p = trace.params
    four_bit = four_bit_params(trace)
    packed = zero_numels(trace, four_bit)
    numel = lambda i: packed.get(i, int(p.numel[i]))  # noqa: E731
    every = [numel(i) for i in distinct_params(trace)]
    frozen = [numel(i) for i in distinct_params(trace) if not p.trainable[i]]
    persistent = sum(n for n in every if n <= z.ds.stage3_param_persistence_threshold)
    layout = Layout.of(trace, reduce_events=1, step_events=2)
    layout.drop(Kind.PARAM)
    quant_state = sum(q for _, q in four_bit.values())
    if quant_state:  # QLoRA: each 4-bit weight's QuantState, whole on every rank (`zero_numels`)
        layout.add("quant_state", "parameters", quant_state)
    off_opt, off_par = z.offload_optimizer, z.offload_params
    # _create_fp16_partitions_with_defragmentation: one flat buffer of this rank's partitions of
    # the trainable parameters (param offload: `_create_param_groups_fp16_flat_cpu_memory`, host)
    layout.add("16bit_param_partitions", "parameters", e * total_part, host=off_par)
    # frozen parameters (LoRA's base) are partitioned too, each into its own ds_tensor
    # (partition_parameters.py `_partition_param`), outside the optimizer's flat buffer
    if frozen:
        layout.add("frozen_param_partitions", "parameters", e * sum(partition_numel(n, dp) for n in frozen),
                   host=off_par)
    # persistent parameters (numel <= stage3_param_persistence_threshold), frozen or not, stay gathered
    layout.add("persistent_gathered_params", "parameters", e * persistent)
    if all_kept_gathered(trace, z):
        gathered_param_terms(layout, trace, z)
    # _create_fp32_partitions: fp32 master of the partitions, one flat tensor per sub-group
    groups = sub_groups(parts, z.ds.sub_group_size)
    layout.add("fp32_master_partition", "optimizer_states", m * total_part, host=off_opt)
    _states(layout, z, [(n,) for n in groups], host=off_opt)  # one flat tensor per sub-group
    # _setup_for_real_optimizer: the ipg bucket (contiguous_gradients) and the gradient partitions
    # (`grad_partitions_flat_buffer`, on `self.device`: host with optimizer offload)
    if z.ds.contiguous_gradients:
        layout.add("ipg_bucket", "buffers", e * z.ds.reduce_bucket_size)
    layout.add("grad_partitions", "gradients", e * total_part, host=off_opt)
    if off_opt:  # initialize_optimizer_states: one fp32 gradient buffer per sub-group, kept
        layout.add("fp32_grad_partition", "gradients", m * total_part, host=True)
    # gradients: copied into the bucket at their hook (`__add_grad_to_ipg_bucket`), freed
    g = layout.rows(Kind.GRAD)
    big = g & (trace.param >= 0)
    big &= trace.params.numel[trace.param.clip(0)] > z.ds.reduce_bucket_size
    layout.free[g & ~big] = layout.ev(trace.ready)[g & ~big]
    free_at_next_ready(layout, big, layout.reduce_ev(0))
    # each flush: reduce_scatter_coalesced concatenates the padded partitions (torch.cat)
    for event, padded in flush_events(trace, z.ds.reduce_bucket_size, dp):
        at = layout.reduce_ev(0) if event is None else int(layout.ev(event))
        layout.add("reduce_scatter_flat", "buffers", e * padded, at, at + 1, stream=RS_STREAM if z.overlap_comm else 0,
                   cap=e * max(padded, z.ds.reduce_bucket_size))
    s0, s1, s2 = layout.step_ev(0), layout.step_ev(1), layout.step_ev(2)
    largest = max(groups) if groups else 0
    # a deeper model has more sub-groups, each about `sub_group_size` (the terms' `cap`)
    bound = max(largest, z.ds.sub_group_size)
    if off_opt:
        layout.add("optimizer_step_temporaries", "optimizer_states",
                   optimizer_step_temp_bytes(z.optimizer, [largest], m), s0, s2, host=True)
        return layout
    # _prepare_fp32_grad_for_sub_group: flatten(averaged_gradients).to(fp32), one sub-group at a time
    layout.add("flat_grad_sub_group", "gradients", e * largest, s0, s1, cap=e * bound)
    layout.add("fp32_grad_sub_group", "gradients", m * largest, s0, s2, cap=m * bound)
    layout.add("optimizer_step_temporaries", "optimizer_states",
               optimizer_step_temp_bytes(z.optimizer, [largest], m), s1, s2,
               cap=optimizer_step_temp_bytes(z.optimizer, [bound], m))
    return layout


def gathered_param_bytes(sizes: list[int], z: ZeroSetup) -> tuple[int, bool]:
    """Bytes of gathered (non-persistent) parameters alive at the step's peaks (the end of forward
    and the start of backward), in steady state. Returns (bytes, all_kept).

    Reuse: partitioned_param_coordinator.py `__params_to_release` keeps a parameter gathered after
    its module runs if the traced module order reuses it within `stage3_max_reuse_distance`
    elements; a forward parameter is reused by its own backward after the forward and backward of
    every later parameter: 2 x (numel after it). When all are kept, the caller places each copy on
    the per-depth curve (`gathered_param_terms`).

    Prefetch: otherwise `_fetch_sub_module_impl` prefetches, at every module fetch (modules
    without parameters of their own included: decoder layers, attention and MLP blocks,
    activations, dropouts), up to `stage3_prefetch_bucket_size` elements of the parameters next in
    the trace, while the gathered numel (`__n_available_params`, kept ones included) is below
    `stage3_max_live_parameters`. A model has more module fetches than parameters, so the gathered
    set grows until that limit, crossed by the last parameter taken. At the end of forward the
    trace continues with the LM head's backward and the last layers' backward, so the gathered set
    is the parameters in backward order from the LM head until their sum reaches
    `stage3_max_live_parameters` (all of them when it never does), or the kept ones and the
    largest released one when those are more."""
    threshold = z.ds.stage3_param_persistence_threshold
    kept, released_max, after = 0, 0, 0
    for n in reversed(sizes):
        if n > threshold:
            if 2 * after < z.ds.stage3_max_reuse_distance:
                kept += n
            else:
                released_max = max(released_max, n)
        after += n
    if released_max == 0:
        return z.model_bytes * kept, True
    window = 0
    for n in reversed(sizes):
        if window >= z.ds.stage3_max_live_parameters:
            break
        window += n if n > threshold else 0
    return z.model_bytes * max(kept + released_max, window), False


def all_kept_gathered(trace: StepTrace, z: ZeroSetup) -> bool:
    """No parameter of the real-depth model, frozen or trainable, is released between its forward
    and its backward (`gathered_param_bytes` at full depth)."""
    return gathered_param_bytes(full_depth_numels(trace, z.num_layers or trace.num_layers, frozen_too=True,
                                                  numel=gathered_numels(trace, z.input_grads)), z)[1]


def gathered_numels(trace: StepTrace, input_grads: bool = False) -> dict:
    """`zero_numels`, with 0 for the parameters released after their forward and never gathered
    again in the step (`forward_only_params`): none of them is alive at a backward peak."""
    return {**zero_numels(trace), **{i: 0 for i in forward_only_params(trace, input_grads)}}


def fetch_event(trace: StepTrace, role: int) -> int:
    """When a parameter's module is first fetched in forward (partitioned_param_coordinator.py
    `fetch_sub_module` from the module's pre-forward hook, parameter_offload.py
    `_pre_forward_module_hook`): embeddings at the start of forward, decoder-layer parameters where
    the layers start, the final norm and LM head where they end (`StepTrace.layer_bounds`)."""
    start = trace.phases["forward"][0]
    bounds = trace.layer_bounds.get("forward")
    if not bounds or role in (Role.EMBEDDING, Role.OTHER):
        return start
    return int(bounds[0] if role == Role.LAYER else bounds[1])


def first_prefetch_batch(trace: StepTrace, z: ZeroSetup) -> tuple[int, bool]:
    """(elements of the flat buffer of the step's first coalesced all-gather, whether that gather
    holds every non-persistent parameter), at the real depth; (0, False) for a one-parameter batch.

    partitioned_param_coordinator.py `_fetch_sub_module_impl`: with a complete trace, every module
    fetch prefetches parameters from the trace queue (forward order) while the prefetched numel is
    below min(`stage3_prefetch_bucket_size`, `stage3_max_live_parameters`); persistent parameters
    are already available and add nothing. The model's outermost module has no parameters of its
    own, so its fetch at the start of forward prefetches the first batch. partition_parameters.py
    `_all_gather_dtype` gathers a batch of several parameters into one flat tensor of (sum of the
    partition numels) x world size, held by the batch's handle in `__inflight_param_registry`
    until the batch's last parameter is waited for; `AllGatherCoalescedHandle.wait`, at the first
    wait, copies every parameter of the batch out of it (`torch.cat(partitions)`). A one-parameter
    batch goes through `_all_gather_sequential`, whose buffer becomes the parameter itself."""
    sizes = full_depth_numels(trace, z.num_layers or trace.num_layers, frozen_too=True, numel=zero_numels(trace))
    queue = [n for n in sizes if n > z.ds.stage3_param_persistence_threshold]
    limit = min(z.ds.stage3_prefetch_bucket_size, z.ds.stage3_max_live_parameters)
    batch: list[int] = []
    while len(batch) < len(queue) and sum(batch) < limit:
        batch.append(queue[len(batch)])
    if len(batch) < 2:
        return 0, False
    return z.dp * sum(partition_numel(n, z.dp) for n in batch), len(batch) == len(queue)


def gathered_param_terms(layout: Layout, trace: StepTrace, z: ZeroSetup) -> None:
    """Each non-persistent trainable parameter's gathered copy (numel x model bytes,
    partition_parameters.py `_all_gather_sequential` / `all_gather_coalesced`), alive from its
    module's forward fetch (`fetch_event`) until its gradient is ready in backward.

    Release: partitioned_param_coordinator.py `release_sub_module` runs after each module's
    backward (parameter_offload.py `_post_backward_module_hook`) and `__params_to_release` keeps a
    parameter only if it occurs again in the rest of the step's module trace
    (`__submodule_order[step_id:]`) within `stage3_max_reuse_distance`. In backward the rest of the
    trace is the backward of earlier modules, so a parameter is released right after its own last
    backward use: a decoder layer's parameters after that layer's backward, a tied embedding /
    LM-head weight only after the embedding's backward at the very end. Its gradient's
    AccumulateGrad node (autograd runs it before the module's post-backward hook) is the last
    event before the release, so the copy is live through the gradient's ready event (a parameter
    without a traced gradient: until backward ends).

    When the step's first prefetch gathers every parameter in one coalesced all-gather
    (`first_prefetch_batch`, a model smaller than `stage3_prefetch_bucket_size`), every copy is
    made at the start of forward and the flat buffer lives until the LM head's fetch; a first
    batch smaller than the model leaves a flat buffer for one event at the start of forward. The
    flat buffers of later batches are not modelled: with HF's `auto` bucket (0.9 x hidden^2) most
    Linear weights are larger than the bucket and each is gathered alone into the buffer that
    becomes the parameter; smaller ones (grouped-query k/v projections) can share a batch, whose
    flat buffer then lives until the batch's last fetch."""
    t, e = trace, z.model_bytes
    ready = dict(grad_ready_order(t))
    released = module_backward_events(t, ready)
    fallback = layout.reduce_ev(0)
    packed = zero_numels(t)
    forward_only = forward_only_params(t, z.input_grads)
    flat, whole = first_prefetch_batch(t, z)
    start = t.phases["forward"][0]
    stream = AG_STREAM if z.overlap_comm else 0
    if flat:  # the first batch's flat buffer (`first_prefetch_batch`), freed when its last parameter is fetched
        end = fetch_event(t, Role.HEAD) if whole else start
        layout.add("allgather_flat_buffer", "parameters", e * flat, start, end + 1, stream=stream)
    for i in distinct_params(t):
        n = packed.get(i, int(t.params.numel[i]))
        if n <= z.ds.stage3_param_persistence_threshold:
            continue
        end = int(layout.ev(released[i])) + 1 if i in released else fallback
        if i in forward_only:  # released after its module's forward (`forward_only_params`)
            end = int(layout.ev(t.layer_bounds["embedding"][1]))
        fetched = start if whole else fetch_event(t, int(t.params.role[i]))  # whole: copied at the first wait
        layout.add("gathered_params", "parameters", e * n, fetched, end, stream=stream, param=i)


def module_backward_events(trace: StepTrace, ready: dict) -> dict:
    """The traced event after which each parameter's module has run its backward: a trainable
    parameter's gradient ready event; a frozen one (LoRA's base weight, which has no gradient) takes
    the latest gradient ready in its own module (its adapters: `...q_proj.base_layer.weight` and
    `...q_proj.lora_A...`), else in its decoder layer; frozen parameters outside the layers are
    released when backward ends (no entry)."""
    p = trace.params
    module = lambda name: name.rsplit(".", 1)[0].removesuffix(".base_layer")  # noqa: E731
    by_module: dict = {}
    by_layer: dict = {}
    for i, event in ready.items():
        by_module.setdefault(module(p.names[i]).split(".lora_")[0], []).append(event)
        by_layer.setdefault(int(p.layer[i]), []).append(event)
    out = dict(ready)
    for i in distinct_params(trace):
        if i in out:
            continue
        events = by_module.get(module(p.names[i])) or (by_layer.get(int(p.layer[i])) if p.layer[i] >= 0 else None)
        if events:
            out[i] = max(events)
    return out

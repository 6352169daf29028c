"""torch DistributedDataParallel on one rank (torch 2.13, torch/nn/parallel/distributed.py and the
C++ Reducer, torch/csrc/distributed/c10d/reducer.cpp).

The model and the torch optimizer run exactly as traced. DDP changes two things:
- it allocates one flat gradient bucket per bucket at construction (`Reducer::initialize_buckets`:
  `bucket.gradients = at::empty({offset}, options)`, sized to its parameters, not to the cap) and
  keeps them for the whole run; after the first iteration the buckets are rebuilt in gradient-ready
  order with `[dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB), bucket_cap_mb]` limits
  (`_BucketCapacityConfig.compute_bucket_size_limits`, `Reducer::rebuild_buckets`), which changes
  how many buckets there are but not their total bytes;
- with `gradient_as_bucket_view=True`, `param.grad` is a view of the bucket
  (`Reducer::mark_variable_ready_dense`: `bucket_view.copy_(grad); grad = bucket_view`), so the
  gradient autograd produced is freed when it is ready and the gradient storage is the buckets;
  with False, each gradient is copied into its bucket and the reduced bucket copied back
  (`finalize_bucket_dense`), so the buckets are a second copy of the gradients.

Before the step, the constructor broadcasts the module's state from rank 0 (`_sync_module_states`
-> `dist._broadcast_coalesced`), which copies it into flat buckets: `construction_peak`.
"""
from __future__ import annotations

from launcher.backends.base import LayoutSet
from launcher.backends.ddp.emit import buffer_sync_kwarg
from launcher.config import DDPConfig
from launcher.memory.common import (Layout, accumulated_gradients, add_modelled_states, four_bit_params,
                                    full_depth_order, grad_ready_order, trainable_params, trainable_shapes)
from launcher.precision import TRACE_OPTIMIZER, torch_trace_request
from launcher.steptrace import Kind, StepTrace

FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DistributedDataParallel.__init__: self.broadcast_bucket_size
BROADCASTS_IN_FLIGHT = 2  # torch/csrc/distributed/c10d/comm.cpp broadcast_coalesced: max_in_flight


def bucket_bytes(trace: StepTrace, bucket_cap_mb: float) -> list[int]:
    """Bytes of each rebuilt bucket: parameters in gradient-ready order, a bucket is closed once it
    reaches its limit (`compute_bucket_assignment_by_size` in reducer.cpp: `if (bucket.size >=
    bucket_size_limit)`), the first limit 1 MiB, then `bucket_cap_mb` MiB."""
    p = trace.params
    ready = [i for i, _ in grad_ready_order(trace)]
    order = ready + [i for i in reversed(trainable_params(trace)) if i not in set(ready)]
    limits = [FIRST_BUCKET_BYTES, int(bucket_cap_mb * 1024 * 1024)]
    out, size = [], 0
    for i in order:
        size += int(p.numel[i] * p.element_size[i])
        if size >= limits[min(len(out), 1)]:
            out.append(size)
            size = 0
    if size:
        out.append(size)
    return out


def ddp_layout(trace: StepTrace, ddp: DDPConfig, dp_size: int, optimizer: str = "",
               wrapped: bool = True, grad_accum_steps: int = 1, set_to_none: bool = True) -> Layout:
    """The traced step as DDP runs it on every rank (all ranks are identical); `wrapped=False`:
    the step exactly as traced, one process and no DDP (strategy `single`: no buckets, autograd's
    gradients are the gradients, as HF Trainer and torchtune run on one GPU). bitsandbytes 8-bit
    optimizers are not traced (their kernels cannot run on fake tensors): their states
    (`modelled_state_bytes`, one per trainable parameter) live for the whole step and their
    in-place update adds no temporary (common.py `optimizer_step_temp_numel`).

    `set_to_none=False` (`zero_grad(set_to_none=False)`): each gradient is kept for the whole step
    (common.py `accumulated_gradients(kept=True)`), unless it is a bucket view: with
    gradient_as_bucket_view the zeroed view stays `param.grad` and autograd adds into it in place
    (`no_sync` micro-batches too), so the buckets hold every gradient and nothing is added."""
    p = trace.params
    untraced = TRACE_OPTIMIZER.get(optimizer) == "none"  # the tracer did not step it (bitsandbytes')
    layout = Layout.of(trace, step_events=1 if untraced else 0)
    layout.hoist_persistent(Kind.OPTIM)
    if untraced:
        add_modelled_states(layout, optimizer, trainable_shapes(trace))
    if wrapped:
        buckets = bucket_bytes(trace, ddp.bucket_cap_mb)
        if ddp.gradient_as_bucket_view:
            g = (trace.kind == Kind.GRAD) & (trace.ready >= 0)
            layout.free[g] = layout.ev(trace.ready[g])
            for j, nbytes in enumerate(buckets):
                layout.add(f"ddp_bucket_{j}", "gradients", nbytes)
        else:
            for j, nbytes in enumerate(buckets):
                layout.add(f"ddp_bucket_{j}", "buffers", nbytes)
    if not set_to_none and not (wrapped and ddp.gradient_as_bucket_view):
        accumulated_gradients(layout, kept=True)
    elif grad_accum_steps > 1 and set_to_none:  # the worker runs the micro-batches before the last under no_sync
        accumulated_gradients(layout)
    return layout


SINGLE_NOTES = (
    "single process, no data-parallel wrapper: model, autocast and optimizer traced for real, "
    "gradients as autograd allocates them (no buckets).",
)

DDP_NOTES = (
    "torch DDP: model, autocast and optimizer traced for real; gradient buckets sized to their "
    "parameters, allocated at construction (torch/csrc/distributed/c10d/reducer.cpp).",
    "DDP gradient_as_bucket_view=True: gradients are bucket views, autograd's gradient freed at "
    "ready; False: buckets are a second copy of the gradients.",
    "Not modelled: gradient clipping's per-parameter norm scalars, gloo/NCCL internal scratch "
    "outside tensors.",
    "DDP construction: the state broadcast from rank 0 copies the parameters into flat buckets of up "
    "to 250 MiB, two in flight (torch/csrc/distributed/c10d/comm.cpp broadcast_coalesced): the setup "
    "phase, before gradient buckets and optimizer states exist.",
)


IN_BACKWARD_NOTES = (
    "training.optimizer_in_backward: one optimizer per parameter, stepped in its post-accumulate-grad "
    "hook and its gradient freed there (traced for real); the optimizer states still live for the whole step.",
)


KEPT_GRADIENT_NOTES = (
    "training.zero_grad_set_to_none=false: zero_grad zeroes the gradients in place (torch 1.x's "
    "default), so they stay allocated through the next step's forward; autograd adds each new "
    "gradient into the kept one and frees it (bucket views under gradient_as_bucket_view=true are "
    "the kept gradients).",
)


def trace_request(strategy, workload) -> dict:
    """torch DDP runs the model as the user asked and its torch optimizer is traced for real
    (launcher/precision.py)."""
    return torch_trace_request(workload)


def module_state_tensors(traces, with_buffers: bool) -> tuple[list[tuple[object, int]], int]:
    """((bucket key, bytes) of each tensor `_sync_module_states` broadcasts, the bytes of the 4-bit
    weights' quantization states) for the full-depth model: its parameters in `named_parameters()`
    order (common.py `full_depth_order`: a tied parameter once, frozen ones too, DDP ignores none;
    a 4-bit base weight as its packed uint8 storage, `four_bit_params`, whose `QuantState` is an
    attribute, not broadcast), then (`with_buffers`) the module's buffers (the rows of kind BUFFER
    alive when the forward starts, extrapolated in depth, as one tensor). The key stands for the
    tensor's dtype (`BucketKey` groups by scalar type and device): its element size, or
    "buffers"."""
    t = traces.depth2
    p, packed = t.params, four_bit_params(t)
    out, quant_state = [], 0
    for i in full_depth_order(t, traces.num_layers, frozen_too=True):
        if i in packed:
            out.append((1, packed[i][0]))
            quant_state += packed[i][1]
        else:
            out.append((int(p.element_size[i]), int(p.numel[i] * p.element_size[i])))
    if with_buffers:
        def buffers(tr):
            start = tr.phases["forward"][0]
            keep = (tr.kind == Kind.BUFFER) & (tr.alloc < start) & (tr.free >= start)
            return int(tr.nbytes[keep].sum())
        nbytes = int(round(traces.at_depth(buffers)))
        if nbytes:
            out.append(("buffers", nbytes))
    return out, quant_state


def broadcast_buckets(tensors: list[tuple[object, int]], limit: int = BROADCAST_BUCKET_BYTES) -> list[tuple[int, int]]:
    """(tensors, bytes) of each bucket `broadcast_coalesced` broadcasts, in its order:
    `compute_bucket_assignment_by_size(tensors, {limit})` (reducer.cpp) fills one bucket per key
    and closes it once it reaches the limit (`bucket.size >= bucket_size_limit`), appends the
    unfinished ones, and sorts them by their first tensor's index."""
    done, open_ = [], {}
    for i, (key, nbytes) in enumerate(tensors):
        first, count, size = open_.get(key, (i, 0, 0))
        count, size = count + 1, size + nbytes
        if size >= limit:
            done.append((first, count, size))
            open_.pop(key, None)
        else:
            open_[key] = (first, count, size)
    return [(count, size) for _, count, size in sorted(done + list(open_.values()))]


def broadcast_peak_bytes(buckets: list[tuple[int, int]]) -> int:
    """The most bytes of flat buckets alive at once: `broadcast_coalesced` flattens each bucket
    (`BroadcastWork`: `flatten_dense_tensors`, a copy, except for a bucket of one tensor, which is
    a view of it: torch/csrc/utils/tensor_flatten.h) and keeps at most `BROADCASTS_IN_FLIGHT` in
    flight, finishing (unflattening into the tensors and dropping) the oldest before it flattens
    the next."""
    k, flat = BROADCASTS_IN_FLIGHT, [size if count > 1 else 0 for count, size in buckets]
    return max((sum(flat[max(0, j - k + 1):j + 1]) for j in range(len(flat))), default=0)


def construction_peak(traces, with_buffers: bool) -> dict:
    """{category: bytes} live at the peak of the constructor's state broadcast, on every rank (the
    ranks other than 0 flatten into buckets of the same sizes to receive): the model's
    parameters (and buffers) plus the flat buckets in flight (`broadcast_peak_bytes`). The
    reducer's gradient buckets and the optimizer are created after it. On GPUs each flat bucket
    is its own allocation (up to 250 MiB, two in flight); a small adapter step (LoRA at short
    sequences) can peak here rather than in the step."""
    tensors, quant_state = module_state_tensors(traces, with_buffers)
    state = {"parameters": sum(b for k, b in tensors if k != "buffers") + quant_state,
             "buffers": sum(b for k, b in tensors if k == "buffers")}
    state["buffers"] += broadcast_peak_bytes(broadcast_buckets(tensors))
    return state


def memory(traces, strategy, workload, knobs, dp: int, device: str) -> LayoutSet:
    """One layout per traced depth; every rank holds the same bytes. Wrapped in DDP, the
    constructor's state broadcast is the `setup` phase (`construction_peak`; buffers are synced
    too under `forward_sync_buffers`, emit.py)."""
    wrapped = strategy.name != "single"
    layouts = tuple(ddp_layout(t, knobs["ddp"], dp, workload.optimizer, wrapped, workload.grad_accum_steps,
                               workload.zero_grad_set_to_none)
                    for t in (traces.depth1, traces.depth2))
    notes = DDP_NOTES if wrapped else SINGLE_NOTES
    if workload.optimizer_in_backward:
        notes += IN_BACKWARD_NOTES
    if not workload.zero_grad_set_to_none:
        notes += KEPT_GRADIENT_NOTES
    extra = {"setup": construction_peak(traces, buffer_sync_kwarg() == "forward_sync_buffers")} if wrapped else {}
    return LayoutSet(groups=(((), layouts),), traces=traces, notes=notes, extra=extra)

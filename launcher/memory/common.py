"""What every strategy model shares: a `Layout` (how a framework changes the traced rows and which
buffers it adds), the live-bytes curve it implies, per-phase maxima and their extrapolation.

A layout is built for one traced depth (the two depths of a `TraceSet`): the strategy is applied to
that shallow model exactly as the framework would apply it. Each phase is cut at the trace's
decoder-layer boundaries (`StepTrace.layer_bounds`, mapped onto the layout's timeline), each
segment's maximum is extrapolated linearly to the real depth (`launcher.steptrace.extrapolate`), and
the phase's peak is the largest of them: the maximum can move from one segment to another as depth
grows (e.g. from the LM-head backward into the last layer's backward), which extrapolating the
whole-phase maximum misses (`StepTrace.phase_segments`, `TraceSet.phase_max`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from launcher.steptrace import Kind, StepTrace, extrapolate
from launcher import quant

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "buffers")
KIND_CATEGORY = {Kind.PARAM: "parameters", Kind.GRAD: "gradients", Kind.OPTIM: "optimizer_states",
                 Kind.ACT: "activations", Kind.BUFFER: "buffers"}
PHASES = ("forward", "backward", "optimizer")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Term:
    """One storage the framework allocates that the trace does not hold: live on the curve at
    indices [start, end) (same convention as `StepTrace.live_curve`)."""
    name: str
    category: str
    nbytes: int
    start: int
    end: int
    host: bool = False  # lives in host RAM when the device is a GPU (offload)
    stream: int = 0  # the CUDA stream it is allocated on (0 = the default stream; allocator.py pools)
    cap: int = 0  # a bucketed reduction's largest size (bytes) at any depth; 0: no bound (replay.py)
    param: int = -1  # the parameter it holds a copy of (ZeRO-3's gathered parameters), else -1


@dataclass(frozen=True)
class InitUnit:
    """One unit of a wrapped model as its framework initializes it on the device (`Init`)."""
    layer: int  # its decoder layer, -1 the root
    params: tuple  # bytes of each of its parameters' own device storages, before sharding
    shards: tuple  # bytes of each storage this rank keeps from them: the step's parameters
    flat: int = 0  # bytes of the flat parameter they are concatenated into first (FSDP1); 0: none


@dataclass(frozen=True)
class Init:
    """How a framework puts the model's parameters on the device before the first step, for the
    allocator replay (replay.py `init_events`): per unit in wrap order, its parameters' device
    copies (unless the whole model was built on the device before, `built_on_device`), then
    either the flat parameter concatenated from them, the parameters freed, this rank's shard
    cloned and the flat parameter freed (FSDP1), or each parameter's shard, then the parameters
    freed (FSDP2). The shards are the layout's persistent term `kept`."""
    units: tuple  # InitUnit, in wrap order
    built_on_device: bool
    kept: str


@dataclass
class Layout:
    """The traced rows as the framework runs them, plus the framework's own storages.

    `reduce_events` and `step_events` are virtual events inserted where the traced backward ends:
    first the framework's gradient reduction after backward (part of the backward phase), then its
    optimizer step (the optimizer phase), for frameworks whose step is modelled, not traced. Every
    traced event at or after that point moves later by their sum; `ev()` maps a traced event."""
    trace: StepTrace
    mask: np.ndarray  # rows kept
    alloc: np.ndarray  # allocation events (on the layout's timeline)
    free: np.ndarray  # free events (on the layout's timeline)
    reduce_events: int = 0
    step_events: int = 0
    terms: list = field(default_factory=list)
    # the framework's initialization on the device before the step (`Init`, replayed through the
    # allocator first); None: the step's replay starts from an empty cache
    init = None

    @classmethod
    def of(cls, trace: StepTrace, reduce_events: int = 0, step_events: int = 0) -> "Layout":
        layout = cls(trace, np.ones(len(trace.nbytes), bool), trace.alloc.copy(), trace.free.copy(),
                     reduce_events, step_events)
        layout.alloc, layout.free = layout.ev(trace.alloc), layout.ev(trace.free)
        return layout

    @property
    def backward_end(self) -> int:
        """The traced event where backward ends (before any virtual event)."""
        return self.trace.phases["backward"][1]

    @property
    def num_events(self) -> int:
        return self.trace.num_events + self.reduce_events + self.step_events

    def ev(self, event):
        """Traced event(s) -> index on this layout's timeline."""
        shift = self.reduce_events + self.step_events
        return np.where(np.asarray(event) >= self.backward_end, np.asarray(event) + shift, event)

    def reduce_ev(self, k: int) -> int:
        return self.backward_end + k

    def step_ev(self, k: int) -> int:
        return self.backward_end + self.reduce_events + k

    def segments(self, phase: str) -> list[tuple[int, int]]:
        """`phase` on this layout's timeline cut at the traced decoder-layer boundaries (before the
        layers, the layers, after them), as `StepTrace.phase_segments` does on the trace's."""
        a, b = self.phases[phase]
        cuts = sorted(int(self.ev(c)) for c in self.trace.layer_bounds.get(phase, ()))
        edges = [a, *(c for c in cuts if a < c < b), b]
        return [(x, y) for x, y in zip(edges, edges[1:]) if y > x]

    @property
    def phases(self) -> dict:
        t, b = self.trace.phases, self.backward_end
        k = self.reduce_events + self.step_events
        return {"forward": t["forward"], "backward": (t["backward"][0], b + self.reduce_events),
                "optimizer": (b + self.reduce_events, t["optimizer"][1] + k)}

    def add(self, name: str, category: str, nbytes: int, start: int = 0, end: int | None = None,
            host: bool = False, stream: int = 0, cap: int = 0, param: int = -1) -> None:
        end = self.num_events if end is None else end
        if nbytes > 0 and end > start:
            self.terms.append(Term(name, category, int(nbytes), int(start), int(end), host, stream, int(cap),
                                   int(param)))

    def drop(self, kind: Kind) -> None:
        """Remove the traced rows of one kind (the framework replaces those storages)."""
        self.mask &= self.trace.kind != kind

    def drop_trainable_params(self) -> None:
        """Remove the traced storages of trainable parameters (the framework moves them into its
        own flat buffers); frozen parameters (LoRA's base) stay as the module holds them."""
        t = self.trace
        trainable = (t.param >= 0) & t.params.trainable[t.param.clip(0)]
        self.mask &= ~((t.kind == Kind.PARAM) & trainable)

    def rows(self, kind: Kind) -> np.ndarray:
        return self.mask & (self.trace.kind == kind)

    def hoist_persistent(self, kind: Kind) -> None:
        """Rows of `kind` still alive at the end of the step exist from the second step on during
        the whole step (optimizer states are created lazily in the first step)."""
        alive = (self.trace.kind == kind) & (self.free >= self.num_events)
        self.alloc[alive] = 0


def _round(nbytes: np.ndarray, rounding: int) -> np.ndarray:
    return -(-nbytes // rounding) * rounding if rounding > 1 else nbytes


def category_curves(layout: Layout, rounding: int = 1, with_host: bool = False) -> dict:
    """Live bytes after each event, per breakdown category."""
    t = layout.trace
    n = layout.num_events
    nb = _round(t.nbytes, rounding)
    out = {}
    for cat in CATEGORIES:
        delta = np.zeros(n + 1, np.int64)
        sel = layout.mask & np.isin(t.kind, [k for k, c in KIND_CATEGORY.items() if c == cat])
        np.add.at(delta, layout.alloc[sel], nb[sel])
        np.add.at(delta, layout.free[sel], -nb[sel])
        for term in layout.terms:
            if term.category == cat and (with_host or not term.host):
                size = int(_round(np.array([term.nbytes]), rounding)[0])
                delta[term.start] += size
                delta[term.end] -= size
        out[cat] = np.cumsum(delta)[:n]
    return out


def host_bytes(layout: Layout) -> int:
    """Peak host RAM of the offloaded terms (all are persistent for the step)."""
    return sum(t.nbytes for t in layout.terms if t.host)


@dataclass(frozen=True)
class PhasePeaks:
    """Per phase: the peak total and the breakdown at that peak; `segments` holds the same per
    segment of the phase (`Layout.segments`), as [(total, breakdown)]."""
    total: dict  # phase -> bytes
    breakdown: dict  # phase -> {category: bytes}
    segments: dict = field(default_factory=dict)  # phase -> [(bytes, {category: bytes})]


def _segment_peak(curves: dict, total_curve: np.ndarray, a: int, b: int) -> tuple[int, dict]:
    i = a + int(np.argmax(total_curve[a:b]))
    return int(total_curve[i]), {c: int(curves[c][i]) for c in CATEGORIES}


def phase_peaks(layout: Layout, rounding: int = 1, with_host: bool = False) -> PhasePeaks:
    curves = category_curves(layout, rounding, with_host)
    total_curve = sum(curves.values())
    total, breakdown, segments = {}, {}, {}
    for ph in PHASES:
        segments[ph] = [_segment_peak(curves, total_curve, a, b) for a, b in layout.segments(ph)]
        best = max(segments[ph], key=lambda s: s[0], default=(0, {c: 0 for c in CATEGORIES}))
        total[ph], breakdown[ph] = best
    return PhasePeaks(total, breakdown, segments)


def extrapolate_layouts(layouts: list, values: list, num_layers: int) -> int:
    """A value computed on the two traced depths' layouts, extrapolated to `num_layers`."""
    d1, d2 = layouts[0].trace.num_layers, layouts[1].trace.num_layers
    return int(round(extrapolate(values[0], values[1], num_layers, d1, d2)))


def extrapolate_peaks(layouts: list, peaks: list, num_layers: int) -> PhasePeaks:
    """Each phase's peak at `num_layers`: every segment's maximum and its breakdown extrapolated
    linearly in depth, the largest segment taken (`TraceSet.phase_max`). If the two depths cut a
    phase into different numbers of segments (layer boundaries not recorded), the whole-phase
    maxima are extrapolated."""
    total, breakdown = {}, {}
    for ph in PHASES:
        s1, s2 = peaks[0].segments.get(ph, []), peaks[1].segments.get(ph, [])
        if len(s1) != len(s2):
            s1 = [(peaks[0].total[ph], peaks[0].breakdown[ph])]
            s2 = [(peaks[1].total[ph], peaks[1].breakdown[ph])]
        candidates = [(extrapolate_layouts(layouts, [t1, t2], num_layers),
                       {c: extrapolate_layouts(layouts, [b1[c], b2[c]], num_layers) for c in CATEGORIES})
                      for (t1, b1), (t2, b2) in zip(s1, s2)]
        total[ph], breakdown[ph] = max(candidates, key=lambda s: s[0],
                                       default=(0, {c: 0 for c in CATEGORIES}))
    return PhasePeaks(total, breakdown)


def trainable_params(trace: StepTrace) -> list[int]:
    """Indices of the distinct trainable parameters in `named_parameters()` order (tied copies
    dropped: `module.parameters()` yields a shared parameter once)."""
    return [i for i in distinct_params(trace) if trace.params.trainable[i]]


def trainable_shapes(trace: StepTrace, params: list[int] | None = None) -> list[tuple]:
    """The shapes of `params` (default `trainable_params`; their numels as 1-D shapes when the trace
    kept none): what an optimizer stepping the parameters themselves sees (Adafactor factors the
    2-D ones)."""
    p = trace.params
    idx = trainable_params(trace) if params is None else params
    return [tuple(p.shapes[i]) if p.shapes else (int(p.numel[i]),) for i in idx]


def distinct_params(trace: StepTrace) -> list[int]:
    """Indices of every distinct parameter, trainable or frozen (tied copies dropped)."""
    return [i for i in range(len(trace.params.names)) if trace.params.tied_to[i] < 0]


def four_bit_params(trace: StepTrace) -> dict:
    """{parameter index: (packed weight bytes, quantization-state bytes)} of the 4-bit base weights
    of a QLoRA trace: the tracer replaced each one's storage bytes by its bitsandbytes layout
    (trace.py `_four_bit_rows`, launcher/quant.py), fewer than its elements in the compute dtype.
    The packed weight is two 4-bit codes per byte (`four_bit_weight_bytes` packed_weight_bytes);
    the rest (absmax, double-quantization constants, code tables) is the weight's `QuantState`,
    which bitsandbytes keeps as attributes of the parameter and its module, outside the shards or
    partitions that FSDP2 and ZeRO-3 make of the packed weight."""
    p, out = trace.params, {}
    rows = np.nonzero(trace.kind == Kind.PARAM)[0]
    for row in rows:
        i = int(trace.param[row])
        if i < 0 or p.trainable[i]:
            continue
        stored, full = int(trace.nbytes[row]), int(p.numel[i]) * int(p.element_size[i])
        if stored < full:
            packed = (int(p.numel[i]) + 1) // 2
            out[i] = (packed, stored - packed)
    return out


def full_depth_order(trace: StepTrace, num_layers: int, frozen_too: bool = False) -> list[int]:
    """The trainable (`frozen_too`: all) parameters of the real-depth model in forward
    (`named_parameters()`) order, as indices into the shallow trace's parameters: those before its
    first layer, its layer-0 parameters repeated `num_layers` times, then the rest."""
    p = trace.params
    idx = [i for i in distinct_params(trace) if frozen_too or p.trainable[i]]
    in_layer = [k for k, i in enumerate(idx) if p.layer[i] >= 0]
    first, last = (in_layer[0], in_layer[-1]) if in_layer else (len(idx), len(idx) - 1)
    layer0 = [i for i in idx if p.layer[i] == 0]
    return idx[:first] + layer0 * num_layers + idx[last + 1:]


def full_depth_numels(trace: StepTrace, num_layers: int, frozen_too: bool = False,
                      numel: dict | None = None) -> list[int]:
    """The numels of `full_depth_order`'s parameters. `numel`: {parameter index: numel} where a
    framework sees another numel than the traced one (ZeRO-3's packed 4-bit weights)."""
    numel, p = numel or {}, trace.params
    return [int(numel.get(i, p.numel[i])) for i in full_depth_order(trace, num_layers, frozen_too)]


def layer_numel(trace: StepTrace) -> int:
    """Trainable elements of one decoder layer (layer 0 of the traced model)."""
    p = trace.params
    return int(p.numel[(p.layer == 0) & p.trainable & (p.tied_to < 0)].sum())


def at_traced_depth(full_value: int, per_layer: float, trace: StepTrace, num_layers: int) -> int:
    """A quantity known at the real depth `num_layers` that is only roughly linear in depth (it
    grows by about `per_layer` per layer), written at the traced depth as `full_value -
    (num_layers - depth) x per_layer`: extrapolating the two traced depths returns `full_value`."""
    return int(round(full_value - (num_layers - trace.num_layers) * per_layer))


def grad_ready_order(trace: StepTrace) -> list[int]:
    """Parameter indices in the order their gradients became ready in the traced backward, each
    with its ready event: [(param, event)]. Parameters without a traced gradient come last."""
    g = (trace.kind == Kind.GRAD) & (trace.param >= 0)
    pairs = sorted(zip(trace.ready[g].tolist(), trace.param[g].tolist()))
    return [(int(p), int(e)) for e, p in pairs]


def accumulated_gradients(layout: Layout, kept: bool = False) -> None:
    """Gradient accumulation, where the framework leaves it to autograd: the step laid out is the
    last micro-batch's. Each parameter's gradient summed over the micro-batches before it is alive
    from the step's start; this micro-batch's gradient is added into it in place and dropped
    (torch/csrc/autograd/functions/accumulate_grad.h `accumulateGrad`: `variable_grad += new_grad`
    once a gradient exists), so the traced gradient becomes a temporary freed when the parameter's
    gradient is ready, and the accumulated one lives until the traced one would have been freed (a
    DDP bucket view's copy at ready, else the optimizer's zero_grad). Under DDP's `no_sync` the
    micro-batches before the last leave their gradients outside the buckets (reducer.cpp copies a
    gradient into its bucket view only in a synchronized backward).

    `kept`: the gradients were zeroed in place rather than dropped at the last step's end
    (`zero_grad(set_to_none=False)`, training.zero_grad_set_to_none), so each one exists for the
    whole step, the same in-place addition frees the traced one at ready, and the next `zero_grad`
    keeps it (torch/optim/optimizer.py `zero_grad`: `p.grad.zero_()`, or `torch._foreach_zero_`)."""
    t = layout.trace
    rows = np.nonzero(layout.rows(Kind.GRAD) & (t.ready >= 0))[0]
    ready = layout.ev(t.ready[rows])
    for row, at in zip(rows.tolist(), ready.tolist()):
        layout.add("kept_gradient" if kept else "accumulated_gradient", "gradients", int(t.nbytes[row]), 0,
                   None if kept else int(layout.free[row]), param=int(t.param[row]))
        layout.free[row] = min(int(layout.free[row]), at)


def free_at_next_ready(layout: Layout, rows, fallback: int) -> None:
    """Free each of `rows` (GRAD rows) at the ready event of the gradient that follows it in
    ready order, or at `fallback` for the last: how ZeRO treats a gradient larger than its reduce
    bucket (kept as is, reduced when the next gradient's hook flushes the bucket)."""
    t = layout.trace
    order = [e for _, e in grad_ready_order(t)]
    for r in np.asarray(rows).nonzero()[0]:
        later = [e for e in order if e > t.ready[r]]
        layout.free[r] = int(layout.ev(later[0])) if later else fallback


def first_ready_event(trace: StepTrace) -> int:
    order = grad_ready_order(trace)
    return order[0][1] if order else trace.phases["backward"][1]


def optimizer_step_temp_numel(optimizer: str, tensor_numels: list[int]) -> int:
    """Elements of the temporaries torch.optim.AdamW allocates during `step()` over the given
    parameter tensors (torch/optim/adam.py):
    - `_multi_tensor_adam` (foreach): `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)` is one
      temporary per parameter, all alive together: sum of the numels;
    - `_single_tensor_adam`: `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` holds
      two temporaries of one parameter at a time: 2 x the largest;
    - `_fused_adam`: none; SGD (foreach momentum update in place): none;
    - transformers' Adafactor, one parameter at a time (transformers/optimization.py
      Adafactor.step): for an unfactored (1-D, e.g. a flat ZeRO partition) parameter
      `update = exp_avg_sq.rsqrt().mul_(grad)` is made while `update = grad**2 + eps` is alive, and
      `p.add_(-update)` makes `-update` while `update` is: 2 x the largest;
    - bitsandbytes 8-bit optimizers: none (the CUDA `optimizer_update_8bit_blockwise` kernel
      updates parameter and states in place)."""
    if not tensor_numels:
        return 0
    if optimizer in ("adamw_torch", "adamw_torch_foreach"):
        return int(sum(tensor_numels))
    if optimizer in ("adamw_single", "adafactor"):
        return 2 * int(max(tensor_numels))
    return 0


def optimizer_step_temp_bytes(optimizer: str, tensor_numels: list[int], elem_bytes: int) -> int:
    """Bytes of the step's temporaries (`optimizer_step_temp_numel`) over tensors of `elem_bytes` per
    element. transformers' Adafactor steps a 16-bit parameter through fp32 copies
    (transformers/optimization.py Adafactor.step: `grad = grad.float()`, `p_data_fp32 = p.float()`),
    alive with the two fp32 temporaries of its update: 16 bytes per element of the largest."""
    if optimizer == "adafactor" and elem_bytes < 4 and tensor_numels:
        return 16 * int(max(tensor_numels))
    return elem_bytes * optimizer_step_temp_numel(optimizer, tensor_numels)


BNB_OPTIMIZERS = ("adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit")


def _bnb_states(optimizer: str, shapes: list) -> dict:
    numels = [int(np.prod(s)) for s in shapes]
    if optimizer == "paged_adamw_32bit":
        return quant.adamw_32bit_state_bytes(numels, paged=True)
    return quant.adamw_8bit_state_bytes(numels, paged=optimizer.startswith("paged"))


def modelled_state_bytes(optimizer: str, shapes: list, state_bytes: int = 4) -> int | None:
    """Optimizer-state bytes of the optimizers whose state is modelled rather than traced, for
    parameters (or flat partitions) of the given shapes, as the library stores it; None for the
    others. bitsandbytes AdamW8bit / PagedAdamW8bit / PagedAdamW32bit: launcher/quant.py
    `adamw_8bit_state_bytes`, `adamw_32bit_state_bytes` (bitsandbytes/optim/optimizer.py
    Optimizer2State.init_state). transformers Adafactor: `adafactor_state_bytes` (beta1=None, HF's
    default)."""
    if optimizer in BNB_OPTIMIZERS:
        return _bnb_states(optimizer, shapes)["total_bytes"]
    if optimizer == "adafactor":  # fp32 whatever the parameters' dtype: made from `grad.float()`
        return quant.adafactor_state_bytes(shapes, dtype_bytes=max(state_bytes, 4))["total_bytes"]
    return None


def add_modelled_states(layout: Layout, optimizer: str, shapes: list, state_bytes: int = 4,
                        host: bool = False) -> bool:
    """Add the modelled optimizer states (`modelled_state_bytes`) to `layout` for the whole step;
    False when `optimizer` is traced instead. A paged bitsandbytes optimizer's large states are in
    CUDA unified memory (cudaMallocManaged, bitsandbytes functional.get_paged), outside torch's
    caching allocator: torch's allocated and reserved counters never see them and the driver pages
    them to host RAM rather than fail an allocation, so they are a host term (`paged_optimizer_states`):
    off the device peak, in the host-RAM need. nvidia-smi shows whatever part is resident on the
    GPU; that part is not modelled."""
    total = modelled_state_bytes(optimizer, shapes, state_bytes)
    if total is None:
        return False
    paged = _bnb_states(optimizer, shapes)["paged_bytes"] if optimizer in BNB_OPTIMIZERS else 0
    layout.add("optimizer_states", "optimizer_states", total - paged, host=host)
    if paged:
        layout.add("paged_optimizer_states", "optimizer_states", paged, host=True)
    return True


def optimizer_state_numel_factor(optimizer: str) -> int:
    """Full-size state tensors per parameter: AdamW exp_avg + exp_avg_sq (torch/optim/adamw.py
    `_init_group`), SGD momentum_buffer (torch/optim/sgd.py; none without momentum: `sgd_plain`,
    types.Workload.state_optimizer)."""
    return {"sgd": 1, "sgd_plain": 0}.get(optimizer, 2)


def optimizer_step_scalar_bytes(optimizer: str, num_tensors: int) -> int:
    """AdamW's per-parameter `state['step']`: a float32 scalar tensor (torch/optim/adam.py
    `_init_group`, `_get_scalar_dtype()`); SGD has none."""
    return 0 if optimizer in ("sgd", "sgd_plain") else 4 * num_tensors


def model_state_bytes(layout: Layout) -> int:
    """Parameters + gradients + optimizer states (incl. master weights) live at the last traced
    backward event, before the framework's post-backward reduction: the model states as the ZeRO
    paper counts them (arXiv:1910.02054 sec. 3.1), plus whatever buckets the layout holds then."""
    curves = category_curves(layout, with_host=True)
    i = layout.backward_end - 1
    return int(sum(curves[c][i] for c in ("parameters", "gradients", "optimizer_states")))

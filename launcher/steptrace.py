"""The data a traced training step produces: plain arrays, no torch objects.

A `StepTrace` is the storage-level history of one real training step (model build, forward,
loss, backward, optimizer step, zero_grad) of a transformers model, recorded under fake tensors
on the CPU device at a small depth. Every tensor storage ever allocated is one row. Events are
numbered 0..num_events-1; each allocation and each free is one event, in program order.

Strategy memory models (launcher/memory/) rebuild a live-bytes curve from these rows after
changing lifetimes the way their framework does (e.g. gradients copied into buckets and freed at
`ready`), take the maximum per phase, and extrapolate it linearly in depth from the traces at
depth 1 and 2 (`TraceSet`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import IntEnum

import numpy as np


class Kind(IntEnum):
    """What a storage holds."""

    PARAM = 0  # a module parameter (or a storage shared with one)
    GRAD = 1  # ends up as some parameter's .grad
    OPTIM = 2  # optimizer state (exp_avg, exp_avg_sq, step, momentum...)
    ACT = 3  # activations saved for backward, temporaries, logits, loss...
    BUFFER = 4  # module buffers (rotary inv_freq, causal masks registered as buffers), inputs


class OpClass(IntEnum):
    """How the speed model's host terms time the op that allocated a storage
    (launcher/host_time.py, term 2)."""

    ELEMENTWISE = 0  # arithmetic on each element (add, mul, exp, norms, softmax...)
    COPY = 1  # moves or fills memory without arithmetic (casts, copies, cat, gathers, zeros)
    FLOP = 2  # has a FLOP formula (matmul, attention): timed by the FLOP term
    # not a storage of the traced step: a GPU kernel's own workspace, recorded with 0 bytes at
    # each fused attention backward (trace.py `_dispatch_mode`); its size is the GPU estimate's
    # (`with_workspace`); not an op of its own for the host terms
    WORKSPACE = 3


class Role(IntEnum):
    """Where a parameter sits in the model (LLMem separates the body from the LM head)."""

    EMBEDDING = 0  # token / position embeddings (and their norms)
    LAYER = 1  # inside a repeated decoder layer
    HEAD = 2  # lm_head (untied) and final norm
    OTHER = 3


@dataclass(frozen=True)
class ParamTable:
    """One row per parameter of the traced (shallow) model, in `model.named_parameters()` order."""

    names: tuple[str, ...]
    numel: np.ndarray  # int64
    element_size: np.ndarray  # int64 bytes per element as built (the trace's dtype)
    trainable: np.ndarray  # bool
    role: np.ndarray  # int8 Role
    layer: np.ndarray  # int64 decoder layer index, -1 outside layers
    tied_to: np.ndarray  # int64 index of the parameter it shares storage with, -1 if none
    shapes: tuple = ()  # each parameter's shape (optimizers that factor states need it)


@dataclass(frozen=True)
class StepTrace:
    """One traced step at `num_layers` depth and `micro_batch_size`."""

    num_layers: int
    micro_batch_size: int
    seq_len: int
    params: ParamTable
    # --- one row per storage ---
    nbytes: np.ndarray  # int64, storage size in bytes (unrounded)
    alloc: np.ndarray  # int64 event index of the allocation
    free: np.ndarray  # int64 event index of the free; num_events if alive at the end
    kind: np.ndarray  # int8 Kind
    ready: np.ndarray  # int64; for GRAD rows the event at which the grad was accumulated into
    #                    param.grad (post-accumulate-grad hook), else -1
    param: np.ndarray  # int64 index into `params` for PARAM/GRAD/OPTIM rows, else -1
    num_events: int
    phases: dict[str, tuple[int, int]]  # 'build', 'forward', 'backward', 'optimizer', 'zero_grad':
    #                                     [start_event, end_event) half-open; with the previous
    #                                     step's outputs kept (training.keep_outputs), 'previous'
    #                                     between 'build' and 'forward' makes them
    flops: dict[str, float] = field(default_factory=dict)  # 'forward', 'backward' FLOPs of this step;
    #   'attention_forward', 'attention_backward': the part of each in fused attention kernels (sdpa)
    # Decoder-layer boundaries: 'forward' -> (first layer starts, last layer ends); 'backward' ->
    # (last layer's backward starts, first layer's backward ends). They cut a phase into
    # segments whose maxima are each linear in depth (`phase_segments`); empty if not recorded.
    # 'embedding' -> (forward start, one past the allocation of the first layer's input hidden
    # state): the events that compute the embedding's output; 'output' -> (allocation event of the
    # last layer's output hidden state, that + 1) (trace.py `_watch_layers`).
    layer_bounds: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Per row, for the speed model's host terms (launcher/host_time.py): the element size of the
    # tensor that allocated the storage and the class of the op that produced it. None in
    # hand-built traces.
    itemsize: np.ndarray | None = None  # int8
    op_class: np.ndarray | None = None  # int8 OpClass
    # Per row, the parameter an optimizer-step temporary was computed for (foreach AdamW's
    # per-parameter square roots), -1 for the rest (trace.py `_owners`). None in hand-built traces.
    owner: np.ndarray | None = None  # int64
    # Per row, the decoder layer of a storage allocated outside the step's layers that belongs to
    # one: a module buffer's (the buffers of a GPTQ base's QuantLinear: qweight, qzeros, scales,
    # g_idx), or a layer's part of the previous step's outputs (training.keep_outputs: its cached
    # keys and values); -1 for the rest. None in hand-built traces.
    buffer_layer: np.ndarray | None = None  # int64

    def live_curve(self, free: np.ndarray | None = None, mask: np.ndarray | None = None,
                   rounding: int = 1) -> np.ndarray:
        """Live bytes after each event (length num_events), optionally with modified free events,
        a subset of rows, and per-storage rounding up to a multiple of `rounding` bytes."""
        free = self.free if free is None else free
        sel = slice(None) if mask is None else mask
        nb = self.nbytes[sel]
        if rounding > 1:
            nb = -(-nb // rounding) * rounding
        return event_curve(self.alloc[sel], free[sel], nb, self.num_events)

    def phase_max(self, curve: np.ndarray, phase: str) -> int:
        a, b = self.phases[phase]
        return int(curve[a:b].max()) if b > a else 0

    def phase_segments(self, phase: str) -> list[tuple[int, int]]:
        """`phase` cut at its decoder-layer boundaries: before the layers, the layers, after them
        (one segment without boundaries). A phase maximum can move from one segment to another
        as depth grows (e.g. from the LM-head backward to the last layer's backward), so
        extrapolate each segment's maximum, then take the largest (`TraceSet.phase_max`)."""
        a, b = self.phases[phase]
        cuts = [c for c in self.layer_bounds.get(phase, ()) if a < c < b]
        edges = [a, *sorted(cuts), b]
        return [(x, y) for x, y in zip(edges, edges[1:]) if y > x]


def event_curve(alloc: np.ndarray, free: np.ndarray, nbytes: np.ndarray, num_events: int) -> np.ndarray:
    """Live bytes after each of `num_events` events of storages of `nbytes` allocated at `alloc`
    and freed at `free` (an event index; num_events = still alive). Summed with `np.bincount`
    (float64 weights: exact while the total stays below 2**53 bytes, else `np.add.at`), which
    is ~10x faster than `np.add.at` on a trace's rows."""
    nbytes = np.asarray(nbytes, dtype=np.int64)
    if int(np.abs(nbytes).sum()) < 2**53:
        delta = (np.bincount(alloc, weights=nbytes, minlength=num_events + 1)
                 - np.bincount(free, weights=nbytes, minlength=num_events + 1)).astype(np.int64)
    else:
        delta = np.zeros(num_events + 1, dtype=np.int64)
        np.add.at(delta, alloc, nbytes)
        np.add.at(delta, free, -nbytes)
    return np.cumsum(delta)[:num_events]


def extrapolate(v1: float, v2: float, num_layers: int, depth1: int = 1, depth2: int = 2) -> float:
    """Value at `num_layers` from the values at depth `depth1` and `depth2` (exact when each added
    decoder layer adds the same memory, which holds for a repeated-layer transformer once the
    first layer, which has no previous layer, is in both traces)."""
    return v1 + (num_layers - depth1) * (v2 - v1) / (depth2 - depth1)


@dataclass(frozen=True)
class TraceSet:
    """Two traces of one workload at consecutive depths (their `num_layers`; 2 and 3 for models
    that deep, because at depth 1 the only layer is also the first, whose forward has no previous
    layer's outputs alive), and the full depth to extrapolate to."""

    depth1: StepTrace  # the shallower trace
    depth2: StepTrace  # the deeper trace
    num_layers: int  # the real model's depth

    def at_depth(self, fn) -> float:
        """Apply `fn(trace) -> number` to both traces and extrapolate to full depth."""
        return extrapolate(fn(self.depth1), fn(self.depth2), self.num_layers,
                           self.depth1.num_layers, self.depth2.num_layers)

    def phase_max(self, phase: str, curve=None) -> float:
        """The maximum of `curve(trace)` (default: live bytes) over `phase` at full depth: the
        largest of its segments' maxima, each extrapolated in depth (`phase_segments`)."""
        curve = curve or (lambda t: t.live_curve())
        c1, c2 = curve(self.depth1), curve(self.depth2)
        s1, s2 = self.depth1.phase_segments(phase), self.depth2.phase_segments(phase)
        if len(s1) != len(s2):  # boundaries missing in one trace: whole phase
            s1, s2 = [self.depth1.phases[phase]], [self.depth2.phases[phase]]
        return max((extrapolate(int(c1[a1:b1].max()), int(c2[a2:b2].max()), self.num_layers,
                                self.depth1.num_layers, self.depth2.num_layers)
                    for (a1, b1), (a2, b2) in zip(s1, s2)), default=0)


def with_workspace(traces: TraceSet, nbytes: int) -> TraceSet | None:
    """`traces` with each fused attention backward's workspace rows (OpClass.WORKSPACE, traced
    with 0 bytes) at `nbytes`, the workspace one call allocates on a GPU (launcher/memory/runtime.py
    `flash_attention_backward_bytes`): allocated after the call's outputs and freed as it
    returns, one layer at a time, as the allocator sees them. None when a trace records no such call (an
    attention that ran as separate ops)."""
    out = []
    for t in (traces.depth1, traces.depth2):
        rows = t.op_class == OpClass.WORKSPACE if t.op_class is not None else None
        if rows is None or not rows.any():
            return None
        out.append(replace(t, nbytes=np.where(rows, np.int64(nbytes), t.nbytes)))
    return replace(traces, depth1=out[0], depth2=out[1])

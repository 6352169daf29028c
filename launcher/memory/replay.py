"""The step at the model's real depth, rebuilt from the layouts traced at 2 and 3 layers
(`full_depth_items`): each phase's peak of live bytes (`full_depth_peaks`) and the cache the
caching allocator holds above them when the rebuilt step is replayed through its simulator
(allocator.py), in steady state (`held_cache`, `peak_reserved_bytes`)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from launcher.environment import DEFAULT_CACHE_DIR
from .allocator import replay_arrays, replay_batches
from .common import CATEGORIES, KIND_CATEGORY, Init, Layout, PhasePeaks
from .runtime import cublas_workspace_allocations


@dataclass(frozen=True, eq=False)
class Items:
    """Device storages on a step's timeline, as columns: allocation and free events, bytes and
    stream of each, and its key, `keys[base]` (("row", r) a traced row, ("term", j) a framework
    storage of the layout, ("grown", category, stream) what one more layer adds to a category's
    persistent storages), with `copy` c > 0 for its copy in the c-th inserted layer
    (`full_depth_items`)."""

    start: np.ndarray
    end: np.ndarray
    nbytes: np.ndarray
    stream: np.ndarray
    base: np.ndarray
    copy: np.ndarray
    keys: list

    def __len__(self) -> int:
        return len(self.start)

    @classmethod
    def of(cls, tuples: list[tuple]) -> "Items":
        """From (start, end, key, nbytes, stream) tuples, each key its own."""
        cols = [np.array([it[f] for it in tuples], np.int64) for f in (0, 1, 3, 4)]
        return cls(*cols, np.arange(len(tuples)), np.zeros(len(tuples), np.int64), [it[2] for it in tuples])

    def tuples(self) -> list[tuple]:
        """(start, end, key, nbytes, stream) per storage; a copy's key is (key, c)."""
        return [(a, b, self.keys[k] if c == 0 else (self.keys[k], c), nb, st) for a, b, k, c, nb, st in zip(
            *(x.tolist() for x in (self.start, self.end, self.base, self.copy, self.nbytes, self.stream)))]


def _items(layout: Layout) -> Items:
    """Every device storage of a layout (`Items`), except the traced rows freed before the
    forward starts (temporaries of the model's construction, a GPTQ stand-in's dropped 16-bit
    weights, trace.py `gptq_stand_in`, that a run loading its checkpoint never has on the device)
    and the empty rows (a kernel workspace an estimate without it leaves at 0 bytes, steptrace.py
    `with_workspace`), which the allocator never sees."""
    t = layout.trace
    built = layout.phases["forward"][0]
    rows = (layout.mask & ~(layout.free <= built) & (t.nbytes > 0)).nonzero()[0]
    terms = [(j, term) for j, term in enumerate(layout.terms) if not term.host]
    column = lambda rows_part, f: np.concatenate(  # noqa: E731
        [np.asarray(rows_part, np.int64), np.array([f(term) for _, term in terms], np.int64)])
    n = len(rows) + len(terms)
    return Items(column(layout.alloc[rows], lambda term: term.start), column(layout.free[rows], lambda term: term.end),
                 column(t.nbytes[rows], lambda term: term.nbytes), column(np.zeros(len(rows)), lambda term: term.stream),
                 np.arange(n), np.zeros(n, np.int64),
                 [("row", r) for r in rows.tolist()] + [("term", j) for j, _ in terms])


def layer_blocks(shallower: Layout, deeper: Layout) -> tuple[int, int] | None:
    """(forward, backward) events of one decoder layer on the layout timeline: how much longer the
    deeper layout's layer regions (`StepTrace.layer_bounds`) are than the shallower one's, one
    layer apart. None when the two cannot be told apart by one repeated layer (depths not
    consecutive, the deeper below 3, no layer bounds)."""
    a, b = shallower.trace, deeper.trace
    if b.num_layers != a.num_layers + 1 or b.num_layers < 3:
        return None
    spans = []
    for phase in ("forward", "backward"):
        if phase not in a.layer_bounds or phase not in b.layer_bounds:
            return None
        (a0, a1), (b0, b1) = (lay.ev(np.asarray(x.layer_bounds[phase])) for lay, x in ((shallower, a), (deeper, b)))
        spans.append(int(b1 - b0) - int(a1 - a0))
    fl, bl = spans
    f0, f1 = (int(x) for x in deeper.ev(np.asarray(b.layer_bounds["forward"])))
    b0, b1 = (int(x) for x in deeper.ev(np.asarray(b.layer_bounds["backward"])))
    if fl <= 0 or bl <= 0 or f1 - 2 * fl < f0 or b0 + 2 * bl > b1:
        return None
    return fl, bl


def full_depth_items(shallower: Layout, deeper: Layout, num_layers: int) -> tuple[Items, int] | None:
    """The deeper layout's storages at `num_layers` layers, and that step's event count: its
    second-to-last decoder layer (the last one with a layer on either side) repeated until the
    model has `num_layers` layers. The layers' forward blocks run in order and their backward
    blocks in reverse, each `layer_blocks` long, so the k = num_layers - depth inserted layers go
    after that layer's forward block and before its backward block: an event after the former
    moves k forward blocks later, one after the last layer's backward block k forward and k
    backward blocks later. A storage allocated in that layer's forward or backward block (its
    activations, saved tensors, gradients, a framework's per-layer buffers) is repeated for
    every inserted layer c = 1..k: its forward events c forward blocks later, its backward events
    c backward blocks earlier than where that layer's backward block now starts. A storage of one
    of that layer's parameters allocated elsewhere (the parameter itself when the model is built,
    its optimizer states, the optimizer step's temporaries computed for it: `StepTrace.owner`; a
    framework's copy of it, `Term.param`, released in the inserted layer's block) or of one of its
    modules' buffers (a GPTQ base's packed weights: `StepTrace.buffer_layer`), or its part of the
    previous step's outputs that a loop keeps (the same field), is repeated where it is. None when
    `layer_blocks` is None or the model is no deeper than the trace. A framework storage that both
    depths hold as many of is one storage of the whole model wherever it is allocated
    (`_term_growth`): it is not repeated, and grows by k times what one more layer adds to it;
    those alive through the whole step are matched by name, or summed per category when their
    number grows with the model (`_persistent_growth`). A storage of the middle layer freed as the
    last layer returns is freed as the next layer returns, in every
    copy. Not exact: a tensor of the second-to-last
    layer that the last layer frees only when its forward ends (a 16-bit model under ZeRO) is
    freed there in every inserted layer too, instead of one layer later (tests/unit/
    test_full_depth_replay.py: the same peak reserved, peak allocated 0.02% higher)."""
    last = _LAST_REBUILD
    if last and last[0] is shallower and last[1] is deeper and last[2] == num_layers:
        return last[3]  # the same layouts' peaks (`full_depth_peaks`) and replay (`held_cache`)
    out = _full_depth_items(shallower, deeper, num_layers)
    _LAST_REBUILD[:] = [shallower, deeper, num_layers, out]
    return out


_LAST_REBUILD: list = []  # the last rebuild's layouts, depth and result


def _full_depth_items(shallower: Layout, deeper: Layout, num_layers: int) -> tuple[Items, int] | None:
    blocks = layer_blocks(shallower, deeper)
    k = num_layers - deeper.trace.num_layers
    if blocks is None or k <= 0:
        return None
    fl, bl = blocks
    t = deeper.trace
    f0, f1 = (int(x) for x in deeper.ev(np.asarray(t.layer_bounds["forward"])))
    b0, b1 = (int(x) for x in deeper.ev(np.asarray(t.layer_bounds["backward"])))
    depth, n = t.num_layers, deeper.num_events
    moved = _mover(deeper, blocks, k)
    middle = depth - 2
    first_f, first_b = f1 - (depth - 1) * fl, b0 + (depth - 1) * bl  # layer 1's forward start, layer 0's backward start

    def locate(x: int):
        """(phase, layer, offset in its block) of an event in a layer block, else None."""
        if first_f <= x < f1:
            j = 1 + (x - first_f) // fl
            return "f", j, x - first_f - (j - 1) * fl
        if f0 <= x < first_f:
            return "f", 0, x - f0
        if b0 <= x < first_b:
            j = depth - 1 - (x - b0) // bl
            return "b", j, x - b0 - (depth - 1 - j) * bl
        if first_b <= x < b1:
            return "b", 0, x - first_b
        return None

    def placed(x: int, shift: int) -> int:
        """`x` in the block of the layer `shift` layers further on (`moved` outside the blocks)."""
        where = locate(x)
        if where is None:
            return moved(x)
        phase, j, off = where
        j += shift
        if j == where[1] == 0:
            return moved(x)
        if phase == "f":
            return first_f + (j - 1) * fl + off
        return b0 + k * fl + (num_layers - 1 - j) * bl + off

    def series(x: int) -> tuple[int, int, int]:
        """(first, one, step) of the event `x` in its copies: placed(x, c) is `first` at c = 0,
        then one + (c - 1) * step: one block further per copy (forward blocks run on, backward
        blocks back), or the same event outside the blocks."""
        where = locate(x)
        return placed(x, 0), placed(x, 1), 0 if where is None else fl if where[0] == "f" else -bl

    owner = t.param if t.owner is None else np.where(t.param >= 0, t.param, t.owner)
    term_layer = lambda j: int(t.params.layer[deeper.terms[j].param]) if deeper.terms[j].param >= 0 else -1  # noqa: E731
    buffer_layer = t.buffer_layer if t.buffer_layer is not None else np.full(len(owner), -1)
    layer_of = np.where(owner >= 0, t.params.layer[owner.clip(0)], buffer_layer)
    n_full = n + k * (fl + bl)
    matched, summed = _persistent_growth(shallower, deeper)
    grown = {**_term_growth(shallower, deeper), **matched}
    # one run per storage: its copies c = 0..copies start at s0 (c = 0), then s1 + (c - 1) * s_step,
    # and end likewise: (s0, s1, s_step, e0, e1, e_step, copies, key index, bytes, stream)
    runs = []
    its = _items(deeper)
    keys = list(its.keys)
    for start, end, i, nbytes, stream in zip(*(x.tolist() for x in (its.start, its.end, its.base, its.nbytes,
                                                                     its.stream))):
        key = keys[i]
        cap = deeper.terms[key[1]].cap if key[0] == "term" else 0
        nbytes = nbytes + k * grown.get(key, 0) if not cap else min(nbytes + k * grown.get(key, 0), max(nbytes, cap))
        layer_copies = k if key[0] == "row" and layer_of[key[1]] == middle else 0
        if start == 0 and end >= n:  # alive through the step
            runs.append((0, 0, 0, n_full, n_full, 0, layer_copies, i, nbytes, stream))
            continue
        where = locate(start)
        anchor = where[1] if where else None
        if anchor == middle and key not in grown:  # the middle layer's storage, and one per inserted layer
            # freed as the last layer returns (the end of the forward's layers): as the next layer
            # returns, one forward block on per copy (bloom's attention probabilities under
            # checkpointing live until the next layer's forward ends)
            ends = (f1, f1 + fl, fl) if end == f1 else series(end)
            runs.append((*series(start), *ends, k, i, nbytes, stream))
        elif key[0] == "term" and term_layer(key[1]) == middle:  # a copy of one of its parameters
            a = placed(start, 0)
            runs.append((a, a, 0, *series(end), k, i, nbytes, stream))
        elif anchor is not None:  # the last layer moves k layers on; earlier ones stay
            shift = k if anchor == depth - 1 else 0
            a, b = placed(start, shift), placed(end, shift)
            runs.append((a, a, 0, b, b, 0, 0, i, nbytes, stream))
        else:
            a, b = moved(start), moved(end)
            runs.append((a, a, 0, b, b, 0, layer_copies, i, nbytes, stream))
    for (cat, stream), nb in summed.items():
        runs.append((0, 0, 0, n_full, n_full, 0, 0, len(keys), k * nb, stream))
        keys.append(("grown", cat, stream))
    r = np.array(runs, np.int64).reshape(-1, 10)
    counts = r[:, 6] + 1
    run = np.repeat(np.arange(len(r)), counts)
    copy = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    first, later = copy == 0, copy - 1
    return Items(np.where(first, r[run, 0], r[run, 1] + later * r[run, 2]),
                 np.where(first, r[run, 3], r[run, 4] + later * r[run, 5]),
                 r[run, 8], r[run, 9], r[run, 7], copy, keys), n_full


def _mover(deeper: Layout, blocks: tuple[int, int], k: int):
    """Where an event of the deeper layout that is not tied to an inserted layer lands in the step
    with k more layers: after the middle layer's forward block, k forward blocks later; after the
    last layer's backward block, k more backward blocks later."""
    fl, bl = blocks
    f1 = int(deeper.ev(np.asarray(deeper.trace.layer_bounds["forward"]))[1])
    b0 = int(deeper.ev(np.asarray(deeper.trace.layer_bounds["backward"]))[0])

    def moved(x: int) -> int:
        return x if x < f1 - fl else x + k * fl if x < b0 + bl else x + k * (fl + bl)
    return moved


def full_depth_peaks(shallower: Layout, deeper: Layout, num_layers: int, rounding: int = 1,
                     device_only: bool = False) -> PhasePeaks | None:
    """Each phase's peak of live device bytes and its breakdown in the step rebuilt at
    `num_layers` layers (`full_depth_items`), each storage rounded up to `rounding`; the phases'
    bounds move as the events outside the layers do. Unlike a linear extrapolation of the two
    traced depths' peaks, it does not take for a per-layer increment what differs between 2 and 3
    layers only at the model's ends (FSDP2 full fine-tuning of Llama-2-7B: the first block's
    backward, which has no earlier block to prefetch, is the 2-layer step's peak, so the
    extrapolated backward peak grew by a reduce-scatter buffer per layer: 23.1 GiB against 15.7 at
    32 layers). None when the step cannot be rebuilt. Storages a layout keeps in host memory
    (offload) are not rebuilt: with `device_only` (a GPU's peaks) they are left out, as they are
    not device memory; otherwise (CPU processes, where the host is the device) such a layout
    gives None, and its caller extrapolates per segment."""
    if not device_only and any(term.host for lay in (shallower, deeper) for term in lay.terms):
        return None
    full = full_depth_items(shallower, deeper, num_layers)
    if full is None:
        return None
    items, n = full
    t = deeper.trace
    start, end, nbytes = items.start, items.end, items.nbytes
    nbytes = -(-nbytes // rounding) * rounding if rounding > 1 else nbytes
    of_kind = {int(k): c for k, c in KIND_CATEGORY.items()}
    kinds = t.kind.tolist()
    category = np.array([of_kind.get(kinds[key[1]]) if key[0] == "row" else key[1] if key[0] == "grown"
                         else deeper.terms[key[1]].category for key in items.keys])[items.base]
    curves = {}
    for cat in CATEGORIES:
        sel = category == cat
        delta = np.zeros(n + 1, np.int64)
        np.add.at(delta, np.minimum(start[sel], n), nbytes[sel])
        np.add.at(delta, np.minimum(end[sel], n), -nbytes[sel])
        curves[cat] = np.cumsum(delta)[:n]
    total_curve = sum(curves.values())
    moved = _mover(deeper, layer_blocks(shallower, deeper), num_layers - t.num_layers)
    total, breakdown = {}, {}
    for ph, (a, b) in deeper.phases.items():
        a, b = moved(a), moved(b) if b < deeper.num_events else n
        i = a + int(np.argmax(total_curve[a:b])) if b > a else a
        total[ph] = int(total_curve[i]) if b > a else 0
        breakdown[ph] = {c: int(curves[c][i]) if b > a else 0 for c in CATEGORIES}
    return PhasePeaks(total, breakdown)


def _persistent(lay: Layout, term) -> bool:
    return term.start == 0 and term.end >= lay.num_events


def _persistent_growth(shallower: Layout, deeper: Layout) -> tuple[dict, dict]:
    """What one more layer adds to the framework storages alive through the whole step (flat
    buffers, master weights, a DDP reducer's buckets): ({("term", j): bytes}, {}) matched by name
    and rank when both depths hold the same names as often; else ({}, {(category, stream): bytes})
    summed per category (a DDP reducer has more buckets at a greater depth: the rebuilt step holds
    k times the growth in one more storage of the category, its bucket boundaries not rebuilt)."""
    def terms(lay: Layout) -> list:
        return [(j, term) for j, term in enumerate(lay.terms) if not term.host and _persistent(lay, term)]
    a, b = terms(shallower), terms(deeper)
    if sorted(term.name for _, term in a) == sorted(term.name for _, term in b):
        by_name: dict = {}
        for _, term in a:
            by_name.setdefault(term.name, []).append(term.nbytes)
        seen: dict = {}
        matched = {}
        for j, term in b:
            r = seen[term.name] = seen.get(term.name, -1) + 1
            matched[("term", j)] = term.nbytes - by_name[term.name][r]
        return matched, {}
    totals = [{}, {}]
    for out, ts in zip(totals, (a, b)):
        for _, term in ts:
            out[(term.category, term.stream)] = out.get((term.category, term.stream), 0) + term.nbytes
    return {}, {k: totals[1][k] - totals[0].get(k, 0) for k in sorted(totals[1]) if totals[1][k] > totals[0].get(k, 0)}


def _term_growth(shallower: Layout, deeper: Layout) -> dict:
    """{("term", j): bytes one more layer adds} for the deeper layout's framework storages that
    both depths hold as many of (flat parameter and gradient buffers, master weights and optimizer
    states, buckets, a ZeRO gradient partition first allocated inside a layer's backward, step
    temporaries: one storage sized by the whole model), each matched to the shallower layout's
    storage of the same name and rank among those of that name; names whose count differs between
    the depths (one storage per layer) are not in it. A bucketed reduction (`Term.cap`) grows to
    its bucket at most: a step that the trace's depth flushes once after backward flushes at the
    real depth in several buckets during backward, which the rebuilt step does not hold (ZeRO-3
    with `reduce_bucket_size` below the model's gradients)."""
    def by_name(lay: Layout) -> dict:
        out: dict = {}
        for j, term in enumerate(lay.terms):
            if not term.host and not _persistent(lay, term):
                out.setdefault(term.name, []).append((j, term.nbytes))
        return out
    a, b = by_name(shallower), by_name(deeper)
    return {("term", j): nb - old for name, terms in b.items() if len(a.get(name, ())) == len(terms)
            for (j, nb), (_, old) in zip(terms, a[name])}


def allocation_events(layout: Layout, sm_arch: int, items: Items | None = None,
                      num_events: int | None = None, num_layers: int | None = None) -> list[tuple]:
    """(time, op, key, nbytes, stream) for the device storages of a layout (or `items` on a
    timeline of `num_events`, `full_depth_items`), steady state: persistent storages (alive from
    the first to the last event) are allocated once, before everything else, with the cuBLAS
    workspaces; the rest of the step is replayed twice, so the second step reuses the first
    step's segments as the real second step does. Storages left alive at the end of the first
    replay are freed before the second. At one time, frees come before allocations. A layout with
    an initialization (`Layout.init`) has it replayed first, at `num_layers` layers (`init_events`;
    default: the traced depth), its shards standing for the persistent term they make up."""
    return list(zip(*(a.tolist() for a in allocation_arrays(layout, sm_arch, items, num_events, num_layers))))


def allocation_arrays(layout: Layout, sm_arch: int, items: Items | None = None,
                      num_events: int | None = None, num_layers: int | None = None) -> tuple[np.ndarray, ...]:
    """`allocation_events` as five arrays (time, op, key, nbytes, stream), for `replay_arrays`;
    with the layout's initialization (`Layout.init`) at `num_layers` layers first (`init_events`;
    default: the traced depth)."""
    n = layout.num_events if num_events is None else num_events
    items = _items(layout) if items is None else items
    if not items:
        return (np.full(len(cublas_workspace_allocations(sm_arch)), -1), *_first_events(sm_arch))
    nbytes, persistent, key, ops, at, stream = _timeline(items, n)
    first = _first_events(sm_arch, nbytes, persistent, stream, _init_for(layout, items, num_layers))
    steps = [(at + rep * (n + 1), key + (rep + 1) * len(items)) for rep in range(2)]
    return (np.concatenate([np.full(len(first[0]), -1)] + [t for t, _ in steps]),
            np.concatenate([first[0], ops, ops]),
            np.concatenate([first[1]] + [k for _, k in steps]),
            np.concatenate([first[2], nbytes[key], nbytes[key]]),
            np.concatenate([first[3], stream[key], stream[key]]))


INIT_KEY = -(1 << 40)  # the initialization's keys count down from here, below the cuBLAS workspaces' -1, -2...


def init_events(init: Init, depth: int, num_layers: int) -> tuple[np.ndarray, ...]:
    """(op, key, nbytes, stream) of a framework's initialization of the model on the device
    (`Init`) at `num_layers` layers, traced at `depth`: the unit of the second-to-last traced layer
    repeated for the inserted layers, as `full_depth_items` repeats its step. When the model was
    built on the device, every parameter's storage is allocated first (in wrap order). Then per
    unit: its parameters' device copies (unless built there); with a flat parameter, the flat
    parameter, the parameters freed, this rank's shard, the flat parameter freed; without one,
    each parameter's shard, then the parameters freed. Shards are never freed: they are the
    step's parameters. A last event (op 0) restarts the replay's peaks, so the step's peaks are
    measured with the initialization's cached segments in reserved."""
    k = max(0, num_layers - depth)
    units = [u for x in init.units for u in [x] * (k + 1 if x.layer == depth - 2 else 1)]
    keys = iter(range(INIT_KEY, INIT_KEY - (1 << 30), -1))
    ops, ks, nb = [], [], []

    def ev(op: int, key: int, nbytes: int) -> None:
        ops.append(op), ks.append(key), nb.append(nbytes)

    param_keys = [[next(keys) for _ in u.params] for u in units]
    if init.built_on_device:
        for u, pk in zip(units, param_keys):
            for key, nbytes in zip(pk, u.params):
                ev(1, key, nbytes)
    for u, pk in zip(units, param_keys):
        if not init.built_on_device:
            for key, nbytes in zip(pk, u.params):
                ev(1, key, nbytes)
        flat = next(keys) if u.flat else None
        if flat is not None:
            ev(1, flat, u.flat)
            for key, nbytes in zip(pk, u.params):
                ev(-1, key, nbytes)
        for nbytes in u.shards:
            ev(1, next(keys), nbytes)
        if flat is not None:
            ev(-1, flat, u.flat)
        else:
            for key, nbytes in zip(pk, u.params):
                ev(-1, key, nbytes)
    ev(0, INIT_KEY, 0)
    return (np.array(ops, np.int64), np.array(ks, np.int64), np.array(nb, np.int64),
            np.zeros(len(ops), np.int64))


def _init_for(layout: Layout, items: Items, num_layers: int | None):
    """(`init_events` of the layout's initialization, which items its kept shards stand for: the
    `Init.kept` term's), or None without one."""
    init = layout.init
    if init is None:
        return None
    depth = layout.trace.num_layers
    is_kept = np.array([key[0] == "term" and layout.terms[key[1]].name == init.kept for key in items.keys], bool)
    return init_events(init, depth, max(depth, num_layers or depth)), is_kept[items.base]


def _first_events(sm_arch: int, nbytes=None, persistent=None, stream=None, init=None) -> tuple[np.ndarray, ...]:
    """The replay's first allocations (op, key, nbytes, stream): the initialization's events
    (`_init_for`; its restart of the peaks moved to the end), the cuBLAS workspaces (keys -1, -2,
    ...), then the persistent storages (`_timeline`; keyed by their item numbers) but those the
    initialization's kept shards stand for."""
    workspaces = np.array(cublas_workspace_allocations(sm_arch), np.int64)
    if persistent is None:
        persistent = nbytes = stream = np.zeros(0, np.int64)
    if init is not None:
        persistent = persistent[~init[1][persistent]]
    first = (np.ones(len(workspaces) + len(persistent), np.int64),
             np.concatenate([-1 - np.arange(len(workspaces)), persistent]),
             np.concatenate([workspaces, nbytes[persistent]]),
             np.concatenate([np.zeros(len(workspaces), np.int64), stream[persistent]]))
    if init is None:
        return first
    return tuple(np.concatenate([h[:-1], f, h[-1:]]) for h, f in zip(init[0], first))


def _timeline(items: Items, n: int):
    """One step's events of `items` on a timeline of `n` events: (bytes per item, the persistent
    items (alive from the first to the last event), then for the others' allocations and frees in
    order: item, op (+1 allocate, -1 free), time; stream per item). Frees come first at one time;
    items alive at the end of the step are freed there."""
    start, end, nbytes, stream = items.start, items.end, items.nbytes, items.stream
    persistent = (start == 0) & (end >= n)
    rest = np.nonzero(~persistent)[0]
    op = np.concatenate([np.ones(len(rest), np.int64), -np.ones(len(rest), np.int64)])
    at = np.concatenate([start[rest], np.minimum(end[rest], n)])
    order = np.lexsort((op, at))  # by time, frees first; stable: item order among equals
    return nbytes, np.nonzero(persistent)[0], np.concatenate([rest, rest])[order], op[order], at[order], stream


def peak_reserved_bytes(deeper: Layout, sm_arch: int, peak_allocated_bytes: int,
                        expandable_segments: bool = False, memo: "ReplayMemo | None" = None,
                        shallower: Layout | None = None, num_layers: int | None = None) -> int:
    """Peak reserved of the full-depth step: its peak allocated (`peak_allocated_bytes`, the
    phase-aware estimate) plus the cache the allocator holds above its live bytes
    (`held_cache`)."""
    return peak_allocated_bytes + held_cache(deeper, sm_arch, expandable_segments, memo, shallower, num_layers)[0]


def held_cache(deeper: Layout, sm_arch: int, expandable_segments: bool = False, memo: "ReplayMemo | None" = None,
               shallower: Layout | None = None, num_layers: int | None = None) -> tuple[int, int]:
    """(held, needed) of the steady-state step replayed at the real depth: the cache the allocator
    holds above its live bytes at its peak (peak reserved - peak allocated), and the part of it
    that an out-of-memory retry could not return (the peak of reserved minus the free segments
    and pages `release_cached_blocks` frees, allocator.py `peak_needed`, minus peak allocated).

    The replayed step is the deeper traced layout (`deeper`) rebuilt at `num_layers` layers from
    it and the `shallower` one (`full_depth_items`), or the deeper layout itself when it cannot
    be (no `shallower`, depths not consecutive, a model no deeper than the trace). The held cache
    comes from blocks that no later request could reuse, since segments are only returned when
    memory runs out: those of the depth-independent large tensors (embedding and LM-head outputs,
    the loss's logits copies, optimizer-step and dequantization temporaries) that the layers'
    smaller blocks do not fill, and the holes each layer's frees leave between the blocks of the
    layers still alive, which grow with depth (Llama-3.1-8B FSDP2 at 8192 tokens with expandable
    segments: 7.1 GiB held at 3 layers, 10.1 GiB at 32; bloom-1b1 ZeRO-3: 3.6 GiB at 3 layers,
    6.2 GiB at 24). The replay's own peak allocated is not used, because the full-depth
    estimate's peak is phase-aware. `expandable_segments`: the replay's allocator grows one
    segment per pool (allocator.py). `memo`: replay results kept on disk (`ReplayMemo`)."""
    blocks = layer_blocks(shallower, deeper) if shallower is not None and num_layers else None
    rebuild = blocks is not None and num_layers > deeper.trace.num_layers
    # what the rebuild takes from the shallower layout: the layer blocks and the terms' growth
    depth = (num_layers, blocks, sorted(_term_growth(shallower, deeper).items()),
             [sorted(g.items()) for g in _persistent_growth(shallower, deeper)]) if rebuild else None
    key = memo.key(deeper, sm_arch, expandable_segments, depth) if memo is not None else None
    held = memo.get(key) if key is not None else None
    if held is None:  # a remembered replay rebuilds nothing
        full = full_depth_items(shallower, deeper, num_layers) if rebuild else None
        replayed = replay_arrays(*allocation_arrays(deeper, sm_arch, *(full or ()), num_layers=num_layers if full
                                                    else None)[1:], expandable_segments)
        held = (replayed.peak_reserved - replayed.peak_allocated,
                max(0, replayed.peak_needed - replayed.peak_allocated))
        if key is not None:
            memo.put(key, held)
    return held


def varlen_held_cache(long: tuple, short: tuple, lengths: list[int], sm_arch: int,
                      expandable_segments: bool = False, memo: "ReplayMemo | None" = None,
                      capacity: int | None = None) -> tuple[int, int] | None:
    """(held, needed) as `held_cache`, over a run of micro-batches of varying length: `lengths`
    (lengths.py `LengthProfile.batch_lengths`) replayed one after another through one allocator.

    `long` and `short` are (shallower layout, deeper layout, num_layers, tokens) of the same
    strategy traced at two sequence lengths. Every storage's size at length L is interpolated
    between its sizes at the two (affine in L: activations, logits and their gradients are; with
    eager attention the seq^2 probabilities are not, and the chord overstates them between the
    two lengths). The persistent storages are allocated once; each batch then allocates and frees
    the step's other storages in the traced order at its own sizes. A block cached by one batch
    serves a later request only if it is large enough (best fit, split when more than 1 MiB is left:
    CUDACachingAllocator.cpp), so a longer batch after shorter ones gets new segments while the
    shorter batches' blocks stay cached: peak reserved grows with the lengths a run has seen,
    until a new segment would take it past the device's `capacity` (bytes the allocator can
    reserve), where the allocator returns its wholly free cached segments before retrying
    (allocator.py `release_cached_blocks`). None when the two lengths' steps do not allocate the
    same storages at the same points."""
    sides = []
    for shallower, deeper, num_layers, tokens in (long, short):
        rebuild = shallower is not None and num_layers and num_layers > deeper.trace.num_layers
        full = full_depth_items(shallower, deeper, num_layers) if rebuild else None
        items, n = full or (_items(deeper), deeper.num_events)
        sides.append((items, n, tokens, deeper, num_layers if full else None))
    (items_a, n, len_a, deeper, depth), (items_b, n_b, len_b, _, _) = sides
    same = ("start", "end", "stream", "base", "copy")
    if n != n_b or len(items_a) != len(items_b) or len_a == len_b or items_a.keys != items_b.keys or not all(
            np.array_equal(getattr(items_a, f), getattr(items_b, f)) for f in same):
        return None
    key = None
    if memo is not None:
        h = hashlib.blake2b(digest_size=20)
        h.update(json.dumps([len_a, len_b, list(lengths), capacity, items_a.keys], default=str).encode())
        for column in [getattr(items_a, f) for f in same] + [items_a.nbytes, items_b.nbytes]:
            h.update(np.ascontiguousarray(column, np.int64).tobytes())
        key = memo.key(deeper, sm_arch, expandable_segments, ["varlen", h.hexdigest()])
        held = memo.get(key)
        if held is not None:
            return held
    held = varlen_replay(items_a, items_b, n, len_a, len_b, lengths, sm_arch, expandable_segments, capacity,
                         _init_for(deeper, items_a, depth))
    if key is not None:
        memo.put(key, held)
    return held


def varlen_replay(items_a: Items, items_b: Items, n: int, len_a: int, len_b: int,
                  lengths: list[int], sm_arch: int, expandable_segments: bool = False,
                  capacity: int | None = None, init=None) -> tuple[int, int]:
    """(held, needed) of `varlen_held_cache` from the step's storages at two lengths (`items_a`
    at `len_a` tokens, `items_b` at `len_b`: the same storages with the same lifetimes on a
    timeline of `n` events), replayed as one stream of events, one batch per length
    (allocator.py `replay_batches`, which skips a batch whose length was replayed since the
    allocator last mapped or released a segment: with `training.length_multiple_of` most batches
    repeat a length, a 512-token cap in multiples of 16 has 32)."""
    nbytes_a, persistent, order, ops, _, stream = _timeline(items_a, n)
    nbytes_b = items_b.nbytes
    slope = (nbytes_a - nbytes_b) / (len_a - len_b)
    distinct, sequence = np.unique(np.asarray(lengths, np.int64), return_inverse=True)
    sizes = np.maximum(np.rint(nbytes_b + slope * (distinct[:, None] - len_b)).astype(np.int64), 0)[:, order]
    first = _first_events(sm_arch, nbytes_a, persistent, stream, init)
    # each batch frees its storages by its end: its keys are reused
    replayed = replay_batches(first, (ops, order + len(items_a), stream[order]), sizes, sequence,
                              expandable_segments, capacity)
    return (replayed.peak_reserved - replayed.peak_allocated,
            max(0, replayed.peak_needed - replayed.peak_allocated))


_CODE = ("allocator.py", "replay.py", "_replay.c")  # the replay's code: its text is part of every memo key
MEMO_FORMAT = 3  # 2: terms carry their stream; 3: (held, needed) at the real depth


class ReplayMemo:
    """The cache a replay holds above its live bytes (`peak_reserved_bytes`), by the content of
    what is replayed, in one JSON file under the trace cache directory: a warm plan replays no
    layout. The key hashes every input of `allocation_events` and `replay` (the kept rows' sizes
    and events in row order, the framework terms' sizes and lifetimes in order, the event count,
    the cuBLAS workspace requests, expandable segments) with the source text of allocator.py and
    this file and `MEMO_FORMAT`, so a layout, allocator or code change is a new key, never a stale
    value. An unreadable file is an empty memo; the file is rewritten atomically (`save`)."""

    def __init__(self, cache_dir=None):
        self.path = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / "replays.json"
        self._values: dict[str, list] | None = None
        self._new: dict[str, list] = {}
        self._code: str | None = None

    _SHARED: dict = {}

    @classmethod
    def shared(cls, cache_dir=None) -> "ReplayMemo":
        """The one memo of this process for `cache_dir`."""
        memo = cls(cache_dir)
        return cls._SHARED.setdefault(memo.path, memo)

    def _load(self) -> dict[str, list]:
        if self._values is None:
            try:
                data = json.loads(self.path.read_text())
                self._values = ({k: v for k, v in data.items() if isinstance(v, list) and len(v) == 2
                                 and all(isinstance(x, int) for x in v)} if isinstance(data, dict) else {})
            except (OSError, ValueError):
                self._values = {}
        return self._values

    def key(self, layout: Layout, sm_arch: int, expandable_segments: bool, depth: tuple | None = None) -> str:
        if self._code is None:
            here = Path(__file__).resolve().parent
            self._code = hashlib.sha256(b"".join((here / f).read_bytes() for f in _CODE)).hexdigest()
        t, rows = layout.trace, layout.mask.nonzero()[0]
        h = hashlib.blake2b(digest_size=20)
        h.update(json.dumps([MEMO_FORMAT, self._code, int(layout.num_events), bool(expandable_segments),
                             depth,
                             cublas_workspace_allocations(sm_arch), len(rows),
                             [(term.start, term.end, term.nbytes, term.stream)
                              for term in layout.terms if not term.host], repr(layout.init)]
                            ).encode())
        for arr in (layout.alloc[rows], layout.free[rows], t.nbytes[rows]):
            h.update(np.ascontiguousarray(arr, np.int64).tobytes())
        return h.hexdigest()

    def get(self, key: str) -> tuple[int, int] | None:
        value = self._load().get(key)
        return None if value is None else (value[0], value[1])

    def put(self, key: str, held: tuple[int, int]) -> None:
        self._load()[key] = self._new[key] = [int(x) for x in held]

    def save(self) -> None:
        """Write the new results (merged with the file as it is now, which another plan may have
        grown meanwhile); a read-only cache only costs time."""
        if not self._new:
            return
        try:
            on_disk = json.loads(self.path.read_text()) if self.path.exists() else {}
            if not isinstance(on_disk, dict):
                on_disk = {}
        except (OSError, ValueError):
            on_disk = {}
        on_disk.update(self._new)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(on_disk, separators=(",", ":")))
            os.replace(tmp, self.path)
        except OSError:
            return
        self._new = {}

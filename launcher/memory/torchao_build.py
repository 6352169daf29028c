"""The GPU memory that building and loading a torchao NF4 model leaves in the caching allocator
(launcher/torchao_nf4.py, module docstring: torchtune's single-device recipes), replayed through
the allocator simulator (allocator.py) at full depth. The storages of `to_nf4` and of
`get_original_weight` are recorded on fake tensors (the tracer's recorder, launcher/trace.py), so
the sequence is the ported torchao ops', not written by hand.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
from dataclasses import replace
from pathlib import Path

from launcher import torchao_nf4 as nf4
from launcher.memory.allocator import replay
from launcher.steptrace import Role
from launcher.trace import _dispatch_mode, _Recorder


def _record(make_inputs, fn) -> tuple[tuple, tuple]:
    """The storages `fn(*make_inputs())` allocates, recorded on fake tensors as the trace records
    a step (launcher/trace.py `_Recorder`): (rows, kept), rows = (alloc event, free event or -1,
    nbytes) in allocation order, kept = the rows alive in `fn`'s result."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rec = _Recorder()
    with FakeTensorMode():
        inputs = make_inputs()
        for t in inputs:  # the caller's storages: seen first, left out of the rows
            rec.see(t.untyped_storage(), t.element_size())
        first = rec.num_events
        with _dispatch_mode(rec):
            out = fn(*inputs)
        out = out if isinstance(out, list) else [out]
        kept = tuple(sorted(rec.row_of[id(t.untyped_storage())] - first for t in out))
        rows = tuple(zip(rec.alloc[first:], list(rec.free[first:]), rec.nbytes[first:]))  # before `out` is released
        del out, inputs
    return rows, kept


@functools.lru_cache(maxsize=64)
def quantize_rows(numel: int, chunk: int, fp16_source: bool):
    """`to_nf4` of a 1D weight of `numel` elements (a bf16 one, or an fp16 one first converted
    to bf16 as the checkpoint's tensors are)."""
    import torch

    dtype = torch.float16 if fp16_source else torch.bfloat16
    return _record(lambda: (torch.empty(numel, dtype=dtype),), lambda t: nf4.quantize(t, chunk))


@functools.lru_cache(maxsize=64)
def dequantize_rows(numel: int):
    """`get_original_weight` of an NF4 weight of `numel` elements."""
    import torch

    return _record(lambda: nf4.quantize(torch.empty(numel, dtype=torch.bfloat16), 0),
                   lambda *inner: nf4.original_weight(*inner, (numel,)))


def build_load_events(layer_numels: list[int], num_layers: int, other_layer_bytes: int,
                      embedding_bytes: int, head_bytes: int, chunk: int) -> list[tuple]:
    """(time, op, key, nbytes) of building and loading the model the torchtune way (module
    docstring, steps 1-3), at full depth, for `allocator.replay`. `layer_numels`: the NF4 weights
    of one decoder layer in build order; `other_layer_bytes`: the layer's other parameters
    (adapters, norms); `embedding_bytes` / `head_bytes`: the token embedding / the output
    projection and final norm, built after the prototype layer and before its copies (torchtune
    @fef3ed10 models/llama2/_component_builders.py lora_llama2: `layer`, `tok_embeddings`,
    `output_proj`, then `TransformerDecoder(..., norm=RMSNorm(...))`, which clones the layer)."""
    events: list[tuple] = []
    clock, keys = itertools.count(), itertools.count()

    def alloc(nbytes: int) -> int:
        k = next(keys)
        events.append((next(clock), 1, k, nbytes))
        return k

    def free(k: int) -> None:
        events.append((next(clock), -1, k, 0))

    def play(recorded) -> list[int]:
        rows, kept = recorded
        ids = [next(keys) for _ in rows]
        order = sorted([(a, 1, i) for i, (a, _, _) in enumerate(rows)] +
                       [(f, -1, i) for i, (_, f, _) in enumerate(rows) if f >= 0])
        for _, op, i in order:
            events.append((next(clock), op, ids[i], rows[i][2] if op > 0 else 0))
        return [ids[i] for i in kept]

    proto = []
    for n in layer_numels:  # 1. nn.Linear in bf16, to_nf4, the bf16 weight freed
        w = alloc(2 * n)
        proto += play(quantize_rows(n, chunk, False))
        free(w)
    proto.append(alloc(other_layer_bytes))
    alloc(embedding_bytes)
    alloc(head_bytes)
    layers = []
    for _ in range(num_layers):  # 2. copy.deepcopy(layer): to_nf4(get_original_weight())
        inner = []
        for n in layer_numels:
            (w,) = play(dequantize_rows(n))
            inner.append(play(quantize_rows(n, chunk, False)))
            free(w)
        layers.append(inner)
        alloc(other_layer_bytes)
    for k in proto:
        free(k)
    for inner in layers:  # 3. load_state_dict: to_nf4(src.to(device)), the old inner tensors freed
        for j, n in enumerate(layer_numels):
            src = alloc(2 * n)
            new = play(quantize_rows(n, chunk, True))
            for k in inner[j]:
                free(k)
            inner[j] = new
            free(src)
    return events


def build_shape(trace) -> dict:
    """What `build_load_events` needs, from a traced model's parameter table (launcher/steptrace.py
    `ParamTable`): the NF4 weights of decoder layer 0 in module order (each adapted Linear's
    out x in, read off its lora_B [out, r] and lora_A [r, in]), the bytes of that layer's
    parameters (adapters, norms), and of the parameters before and after the layers."""
    p = trace.params
    size = lambda i: int(p.numel[i]) * int(p.element_size[i])  # noqa: E731
    rows = [i for i in range(len(p.names)) if p.tied_to[i] < 0]
    layer0 = [i for i in rows if p.layer[i] == 0]
    a_in = {p.names[i].split(".lora_A.")[0]: p.shapes[i][1] for i in layer0 if ".lora_A." in p.names[i]}
    numels = [int(p.shapes[i][0]) * int(a_in[p.names[i].split(".lora_B.")[0]])
              for i in layer0 if ".lora_B." in p.names[i]]
    return {"layer_numels": numels,
            "other_layer_bytes": sum(size(i) for i in layer0),
            "embedding_bytes": sum(size(i) for i in rows if p.role[i] == Role.EMBEDDING),
            "head_bytes": sum(size(i) for i in rows if p.role[i] in (Role.HEAD, Role.OTHER))}


def build_reserved_bytes(trace, num_layers: int, chunk: int, memo=None) -> tuple[int, int]:
    """(peak reserved, peak needed) bytes of building and loading the full-depth model
    (`build_load_events`, replayed through launcher/memory/allocator.py: needed leaves out the
    cached segments an out-of-memory retry would release); `memo` (launcher/memory/replay.py
    `ReplayMemo`): results kept on disk, keyed by the inputs and this file's and the allocator's
    source text."""
    shape = build_shape(trace)
    here = Path(__file__).resolve().parent
    code = b"".join(f.read_bytes() for f in (Path(__file__), here.parent / "torchao_nf4.py", here / "allocator.py"))
    key = hashlib.blake2b(json.dumps(["torchao_nf4 build", shape, num_layers, chunk]).encode() + code,
                          digest_size=20).hexdigest()
    value = memo.get(key) if memo is not None else None
    if value is None:
        replayed = replay(build_load_events(num_layers=num_layers, chunk=chunk, **shape))
        value = (replayed.peak_reserved, replayed.peak_needed)
        if memo is not None:
            memo.put(key, value)
    return value


def with_build(mem, traces, chunk: int, memo=None):
    """A GPU estimate whose peak reserved is at least the build's (`build_reserved_bytes`): the
    allocator never returns the blocks the build cached, so the step starts with them and its own
    requests are served from them first. Assumption: the step needs no segment the build's cache
    cannot serve, so the run's peak reserved is the larger of the two. For unsharded builds (one
    full model per process; the planner plans torchao NF4 bases so only)."""
    build, build_needed = build_reserved_bytes(traces.depth2, traces.num_layers, chunk, memo)
    note = (f"torchao NF4 (torchtune's build and load): quantizing the weights on the GPU peaks at "
            f"{build / 2**30:.2f} GiB reserved (launcher/torchao_nf4.py, nearest-value search "
            + (f"in chunks of {chunk} elements)" if chunk else "over each whole weight, torchao 0.1)")
            + "; peak reserved is the larger of that and the step's.")
    outside = mem.device_total_bytes - mem.peak_reserved_bytes
    needed = max(mem.needed_bytes, build_needed + outside) if mem.needed_bytes else 0
    if build <= mem.peak_reserved_bytes:
        return replace(mem, notes=tuple(mem.notes) + (note,), needed_bytes=needed)
    return replace(mem, peak_reserved_bytes=build, device_total_bytes=build + outside,
                   notes=tuple(mem.notes) + (note,), needed_bytes=needed)

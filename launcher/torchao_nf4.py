"""torchao's NF4 weights (`torchao.dtypes.nf4tensor.NF4Tensor`), the QLoRA base of torchtune's
recipes (`peft.quant_type=torchao_nf4`): their storage, their forward and backward, and the GPU
memory that building and loading such a model leaves in the caching allocator.

Sources: pytorch/ao torchao/dtypes/nf4tensor.py at v0.1 (ff2889540, the version torchtune 0.1
pins: pytorch/torchtune pyproject.toml @fef3ed10 `torchao==0.1`) and at 6081796bc ("perform in
chunks", pytorch/ao#196, torchao >= 0.2); pytorch/torchtune @fef3ed10:
torchtune/modules/peft/lora.py, torchtune/modules/transformer.py, torchtune/utils/
_register_nf4_dispatch_ops.py, recipes/lora_finetune_single_device.py.

Storage of one weight of n elements (`to_nf4` defaults: blocks of 64, their absmax scalers
quantized again in blocks of 256), `NF4Tensor.from_tensor`:
- quantized_data: uint8 [n / 2] (two 4-bit indices per byte);
- quantized_scalers: int8 [n / 64];
- quantization_factor: `quantization_factor[:, 0]` of a bf16 [n / 64 / 256, 256] tensor, a view
  that keeps the whole tensor's storage (n / 64 x 2 bytes);
- scaler_mean: bf16 scalar; nf4: the bf16 [16] lookup table.

Forward and backward (`LinearNF4`): `F.linear(x, weight.to(x.dtype))` and
`grad @ weight.to(grad.dtype)`, where `to` dequantizes the whole weight (`get_original_weight`:
both nibbles widened to int64, looked up, scaled, stacked); nothing dequantized is saved.

Model build and load (torchtune's single-device recipes, `build_load_events`), all on the GPU:
1. `LoRALinear(quantize_base=True)` creates an `nn.Linear` in bf16 and keeps `to_nf4(weight)`;
   the bf16 weight is freed. Only the Linears that get adapters are NF4; the rest stay bf16.
2. `TransformerDecoder` holds `copy.deepcopy(layer)` per layer (`_get_clones`); cloning an
   NF4Tensor is `to_nf4(get_original_weight())` (torchtune's `clone` dispatch). The prototype
   layer is freed after the model is built.
3. `load_state_dict`: each NF4 weight's `copy_` is `to_nf4(src.to(device))` (the checkpoint's
   16-bit tensor moved to the GPU) and the new inner tensors replace the old ones.
`to_nf4` runs under `torch.no_grad()` (`from_tensor` is decorated). Its nearest-value search
`(value - nf4).abs().min(dim=-1)` materializes [n, 16] bf16 differences twice (64 bytes per
element): for the whole tensor at once in torchao 0.1, in chunks of 1024**2 elements from
torchao 0.2 (`chunk` = 0 or 1048576). The allocator keeps those blocks cached, and the weights
quantized later are carved out of them, so the peak reserved of the build can exceed the
training step's.
"""
from __future__ import annotations

import functools
import itertools

BLOCK = 64
SCALER_BLOCK = 256
CHUNK_TORCHAO_0_2 = 1024**2  # nf4tensor.py CHUNK_SIZE since pytorch/ao#196
NF4_CODE = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
            0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0)


def storage_bytes(numel: int) -> int:
    """Bytes of one NF4 weight of `numel` elements (module docstring)."""
    blocks = numel // BLOCK
    return numel // 2 + blocks + 2 * blocks + 2 + 2 * len(NF4_CODE)


def quantize(tensor, chunk: int):
    """`to_nf4(tensor)`: the ops of `NF4Tensor.from_tensor` (torchao 0.1; `chunk` > 0: the
    chunked nearest-value search of torchao >= 0.2). Returns the inner tensors
    [quantized_data, quantized_scalers, quantization_factor, scaler_mean, nf4]."""
    import torch

    with torch.no_grad():
        t = tensor.to(torch.bfloat16)
        nf4 = torch.tensor(NF4_CODE, device=t.device, dtype=torch.bfloat16)
        flat = t.flatten()
        n_blocks = flat.numel() // BLOCK
        # double_quantize_scalers
        s1 = _block_absmax(flat, BLOCK)
        mean = s1.mean()
        s1 = s1 - mean
        n_sb = s1.numel() // SCALER_BLOCK
        sabs = _block_absmax(s1, SCALER_BLOCK).unsqueeze(-1).expand(n_sb, SCALER_BLOCK)
        factor = 256 / (2 * sabs)
        scalers = (s1.view(n_sb, SCALER_BLOCK) * factor).round().clamp(-128, 127).flatten().to(torch.int8)
        factor = factor[:, 0]
        del s1, sabs
        # convert_to_norm_float_weight
        scaled = flat.view(n_blocks, BLOCK) / _block_absmax(flat, BLOCK).unsqueeze(-1).expand(n_blocks, BLOCK)
        scaled = scaled.flatten()
        if chunk:
            idx = torch.empty(scaled.numel(), dtype=torch.uint8, device=t.device)
            for i in range(0, scaled.numel(), chunk):
                idx[i:i + chunk] = (scaled[i:i + chunk].unsqueeze(-1) - nf4).abs().min(dim=-1).indices
        else:
            idx = (scaled.unsqueeze(-1) - nf4).abs().min(dim=-1).indices
        del scaled
        data = (idx[::2] << 4 | idx[1::2]).to(torch.uint8)
        return [data, scalers, factor, mean, nf4]


def _block_absmax(flat, block: int):
    return flat.view(flat.numel() // block, block).abs().max(dim=1).values


def original_weight(data, scalers, factor, mean, nf4, shape):
    """`NF4Tensor.get_original_weight` (torchao 0.1): the bf16 weight of `shape`."""
    import torch

    first = nf4[(data >> 4).to(torch.long)]
    second = nf4[(data & 0b1111).to(torch.long)]
    n_sb = scalers.numel() // SCALER_BLOCK
    s = (scalers.view(n_sb, SCALER_BLOCK) / factor.unsqueeze(-1)).flatten().to(torch.bfloat16) + mean
    rep = s.unsqueeze(-1).expand(s.size(0), BLOCK // 2)
    first = (first * rep.flatten()).unsqueeze(-1).transpose(0, 1)
    second = (second * rep.flatten()).unsqueeze(-1).transpose(0, 1)
    return torch.stack([first, second], dim=-1).reshape(shape)


@functools.lru_cache(maxsize=1)
def _linear_nf4():
    import torch

    class LinearNF4(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, module):
            ctx.module = module
            return torch.nn.functional.linear(x, _weight(module).to(x.dtype))

        @staticmethod
        def backward(ctx, grad_out):
            return grad_out @ _weight(ctx.module).to(grad_out.dtype), None

    return LinearNF4


def _weight(m):
    return original_weight(m.nf4_data, m.nf4_scalers, m.nf4_factor_storage[:, 0], m.nf4_mean, m.nf4_code,
                           (m.out_features, m.in_features))


def adapted_linears(model) -> list:
    """The nn.Linear each LoRA layer of a peft model wraps (its `base_layer`): torchtune's NF4
    weights (module docstring)."""
    import torch

    return [m.base_layer for m in model.modules() if type(getattr(m, "base_layer", None)) is torch.nn.Linear]


def stand_in(linears) -> None:
    """Turn each bf16 nn.Linear (no bias: torchtune's LoRALinear refuses one) into an NF4 Linear:
    its weight is dropped, the NF4 inner tensors are registered as buffers of their real shapes
    and dtypes, and its forward is `LinearNF4`'s (module docstring)."""
    import torch

    from launcher.errors import ConfigError

    fn = _linear_nf4()
    for m in linears:
        n = m.in_features * m.out_features
        if n % (BLOCK * SCALER_BLOCK):  # from_tensor's own assertion
            raise ConfigError(f"peft.quant_type=torchao_nf4: a {m.out_features} x {m.in_features} weight is not a "
                              f"multiple of {BLOCK * SCALER_BLOCK} elements, which torchao's NF4 needs; "
                              "use peft.quant_type=nf4")
        device = m.weight.device
        del m.weight
        m.weight = None
        m.register_buffer("nf4_data", torch.zeros(n // 2, dtype=torch.uint8, device=device))
        m.register_buffer("nf4_scalers", torch.zeros(n // BLOCK, dtype=torch.int8, device=device))
        m.register_buffer("nf4_factor_storage", torch.ones((n // BLOCK // SCALER_BLOCK, SCALER_BLOCK),
                                                           dtype=torch.bfloat16, device=device))
        m.register_buffer("nf4_mean", torch.zeros((), dtype=torch.bfloat16, device=device))
        m.register_buffer("nf4_code", torch.tensor(NF4_CODE, dtype=torch.bfloat16, device=device))
        m.forward = lambda x, m=m: fn.apply(x, m)


# ----------------------------------------------------------------------------- build and load

def _record(make_inputs, fn) -> tuple[tuple, tuple]:
    """The storages `fn(*make_inputs())` allocates, recorded on fake tensors as the trace records
    a step (launcher/trace.py `_Recorder`): (rows, kept), rows = (alloc event, free event or -1,
    nbytes) in allocation order, kept = the rows alive in `fn`'s result."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from launcher.trace import _dispatch_mode, _Recorder

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
    return _record(lambda: (torch.empty(numel, dtype=dtype),), lambda t: quantize(t, chunk))


@functools.lru_cache(maxsize=64)
def dequantize_rows(numel: int):
    """`get_original_weight` of an NF4 weight of `numel` elements."""
    import torch

    return _record(lambda: quantize(torch.empty(numel, dtype=torch.bfloat16), 0),
                   lambda *inner: original_weight(*inner, (numel,)))


def build_load_events(layer_numels: list[int], num_layers: int, other_layer_bytes: int,
                      embedding_bytes: int, head_bytes: int, chunk: int) -> list[tuple]:
    """(time, op, key, nbytes) of building and loading the model the torchtune way (module
    docstring, steps 1-3), at full depth, for `allocator.replay`. `layer_numels`: the NF4 weights
    of one decoder layer in build order; `other_layer_bytes`: the layer's other parameters
    (adapters, norms); `embedding_bytes` / `head_bytes`: built before / after the layers."""
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

    alloc(embedding_bytes)
    proto = []
    for n in layer_numels:  # 1. nn.Linear in bf16, to_nf4, the bf16 weight freed
        w = alloc(2 * n)
        proto += play(quantize_rows(n, chunk, False))
        free(w)
    proto.append(alloc(other_layer_bytes))
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
    alloc(head_bytes)
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
    from launcher.steptrace import Role

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


def build_reserved_bytes(trace, num_layers: int, chunk: int, memo=None) -> int:
    """Peak reserved bytes of building and loading the full-depth model (`build_load_events`,
    replayed through launcher/memory/allocator.py); `memo` (launcher/memory/replay.py
    `ReplayMemo`): results kept on disk, keyed by the inputs and this file's and the allocator's
    source text."""
    import hashlib
    import json
    from pathlib import Path

    from launcher.memory.allocator import replay

    shape = build_shape(trace)
    here = Path(__file__).resolve().parent
    code = b"".join(f.read_bytes() for f in (Path(__file__), here / "memory" / "allocator.py"))
    key = hashlib.blake2b(json.dumps(["torchao_nf4 build", shape, num_layers, chunk]).encode() + code,
                          digest_size=20).hexdigest()
    value = memo.get(key) if memo is not None else None
    if value is None:
        value = replay(build_load_events(num_layers=num_layers, chunk=chunk, **shape)).peak_reserved
        if memo is not None:
            memo.put(key, value)
    return value


def with_build(mem, traces, strategy, chunk: int, memo=None):
    """A GPU estimate whose peak reserved is at least the build's (`build_reserved_bytes`): the
    allocator never returns the blocks the build cached, so the step starts with them and its own
    requests are served from them first. Assumption: the step needs no segment the build's cache
    cannot serve, so the run's peak reserved is the larger of the two. Modelled for unsharded
    builds (one full model per process: strategy single and ddp)."""
    from dataclasses import replace

    if strategy.backend != "ddp":
        return replace(mem, notes=tuple(mem.notes) + (
            "torchao NF4: the model build's allocator cache is modelled for unsharded builds (strategy "
            "single or ddp) only; this estimate is the training step's.",))
    build = build_reserved_bytes(traces.depth2, traces.num_layers, chunk, memo)
    note = (f"torchao NF4 (torchtune's build and load): quantizing the weights on the GPU peaks at "
            f"{build / 2**30:.2f} GiB reserved (launcher/torchao_nf4.py, nearest-value search "
            + (f"in chunks of {chunk} elements)" if chunk else "over each whole weight, torchao 0.1)")
            + "; peak reserved is the larger of that and the step's.")
    if build <= mem.peak_reserved_bytes:
        return replace(mem, notes=tuple(mem.notes) + (note,))
    grow = build - mem.peak_reserved_bytes
    return replace(mem, peak_reserved_bytes=build, device_total_bytes=mem.device_total_bytes + grow,
                   notes=tuple(mem.notes) + (note,))

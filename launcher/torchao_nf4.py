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

Model build and load (torchtune's single-device recipes; replayed by
launcher/memory/torchao_build.py), all on the GPU:
1. `LoRALinear(quantize_base=True)` creates an `nn.Linear` in bf16 and keeps `to_nf4(weight)`;
   the bf16 weight is freed. Only the Linears that get adapters are NF4; the rest stay bf16.
2. The builder makes one prototype layer, then the token embedding, the output projection and
   the final norm (models/llama2/_component_builders.py lora_llama2), and `TransformerDecoder`
   holds `copy.deepcopy(layer)` per layer (`_get_clones`); cloning an NF4Tensor is
   `to_nf4(get_original_weight())` (torchtune's `clone` dispatch). The prototype layer is freed
   after the model is built.
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

from launcher.errors import ConfigError

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
    """`NF4Tensor.get_original_weight` (torchao 0.1): the bf16 weight of `shape`. Its locals, as
    torchao binds them, stay alive until the final stack: both nibbles widened to int64, their
    looked-up and scaled halves and the scalers (nf4tensor.py @ff2889540 get_original_weight,
    dequantize_scalers, dequantize = `nf4[value]`)."""
    import torch

    first_elements = (data >> 4).to(torch.long)
    second_elements = (data & 0b1111).to(torch.long)
    dequantized_first = nf4[first_elements]
    dequantized_second = nf4[second_elements]
    n_sb = scalers.numel() // SCALER_BLOCK
    scalers = (scalers.view(n_sb, SCALER_BLOCK) / factor.unsqueeze(-1)).flatten().to(torch.bfloat16) + mean
    repeated = scalers.unsqueeze(-1).expand(scalers.size(0), BLOCK // 2)
    scaled_first = dequantized_first * repeated.flatten()
    scaled_second = dequantized_second * repeated.flatten()
    scaled_first = scaled_first.unsqueeze(-1).transpose(0, 1)
    scaled_second = scaled_second.unsqueeze(-1).transpose(0, 1)
    return torch.stack([scaled_first, scaled_second], dim=-1).reshape(shape)


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

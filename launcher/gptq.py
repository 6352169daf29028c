"""GPTQ-quantized bases (a pre-quantized checkpoint loaded through auto-gptq / optimum) under LoRA,
and GPTQ weights for serving.

Every Linear that GPTQ quantizes (all of a decoder block's; not the LM head) is AutoGPTQ's
`QuantLinear` (auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py, the kernel Qwen's Q-LoRA recipe
selects with `disable_exllama=True`), which holds, for `bits` and `group_size`:
- qweight: int32 [in_features // 32 * bits, out_features]  (in x out x bits / 8 bytes);
- qzeros:  int32 [ceil(in_features / group_size), out_features // 32 * bits];
- scales:  fp16  [ceil(in_features / group_size), out_features];
- g_idx:   int32 [in_features];
- bias:    fp16  [out_features] where the layer has one.
In training, a batch of more than `kernel_switch_threshold` (128) rows takes its torch path, which
dequantizes the whole weight on every call: the packed words are shifted into an int32 tensor of
in x out elements, narrowed to int8 (int16 at 8 bits), offset by the unpacked zeros, scaled to an
fp16 [in, out] weight and multiplied; autograd keeps that fp16 weight for the input gradient.
`gptq_stand_in` gives each quantizable Linear these buffers and this forward, so the trace
records the storage, the dequantization temporaries and the saved weight as they are; nothing
about them is a modelled constant. peft does not upcast a GPTQ model's other parameters
(prepare_model_for_kbit_training skips quantization_method == 'gptq').
"""
from __future__ import annotations

import math

GPTQ_BITS = {"gptq_int4": 4, "gptq_int8": 8}
KERNEL_SWITCH_THRESHOLD = 128  # QuantLinear(kernel_switch_threshold=128): larger batches dequantize


def gptq_weight_bytes(in_features: int, out_features: int, bits: int, group_size: int,
                      bias: bool = False) -> int:
    """Bytes of one QuantLinear's buffers (module docstring)."""
    groups = math.ceil(in_features / group_size)
    qweight = in_features // 32 * bits * out_features * 4
    qzeros = groups * (out_features // 32 * bits) * 4
    scales = groups * out_features * 2
    g_idx = in_features * 4
    return qweight + qzeros + scales + g_idx + (out_features * 2 if bias else 0)


def gptq_stand_in(linears, bits: int, group_size: int) -> None:
    """Turn each nn.Linear into a QuantLinear stand-in: its weight is dropped, the GPTQ buffers
    are registered, and its forward dequantizes as QuantLinear's torch path does (module
    docstring). Biases stay the layer's own (16-bit) parameters."""
    import torch

    for m in linears:
        n_in, n_out = m.in_features, m.out_features
        groups = math.ceil(n_in / group_size)
        del m.weight
        m.weight = None
        m.register_buffer("qweight", torch.zeros((n_in // 32 * bits, n_out), dtype=torch.int32))
        m.register_buffer("qzeros", torch.zeros((groups, n_out // 32 * bits), dtype=torch.int32))
        m.register_buffer("scales", torch.zeros((groups, n_out), dtype=torch.float16))
        m.register_buffer("g_idx", torch.zeros((n_in,), dtype=torch.int32))
        m.forward = _forward(m, bits, group_size)


def _forward(m, bits: int, group_size: int):
    import torch

    narrow = torch.int16 if bits == 8 else torch.int8
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)

    def forward(x):
        zeros = torch.bitwise_right_shift(m.qzeros.unsqueeze(2).expand(-1, -1, 32 // bits),
                                          shifts.view(1, 1, -1)).to(narrow)
        torch.bitwise_and(zeros, 2**bits - 1, out=zeros)
        zeros = (zeros + 1).reshape(-1, 1, zeros.shape[1] * zeros.shape[2])
        weight = torch.bitwise_right_shift(m.qweight.unsqueeze(1).expand(-1, 32 // bits, -1),
                                           shifts.view(1, -1, 1)).to(narrow)
        torch.bitwise_and(weight, 2**bits - 1, out=weight)
        weight = weight.reshape(-1, group_size, weight.shape[2])
        weight = m.scales.reshape(-1, 1, m.scales.shape[-1]) * (weight - zeros)
        weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
        out = torch.matmul(x.half(), weight)
        return out + m.bias if m.bias is not None else out

    return forward

"""Liger kernels (`training.liger_kernel`): what they keep in memory, for the tracer.

Liger-Kernel (linkedin/Liger-Kernel) replaces a Llama-family model's RMSNorm, rotary embedding,
SwiGLU MLP and the LM head with its loss by Triton kernels (`apply_liger_kernel_to_llama`,
`_mistral`, `_qwen2`; HF Trainer's `use_liger_kernel`). Triton runs on GPUs only, so the tracer
runs these stand-ins instead: torch autograd Functions that allocate, save and free the same
tensors as Liger's Functions (src/liger_kernel/ops/*.py at 03fd603, the version of Liger's
published Hugging Face benchmarks, examples/huggingface), computing the same values. Work a Triton
kernel keeps in registers is done here over blocks of rows, so its temporaries stay a small
fraction of one activation.

- RMSNorm (`LigerRMSNormFunction`, ops/rms_norm.py): forward allocates the output Y and one rstd
  per row (in the input's dtype) and saves X, W, rstd; backward writes dX into dY's storage and
  sums dW from a rows x hidden buffer (`dW = torch.zeros_like(X)`).
- SwiGLU (`LigerSiLUMulFunction`, ops/swiglu.py): forward allocates c = silu(a) * b and saves a and
  b (the gate and up projections); backward overwrites a and b with their gradients and returns
  them (no new tensor).
- RoPE (`LigerRopeFunction`, ops/rope.py): rotates q and k in place (contiguous in (batch, seq,
  heads, head_dim)) and saves cos and sin; backward rotates dq and dk back in place.
- Fused linear cross-entropy (`LigerFusedLinearCrossEntropyFunction`,
  ops/fused_linear_cross_entropy.py; the model's forward is `lce_forward`,
  transformers/model/*.py): the logits are never materialised. The shifted hidden states are
  split into chunks of next_pow2(ceil(BT / ceil(V / H))) rows; per chunk the logits are computed
  in the input dtype, upcast to fp32, turned into their gradient in place, cast back, scaled,
  and multiplied into grad_input (BT x H) and grad_weight (V x H, `zeros_like(weight)`), both
  kept for backward, which returns them.
"""
from __future__ import annotations

import contextlib
import importlib

FAMILIES = ("llama", "mistral", "qwen2")  # Liger 03fd603 monkey_patch.py: these share modules
KERNELS = ("rope", "rms_norm", "swiglu", "fused_linear_cross_entropy")  # apply_liger_kernel_to_*'s switches
_ROWS = 256  # rows per block where a Triton kernel would work row by row in registers
IGNORE_INDEX = -100


def _functions():
    import torch

    class RMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, X, W, eps):
            shape = X.shape
            X2 = X.contiguous().view(-1, shape[-1])
            Y = torch.empty_like(X2)
            r = torch.empty(X2.shape[0], dtype=X.dtype, device=X.device)
            for i in range(0, X2.shape[0], _ROWS):
                x = X2[i:i + _ROWS].float()
                rr = torch.rsqrt(x.pow(2).mean(-1) + eps)
                Y[i:i + _ROWS] = (x * rr[:, None]).to(X.dtype) * W
                r[i:i + _ROWS] = rr
            ctx.eps = eps
            ctx.save_for_backward(X2, W, r)
            return Y.view(shape)

        @staticmethod
        def backward(ctx, dY):
            X, W, r = ctx.saved_tensors
            shape = dY.shape
            dY2 = dY.contiguous().view(-1, shape[-1])
            dW = torch.zeros_like(X)
            for i in range(0, X.shape[0], _ROWS):
                x, dy, rr = X[i:i + _ROWS].float(), dY2[i:i + _ROWS].float(), r[i:i + _ROWS].float()[:, None]
                xhat = x * rr
                dW[i:i + _ROWS] = (dy * xhat).to(X.dtype)
                g = dy * W.float()
                dx = rr * (g - xhat * (g * xhat).mean(-1, keepdim=True))
                dY2[i:i + _ROWS] = dx.to(dY2.dtype)
            return dY2.view(shape), dW.sum(0), None

    class SiLUMul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            shape = a.shape
            a2, b2 = a.contiguous().view(-1, shape[-1]), b.contiguous().view(-1, shape[-1])
            c = torch.zeros_like(a2)
            for i in range(0, a2.shape[0], _ROWS):
                x = a2[i:i + _ROWS].float()
                c[i:i + _ROWS] = (x * torch.sigmoid(x) * b2[i:i + _ROWS].float()).to(c.dtype)
            ctx.save_for_backward(a2, b2)
            return c.view(shape)

        @staticmethod
        def backward(ctx, dc):
            a, b = ctx.saved_tensors
            dc2 = dc.contiguous().view(a.shape)
            for i in range(0, a.shape[0], _ROWS):
                x, y, g = a[i:i + _ROWS].float(), b[i:i + _ROWS].float(), dc2[i:i + _ROWS].float()
                s = torch.sigmoid(x)
                silu = x * s
                a[i:i + _ROWS] = (g * y * (s * (1 + x * (1 - s)))).to(a.dtype)  # da, in a's storage
                b[i:i + _ROWS] = (g * silu).to(b.dtype)  # db, in b's storage
            shape = dc.shape
            return a.view(shape), b.view(shape)

    def rotate(t, cos, sin, sign):
        """t: (batch, seq, heads, head_dim) contiguous, rotated in place by blocks of positions."""
        half = t.shape[-1] // 2
        for s0 in range(0, t.shape[1], _ROWS):
            blk = t[:, s0:s0 + _ROWS]
            c = cos[:, s0:s0 + _ROWS, None, :]
            s = sin[:, s0:s0 + _ROWS, None, :] * sign
            x1, x2 = blk[..., :half].clone(), blk[..., half:].clone()
            blk[..., :half] = x1 * c[..., :half] - x2 * s[..., :half]
            blk[..., half:] = x2 * c[..., half:] + x1 * s[..., half:]

    class Rope(torch.autograd.Function):
        """One of q, k (Liger rotates both in one kernel; autograd takes an in-place view op one
        output at a time). cos and sin are saved by reference, as Liger saves them."""

        @staticmethod
        def forward(ctx, x, cos, sin):
            xt = x.transpose(1, 2)
            in_place = xt.is_contiguous()  # x: a view of the projection's (batch, seq, heads, dim) output
            xc = xt.contiguous()
            cos, sin = cos.contiguous(), sin.contiguous()
            rotate(xc, cos, sin, 1.0)
            ctx.save_for_backward(cos, sin)
            if in_place:
                ctx.mark_dirty(x)
                return x
            return xc.transpose(1, 2)

        @staticmethod
        def backward(ctx, dx):
            cos, sin = ctx.saved_tensors
            dx = dx.transpose(1, 2).contiguous()
            rotate(dx, cos, sin, -1.0)
            return dx.transpose(1, 2), None, None

    class FusedLinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, target):
            dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
            BT, H = x.shape
            V = weight.shape[0]
            inc = -(-V // H)
            chunk = 1 << max(0, (-(-BT // inc) - 1).bit_length())
            grad_weight = torch.zeros_like(weight)
            grad_input = torch.zeros_like(x)
            loss_1d = torch.zeros(BT, dtype=torch.float32, device=x.device)
            valid = target != IGNORE_INDEX
            total = valid.sum()
            for start in range(0, BT, chunk):
                end = min(start + chunk, BT)
                xc, yc, vc = x[start:end], target[start:end], valid[start:end]
                logits = (xc @ weight.t()).float().contiguous()
                # liger_cross_entropy_kernel, in place: loss = lse - x_y; grad = (softmax - onehot) / n
                n = vc.sum()
                m = logits.amax(-1, keepdim=True)
                picked = logits.gather(1, yc.clamp(min=0)[:, None])
                logits.sub_(m).exp_()
                d = logits.sum(-1, keepdim=True)
                loss_1d[start:end] = torch.where(vc, (m + d.log() - picked).squeeze(1), 0.0)
                logits.div_(d).div_(n)
                logits.scatter_add_(1, yc.clamp(min=0)[:, None], (-1.0 / n).reshape(1, 1).expand(end - start, 1))
                logits.mul_(vc[:, None])
                logits = logits.to(dtype)
                scale = n / total
                grad_logits = logits * scale
                grad_input[start:end] = grad_logits @ weight
                # Liger: addmm(out=grad_weight, alpha=scale); an out= matmul is not autocast, so
                # under autocast with an fp32 weight the chunks are cast to the weight's dtype
                gw = grad_logits if grad_logits.dtype == grad_weight.dtype else grad_logits.to(grad_weight.dtype)
                grad_weight.addmm_(gw.t(), xc if xc.dtype == grad_weight.dtype else xc.to(grad_weight.dtype))
            loss = loss_1d.sum() / total
            ctx.save_for_backward(grad_input.detach(), grad_weight.detach())
            return loss

        @staticmethod
        def backward(ctx, grad_output):
            grad_input, grad_weight = ctx.saved_tensors
            grad_input.mul_(grad_output)
            grad_weight.mul_(grad_output)
            return grad_input, grad_weight, None

    return RMSNorm, SiLUMul, Rope, FusedLinearCrossEntropy


def supported(model_type: str) -> bool:
    return model_type in FAMILIES


def trace_name(kernels) -> str:
    """The trace key's `kernels` value of a set of Liger's kernels: 'liger' for all of them, else
    'liger:' and the applied ones in KERNELS order."""
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        raise ValueError(f"unknown Liger kernels {unknown}; valid: {', '.join(KERNELS)}")
    if not kernels:
        raise ValueError("no Liger kernel named")
    if set(kernels) == set(KERNELS):
        return "liger"
    return "liger:" + ",".join(k for k in KERNELS if k in kernels)


def parse(name: str) -> frozenset:
    """The Liger kernels of a trace key's `kernels` value (`trace_name`); empty for 'torch'."""
    if name == "liger":
        return frozenset(KERNELS)
    if name.startswith("liger:"):
        parts = name[len("liger:"):].split(",")
        trace_name(parts)  # checks them
        return frozenset(parts)
    if name != "torch":
        raise ValueError(f"kernels={name!r}: 'torch', 'liger' or 'liger:<kernel>,...'")
    return frozenset()


@contextlib.contextmanager
def applied(model, kernels=KERNELS):
    """Run `model` (a transformers causal LM of FAMILIES) with the Liger stand-ins of `kernels`
    (KERNELS): its RMSNorm modules, MLPs and causal-LM forward are replaced on the instance; the
    modeling module's `apply_rotary_pos_emb` is replaced while the context is open (forward and
    backward)."""
    from unittest import mock  # imports asyncio: only where a step is traced

    from transformers.modeling_outputs import CausalLMOutputWithPast

    RMSNorm, SiLUMul, Rope, FLCE = _functions()
    model_type = model.config.model_type
    if not supported(model_type):
        raise ValueError(f"Liger kernels are modelled for {', '.join(FAMILIES)}, not {model_type}")
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm") and "rms_norm" in kernels:
            eps = getattr(m, "variance_epsilon", getattr(m, "eps", 1e-6))
            m.forward = (lambda mod, e: lambda h: RMSNorm.apply(h, mod.weight, e))(m, eps)
        elif all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj")) and "swiglu" in kernels:
            m.forward = (lambda mod: lambda x: mod.down_proj(SiLUMul.apply(mod.gate_proj(x), mod.up_proj(x))))(m)
    hidden = model.config.hidden_size

    def lce_forward(input_ids=None, labels=None, **kwargs):
        out = model.model(input_ids=input_ids, **kwargs)
        h = out.last_hidden_state
        shift_hidden = h[..., :-1, :].contiguous().view(-1, hidden)
        shift_labels = labels[..., 1:].contiguous().view(-1)
        return CausalLMOutputWithPast(loss=FLCE.apply(shift_hidden, model.lm_head.weight, shift_labels))

    if "fused_linear_cross_entropy" in kernels:
        model.forward = lce_forward
    modeling = importlib.import_module(type(model).__module__)
    if "rope" not in kernels:
        yield model
        return

    def rope(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
        return Rope.apply(q, cos, sin), Rope.apply(k, cos, sin)

    with mock.patch.object(modeling, "apply_rotary_pos_emb", rope):
        yield model

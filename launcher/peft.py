"""LoRA and QLoRA with HF PEFT: the one place that turns the `peft` config section into a
`peft.LoraConfig` and applies it, for both the estimator's fake-tensor trace and the worker, so the
estimate traces the very modules that train.

`LoraSettings` is plain data (no torch, no peft import) carried by the trace key and run.json.

QLoRA in the trace (`qlora_stand_in`): bitsandbytes' 4-bit kernels cannot run on fake tensors, so
the base model is built in the compute dtype and each Linear that transformers' bitsandbytes
integration would quantize keeps a compute-dtype weight whose *storage bytes* the tracer replaces
by the 4-bit layout of launcher/quant.py (packed weight + quantization constants). Its forward is a
stand-in autograd Function with the allocations of bitsandbytes' `MatMul4Bit` on a training-size
input (bitsandbytes/autograd/_functions.py; on GPU `gemm_4bit` dequantizes and calls F.linear above
a small row count, backends/cuda/ops.py): forward dequantizes the weight into a temporary
compute-dtype copy, multiplies and frees it; nothing is saved for backward but the weight (and,
with `bnb_keeps_input`, the input, as bitsandbytes before 0.43.2 kept it); backward
dequantizes again to compute the input gradient. peft's bnb LoRA layer clones the base output
(peft/tuners/lora/bnb.py Linear4bit.forward, `result = result.clone()`); the stand-in clones too.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Optional

from launcher.errors import ConfigError
from launcher import quant

QUANT_BLOCKSIZE = 64  # bitsandbytes Params4bit default blocksize (bitsandbytes/nn/modules.py)


@dataclass(frozen=True)
class LoraSettings:
    """What `peft.LoraConfig` and the 4-bit base need; `quant_type` None means plain LoRA."""
    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    target_modules: Optional[tuple] = None  # None = PEFT's default for the architecture
    use_dora: bool = False  # DoRA (peft LoraConfig use_dora): a trained magnitude vector per adapted weight
    modules_to_save: Optional[tuple] = None  # modules trained in full next to the adapters (peft copies them)
    train_base: bool = False  # the base trains too (DeepSpeed-Chat's LoRA without --only_optimize_lora)
    quant_type: Optional[str] = None  # None (LoRA) | 'nf4' | 'fp4' (QLoRA) | gptq_* | torchao_nf4
    double_quant: bool = True
    compute_dtype: str = "bfloat16"  # QLoRA: dtype of the frozen base (except 4-bit weights)
    # QLoRA: peft.prepare_model_for_kbit_training casts every 16-bit parameter that is not 4-bit to fp32
    upcast_non_quantized: bool = True
    gptq_group_size: int = 128  # quant_type gptq_*: the checkpoint's group size (launcher/gptq.py)
    # QLoRA: the dtype the packed 4-bit weights are stored as (bitsandbytes quant_storage); None = uint8.
    # Sharded QLoRA stores them in the compute dtype so FSDP shards them (backends/fsdp2/rules.py)
    quant_storage: Optional[str] = None
    # peft get_peft_model(autocast_adapter_dtype=...): False builds the adapters in the model's dtype
    autocast_adapter_dtype: bool = True
    # QLoRA (nf4, fp4): bitsandbytes before 0.43.2 kept each 4-bit matmul's input (peft.bnb_keeps_input)
    bnb_keeps_input: bool = False

    @property
    def method(self) -> str:
        return "lora" if self.quant_type is None else "qlora"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules) if self.target_modules else None
        d["modules_to_save"] = list(self.modules_to_save) if self.modules_to_save else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LoraSettings":
        d = dict(d)
        for key in ("target_modules", "modules_to_save"):
            d[key] = tuple(d[key]) if d.get(key) else None
        return cls(**d)


def settings_from_config(peft_config) -> Optional[LoraSettings]:
    """`launcher.config.PeftConfig` -> LoraSettings, or None for method=none."""
    method = peft_config.method.name
    if peft_config.bnb_keeps_input and (method != "qlora" or peft_config.quant_type.name not in ("nf4", "fp4")):
        raise ConfigError("peft.bnb_keeps_input=true is bitsandbytes' 4-bit matmul: use peft=qlora with "
                          "peft.quant_type=nf4 or fp4, or peft.bnb_keeps_input=false")
    if method == "none":
        return None
    problems = []
    if peft_config.r < 1:
        problems.append(f"peft.r={peft_config.r}: must be at least 1, e.g. peft.r=8")
    if peft_config.alpha <= 0:  # peft scales the adapters' update by alpha / r: 0 trains nothing
        problems.append(f"peft.alpha={peft_config.alpha}: must be positive (the update is scaled by alpha / r), "
                        "e.g. peft.alpha=16")
    if not 0 <= peft_config.dropout < 1:
        problems.append(f"peft.dropout={peft_config.dropout}: must be in [0, 1), e.g. 0.05")
    if peft_config.train_base and method != "lora":
        problems.append("peft.train_base=true trains the base weights, which QLoRA keeps 4-bit and frozen; "
                        "use peft=lora")
    if peft_config.nf4_quantize_chunk < 0:
        problems.append(f"peft.nf4_quantize_chunk={peft_config.nf4_quantize_chunk}: must be 0 (torchao 0.1) "
                        "or a chunk size, e.g. 1048576 (torchao >= 0.2)")
    if problems:
        raise ConfigError(*problems)
    tm = tuple(peft_config.target_modules) if peft_config.target_modules else None
    saved = tuple(peft_config.modules_to_save) if peft_config.modules_to_save else None
    return LoraSettings(r=peft_config.r, alpha=peft_config.alpha, dropout=float(peft_config.dropout),
                        target_modules=tm, use_dora=peft_config.use_dora, modules_to_save=saved,
                        train_base=peft_config.train_base,
                        quant_type=peft_config.quant_type.name if method == "qlora" else None,
                        double_quant=peft_config.double_quant,
                        compute_dtype=peft_config.compute_dtype.name,
                        upcast_non_quantized=peft_config.upcast_non_quantized,
                        gptq_group_size=peft_config.gptq_group_size,
                        autocast_adapter_dtype=peft_config.autocast_adapter_dtype,
                        bnb_keeps_input=peft_config.bnb_keeps_input)


DEFAULT_TARGETS_PEFT_LACKS = {
    # BioGptAttention (transformers models/biogpt/modeling_biogpt.py) is OPT's and BART's attention
    # (q_proj, k_proj, v_proj, out_proj); peft's default for those two is q_proj, v_proj
    "biogpt": ("q_proj", "v_proj"),
}
"""Default LoRA targets of catalogue architectures PEFT has none for: those of PEFT's default for
the architecture whose attention modules they share."""


def default_target_modules(model_type: str) -> list[str]:
    """PEFT's own default LoRA targets for an architecture
    (peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING), else
    `DEFAULT_TARGETS_PEFT_LACKS`."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping

    targets = mapping.get(model_type, DEFAULT_TARGETS_PEFT_LACKS.get(model_type))
    if targets is None:
        raise ConfigError(f"PEFT has no default LoRA target modules for model_type={model_type!r}; "
                          f"set peft.target_modules, e.g. peft.target_modules=[q_proj,v_proj]")
    return list(targets)


def lora_config(settings: LoraSettings, model_type: str):
    """The `peft.LoraConfig` both the trace and the worker apply."""
    from peft import LoraConfig

    targets = list(settings.target_modules) if settings.target_modules else default_target_modules(model_type)
    saved = list(settings.modules_to_save) if settings.modules_to_save else None
    return LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=targets, bias="none", task_type="CAUSAL_LM",
                      use_dora=settings.use_dora, modules_to_save=saved)


def apply_lora(model, settings: LoraSettings, autocast_adapter_dtype: bool = True):
    """`peft.get_peft_model` with our LoraConfig. `autocast_adapter_dtype` (peft's own flag): keep
    adapters of a 16-bit model in fp32 (peft's default); DeepSpeed casts the whole module to its
    16-bit dtype, so its runs pass False. Raises ConfigError when no module matches."""
    from peft import get_peft_model

    cfg = lora_config(settings, model.config.model_type)
    try:
        model = get_peft_model(model, cfg, autocast_adapter_dtype=autocast_adapter_dtype)
    except ValueError as err:
        raise ConfigError(f"peft.target_modules={list(cfg.target_modules)}: "
                          f"{str(err).splitlines()[0]}") from None
    if settings.train_base:  # DeepSpeed-Chat's LoRA without --only_optimize_lora: nothing frozen
        for p in model.parameters():
            p.requires_grad_(True)
    return model


def num_trainable_params(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@contextlib.contextmanager
def fake_tensor_adapter_moves():
    """Let peft create adapters on fake tensors. peft moves each new adapter (and each wrapped
    module) to its base layer's device and dtype with `Module.to` (tuners_utils.py
    `_move_adapter_to_device_of_base_layer`, lora/model.py `_replace_module`); on FakeTensor
    parameters torch 2.13's `Module._apply` must swap tensors and refuses (the parameter has a
    weakref). Inside this context `Module.to` does the same conversion by replacing each parameter
    and buffer that changes, and leaves the others untouched (what `.to` does on real tensors).
    peft's `ModulesToSaveWrapper` deep-copies each saved module (utils/other.py); deep-copying
    FakeTensor parameters corrupts the process, so modules are copied here as the deep copy would
    make them: new parameters and buffers of the same shapes, dtypes and requires_grad."""
    import copy

    import torch

    original = torch.nn.Module.to
    original_deepcopy = copy.deepcopy

    def module_copy(module):
        new = copy.copy(module)
        new.__dict__ = dict(module.__dict__)
        new._parameters = {k: None if p is None else torch.nn.Parameter(torch.empty_like(p), p.requires_grad)
                           for k, p in module._parameters.items()}
        new._buffers = {k: None if b is None else torch.empty_like(b) for k, b in module._buffers.items()}
        new._modules = {k: None if m is None else module_copy(m) for k, m in module._modules.items()}
        return new

    def deepcopy(obj, memo=None, _nil=[]):  # noqa: B006 - copy.deepcopy's own signature
        return module_copy(obj) if isinstance(obj, torch.nn.Module) else original_deepcopy(obj, memo, _nil)

    def to(self, *args, **kwargs):
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        for module in self.modules():
            for table in (module._parameters, module._buffers):
                for key, t in list(table.items()):
                    if t is None:
                        continue
                    cast = dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else None
                    if (device is None or t.device == device) and (cast is None or t.dtype == cast):
                        continue
                    new = t.detach().to(device=device or t.device, dtype=cast or t.dtype)
                    table[key] = (torch.nn.Parameter(new, requires_grad=t.requires_grad)
                                  if isinstance(t, torch.nn.Parameter) else new)
        return self

    torch.nn.Module.to = to
    copy.deepcopy = deepcopy
    try:
        yield
    finally:
        torch.nn.Module.to = original
        copy.deepcopy = original_deepcopy


def quantizable_linears(model) -> list:
    """The Linear modules transformers' bitsandbytes integration replaces by 4-bit ones: every
    `nn.Linear` except `HfQuantizer.get_modules_to_not_convert` (lm_head, tied and keep-in-fp32
    modules), as quantizers/quantizer_bnb_4bit.py decides with `should_convert_module`."""
    import torch
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    return [m for name, m in model.named_modules()
            if type(m) is torch.nn.Linear and should_convert_module(name, skip)]


def upcast_non_quantized(model, quantized) -> None:
    """What `peft.prepare_model_for_kbit_training` does to dtypes (peft/utils/other.py: "cast all
    non INT8 parameters to fp32": every fp16/bf16 parameter that is not a bitsandbytes `Params4bit`
    becomes fp32): embeddings, norms, biases, the LM head and, with them, the hidden states and
    logits they produce. `quantized`: the stand-in's weights, which bitsandbytes would hold as
    Params4bit and which therefore stay as they are."""
    import torch

    skip = {id(w) for w in quantized}
    for param in model.parameters():
        if param.dtype in (torch.float16, torch.bfloat16) and id(param) not in skip:
            param.data = param.data.to(torch.float32)


def expert_parameters(model) -> list:
    """Mixture-of-experts weights stored as one 3D parameter per projection ([num_experts, out, in]:
    transformers 5's `MixtralExperts.gate_up_proj` / `down_proj` and their kind). QLoRA quantizes
    each expert's matrix as bitsandbytes quantizes the per-expert Linear weights of the 2D layout
    (transformers 4's `MixtralBlockSparseTop2MLP.w1/w2/w3` are Linear4bit there), so the 4-bit bytes
    are per expert (launcher/quant.py `four_bit_weight_bytes` x num_experts). Not traced: the
    16-bit copy of one expert's matrix that dequantizing it would make during its matmul
    (transformers 5's experts index the 3D parameter directly)."""
    return [p for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == "experts"
            for p in module.parameters(recurse=False) if p.dim() == 3]


def _dequant_linear(absmax_numel, keeps_input: bool = False):
    """The stand-in for bitsandbytes' MatMul4Bit (module docstring). `absmax_numel(weight)`: the fp32
    block constants that dequantizing a double-quantized weight rebuilds first
    (bitsandbytes/functional.py `dequantize_4bit`: `absmax = dequantize_blockwise(quant_state.absmax,
    quant_state.state2); absmax += quant_state.offset`), alive beside the dequantized weight.
    `keeps_input`: the input is kept for backward too, as bitsandbytes before 0.43.2 kept it
    (`ctx.tensors = (A, B)`; peft.bnb_keeps_input)."""
    import torch

    class DequantLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias):
            # the 4-bit weight itself; the input only where bitsandbytes kept it
            ctx.save_for_backward(*((x, weight) if keeps_input else (weight,)))
            w = weight.clone()  # F.dequantize_4bit(B, quant_state).to(A.dtype)
            out = torch.nn.functional.linear(x, w, bias)
            del w
            return out

        @staticmethod
        def backward(ctx, grad_out):
            weight = ctx.saved_tensors[-1]
            if not ctx.needs_input_grad[0]:
                return None, None, None
            absmax = weight.new_empty(absmax_numel(weight), dtype=torch.float32)
            w = weight.clone()  # MatMul4Bit.backward: F.dequantize_4bit(B, ctx.state).to(grad_output.dtype)
            del absmax
            return torch.matmul(grad_out, w), None, None

    return DequantLinear


def qlora_stand_in(linears, settings: LoraSettings) -> list:
    """Replace the forward of each quantizable Linear by bitsandbytes' `Linear4bit.forward`
    (bitsandbytes/nn/modules.py: the input cast to the compute dtype, `matmul_4bit`, the result cast
    back to the input's dtype: an fp32 copy of every base output where
    `prepare_model_for_kbit_training` made the residual stream fp32) around the MatMul4Bit
    stand-in, plus peft's defensive clone; returns their weights, whose storage bytes become 4-bit.
    The compute dtype is the one the settings pass to `Linear4bit` (transformers:
    `bnb_4bit_compute_dtype`), which keeps `set_compute_type` from replacing it by the input's."""
    import torch

    compute = getattr(torch, settings.compute_dtype)
    blocks = (lambda w: -(-w.numel() // QUANT_BLOCKSIZE)) if settings.double_quant else (lambda w: 0)
    fn = _dequant_linear(blocks, settings.bnb_keeps_input)

    def forward(module):
        return lambda x: fn.apply(x.to(compute), module.weight, module.bias).to(x.dtype).clone()

    for m in linears:
        m.forward = forward(m)
    return [m.weight for m in linears]


def four_bit_storage_bytes(numel: int, settings: LoraSettings, num_matrices: int = 1) -> int:
    """Bytes of a 4-bit weight with its constants (launcher/quant.py, bitsandbytes layout);
    `num_matrices`: a 3D expert parameter holds that many matrices, each quantized on its own."""
    return num_matrices * quant.four_bit_weight_bytes(numel // num_matrices, QUANT_BLOCKSIZE, settings.double_quant,
                                                      quant_type=settings.quant_type)["total_bytes"]


# ----------------------------------------------------------------------------- planning

@dataclass(frozen=True)
class TrainingVariant:
    """What a candidate trains and how: full fine-tuning or adapters, with or without gradient
    checkpointing. The planner multiplies strategies by these (`training_variants`)."""
    trains: str  # 'full' | 'adapters'
    lora: Optional[LoraSettings]
    gradient_checkpointing: bool

    @property
    def peft(self) -> str:
        """The capability-table name of what it trains: none | lora | qlora. A GPTQ checkpoint's
        base is frozen QuantLinear buffers (integer weights, fp16 scales) that a framework holds
        and casts as it holds a frozen 16-bit module, so it is LoRA to the capability tables
        (Qwen's Q-LoRA recipe runs it under DeepSpeed ZeRO-2); bitsandbytes 4-bit weights are not."""
        if self.lora is None:
            return "none"
        return "lora" if self.lora.quant_type is None or self.lora.quant_type.startswith("gptq") else "qlora"

    @property
    def label(self) -> str:
        what = "full" if self.lora is None else (
            f"lora r={self.lora.r}{'+base' if self.lora.train_base else ''}" if self.lora.quant_type is None
            else f"qlora {self.lora.quant_type} r={self.lora.r}")
        return what + (" +ckpt" if self.gradient_checkpointing else "")


def training_variants(config, device: str) -> list[TrainingVariant]:
    """The user's choice first. Under strategy=auto with a peft choice or training.allow_peft,
    gradient checkpointing (and, with allow_peft, LoRA and, on GPUs, QLoRA with the `peft.*`
    settings) are added as ways to fit; without either, only what was asked."""
    t = config.training
    ckpt = t.gradient_checkpointing
    chosen = settings_from_config(config.peft)
    asked = TrainingVariant("full" if chosen is None else "adapters", chosen, ckpt)
    auto = config.strategy.name == "auto"
    if not auto or (chosen is None and not t.allow_peft):
        return [asked]
    out = [asked]
    if chosen is None:
        p = config.peft
        lora = LoraSettings(r=p.r, alpha=p.alpha, dropout=float(p.dropout),
                            target_modules=tuple(p.target_modules) if p.target_modules else None)
        out.append(TrainingVariant("adapters", lora, ckpt))
        if device == "cuda":
            from dataclasses import replace

            qlora = replace(lora, quant_type=p.quant_type.name, double_quant=p.double_quant,
                            compute_dtype=p.compute_dtype.name)
            out.append(TrainingVariant("adapters", qlora, ckpt))
    if not ckpt:
        out += [TrainingVariant(v.trains, v.lora, True) for v in list(out)]
    return out


def trace_fields(lora: Optional[LoraSettings], adapter_autocast: bool, request: dict) -> dict:
    """The TraceKey fields of a LoRA/QLoRA candidate, on top of the strategy's `request`
    (launcher.memory.trace_request). `adapter_autocast`: peft keeps the adapters in fp32 under
    autocast (its backend's Backend.adapter_autocast; DeepSpeed casts the whole module, adapters
    included, to its 16-bit dtype, FSDP2 gathers them in the param dtype); QLoRA's base is built in
    its compute dtype."""
    if lora is None:
        return {}
    out = {"trainable": "lora", "lora_r": lora.r, "lora_alpha": lora.alpha,
           "lora_dropout": lora.dropout, "lora_target_modules": tuple(lora.target_modules or ()),
           "lora_dora": lora.use_dora, "lora_modules_to_save": tuple(lora.modules_to_save or ()),
           "lora_train_base": lora.train_base,
           "quant_type": lora.quant_type, "double_quant": lora.double_quant,
           "bnb_keeps_input": lora.bnb_keeps_input and lora.quant_type in ("nf4", "fp4"),
           "adapter_autocast": adapter_autocast and lora.autocast_adapter_dtype}
    if lora.quant_type is not None:
        out["param_dtype"] = lora.compute_dtype
        gptq = lora.quant_type.startswith("gptq")
        torchao = lora.quant_type == "torchao_nf4"
        out["kbit_upcast"] = lora.upcast_non_quantized and not gptq and not torchao  # peft skips it for GPTQ
        if torchao:  # torchtune builds the whole model, adapters included, in the compute dtype
            out["adapter_autocast"] = False
        out["gptq_group_size"] = lora.gptq_group_size if gptq else 0
    return {**request, **out}


# ----------------------------------------------------------------------------- worker

def quantize_base_4bit(model, settings: LoraSettings, device: str):
    """QLoRA in the worker: every Linear of `quantizable_linears` becomes a
    `bitsandbytes.nn.Linear4bit` holding its weight as `Params4bit` (blocksize 64, the settings'
    quant type and double quantization, compute dtype), quantized when moved to `device`
    (bitsandbytes/nn/modules.py Params4bit._quantize; on cpu with bitsandbytes' CPU kernels). The
    model must be in the compute dtype. With `quant_storage` the packed weight is stored as that
    dtype, and each Params4bit names its module, which keeps the `QuantState` when FSDP swaps the
    parameter for a plain tensor (Linear4bit.forward `fix_4bit_weight_quant_state_from_module`)."""
    import bitsandbytes as bnb
    import torch

    dtype = getattr(torch, settings.compute_dtype)
    storage = getattr(torch, settings.quant_storage) if settings.quant_storage else torch.uint8
    targets = {id(m) for m in quantizable_linears(model)}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) not in targets:
                continue
            new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                    compute_dtype=dtype, compress_statistics=settings.double_quant,
                                    quant_type=settings.quant_type, quant_storage=storage, device="meta")
            new.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False,
                                           compress_statistics=settings.double_quant,
                                           quant_type=settings.quant_type, blocksize=QUANT_BLOCKSIZE,
                                           quant_storage=storage, module=new)
            if child.bias is not None:
                new.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, new)
    return model.to(torch.cuda.current_device() if device == "cuda" else device)

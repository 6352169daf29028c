"""Build the causal LM from the run spec's HF config, and the precision settings around it.

Precision follows Lightning's names:
- '32-true': fp32 weights and compute.
- 'bf16-true': weights, gradients and optimizer state in bf16.
- 'bf16-mixed' / '16-mixed': fp32 weights; with DDP the forward and loss run under
  `torch.autocast` (bf16 / fp16; fp16 on cuda adds a GradScaler); with DeepSpeed the ds_config's
  "bf16" / "fp16" section does the casting, so the model is handed over in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from launcher import checkpointing
from launcher.errors import ConfigError
from launcher.peft import LoraSettings
from launcher.peft import apply_lora, quantize_base_4bit
from launcher.precision import model_dtype

PRECISIONS = ("32-true", "bf16-true", "bf16-mixed", "16-mixed")


@dataclass(frozen=True)
class PrecisionPlan:
    model_dtype: str  # 'float32' | 'bfloat16'
    autocast_dtype: Optional[str]  # None | 'bfloat16' | 'float16'
    grad_scaler: bool


def precision_plan(precision: str, backend: str, device: str) -> PrecisionPlan:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    dtype = model_dtype(precision, backend)  # DeepSpeed: the dtype its engine casts to, so the cast
    # is a no-op and no fp32 copy of a 16-bit model is ever held (on CPU processes the host is the device)
    if backend == "deepspeed" or precision in ("32-true", "bf16-true"):
        return PrecisionPlan(dtype, None, False)
    if precision == "bf16-mixed":
        return PrecisionPlan(dtype, "bfloat16", False)
    return PrecisionPlan(dtype, "float16", device == "cuda")


def build_config(hf_config: dict):
    from transformers import AutoConfig

    if "model_type" not in hf_config:
        raise ConfigError("hf_config has no 'model_type'; it must be a config.json of a transformers model")
    values = dict(hf_config)
    try:
        return AutoConfig.for_model(values.pop("model_type"), **values)
    except ValueError as err:
        raise ConfigError(f"hf_config: {str(err).splitlines()[0]}") from None


def max_positions(config) -> Optional[int]:
    """Longest sequence the position embedding covers; None for position-free models (ALiBi, e.g. BLOOM)."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_seq_len(config, seq_len: int) -> None:
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        raise ConfigError(f"seq_len={seq_len} is larger than the model's maximum of {limit} positions; "
                          f"use seq_len <= {limit}")


def build_model(spec, config, plan: PrecisionPlan):
    """`from_config` (random init, in the target dtype) or `from_pretrained` (local files only)."""
    import torch
    from transformers import AutoModelForCausalLM

    lora = lora_settings(spec)
    dtype = getattr(torch, lora.compute_dtype if lora and lora.quant_type else plan.model_dtype)
    common = dict(attn_implementation=spec.attn_implementation,
                  trust_remote_code=spec.trust_remote_code)
    common[dtype_keyword()] = dtype
    if spec.init == "random":
        model = AutoModelForCausalLM.from_config(config, **common)
    elif spec.init == "pretrained":
        if not spec.pretrained_path:
            raise ConfigError("init='pretrained' needs pretrained_path")
        model = AutoModelForCausalLM.from_pretrained(spec.pretrained_path, local_files_only=True, **common)
    else:
        raise ConfigError(f"init={spec.init!r} is not 'random' or 'pretrained'")
    model.config.use_cache = False
    if spec.liger_kernel:  # GPUs only (the planner says so); HF Trainer's use_liger_kernel path
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        from launcher.liger import KERNELS

        chosen = set(spec.liger_kernels or KERNELS)  # the switches of apply_liger_kernel_to_<family>
        _apply_liger_kernel_to_instance(model=model, **{k: k in chosen for k in KERNELS})
    if spec.gradient_checkpointing:
        checkpointing.enable(model, spec.checkpoint_policy)
    model.train()
    if lora is not None:
        model = apply_peft(model, spec, lora)
    return model


def dtype_keyword() -> str:
    """`dtype` (transformers 5) or `torch_dtype` (transformers 4, e.g. the ColossalAI environment,
    launcher/backends/colossalai/runtime.py) in `from_config` / `from_pretrained`."""
    import transformers

    return "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


def lora_settings(spec):
    """The run's LoRA/QLoRA settings (run.json `peft`), or None for full fine-tuning."""
    peft = getattr(spec, "peft", None)
    return LoraSettings.from_dict(peft) if peft else None


def quantized_base(spec) -> bool:
    """QLoRA: the base is quantized on the device as it is built (launcher/peft.py
    `quantize_base_4bit`), so it arrives there whole, whatever the backend."""
    lora = lora_settings(spec)
    return lora is not None and bool(lora.quant_type)


def apply_peft(model, spec, lora):
    """The same peft.LoraConfig the estimator traced (launcher/peft.py). QLoRA first replaces the
    base Linears by bitsandbytes 4-bit ones on the GPU and, unless `upcast_non_quantized` is off,
    runs peft's `prepare_model_for_kbit_training` as HF's QLoRA recipes do (every other 16-bit
    parameter becomes fp32). DeepSpeed casts the whole module to its 16-bit dtype itself, so peft
    keeps the adapters in the model's dtype there, as it does everywhere with
    `peft.autocast_adapter_dtype=false`."""
    if lora.quant_type is not None:
        model = quantize_base_4bit(model, lora, spec.device)
        if lora.upcast_non_quantized:
            from peft import prepare_model_for_kbit_training

            # checkpointing is enabled by the worker itself (launcher/worker/model.py build_model)
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    autocast = spec.backend != "deepspeed" and lora.autocast_adapter_dtype
    return apply_lora(model, lora, autocast_adapter_dtype=autocast)


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def load_config(spec):
    """The model config: `hf_config` for a random init; for 'pretrained', the checkpoint's own
    config.json (local files only) unless `hf_config` gives a full config with its model_type."""
    if spec.init == "pretrained" and "model_type" not in spec.hf_config:
        from transformers import AutoConfig

        if not spec.pretrained_path:
            raise ConfigError("init='pretrained' needs pretrained_path")
        try:
            return AutoConfig.from_pretrained(spec.pretrained_path, local_files_only=True,
                                              trust_remote_code=spec.trust_remote_code)
        except (OSError, ValueError) as err:
            raise ConfigError(f"cannot read the config in {spec.pretrained_path}: "
                              f"{str(err).strip().splitlines()[0]}") from None
    return build_config(spec.hf_config)

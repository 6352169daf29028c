"""The one precision table: what each Lightning precision name means for the tensors of a run.

- torch backends (DDP, `single`, ColossalAI's TorchDDPPlugin) run the model as asked: *-mixed
  keeps fp32 parameters under autocast, *-true holds parameters in that dtype.
- frameworks that cast the module themselves (DeepSpeed's engine, ColossalAI's LowLevelZero,
  Gemini and HybridParallel models: `module.to(dtype)`) run a 16-bit model without autocast and
  keep their own master weights (deepspeed/runtime/engine.py `_configure_distributed_model`;
  colossalai/booster/plugin/*_plugin.py).
"""
from __future__ import annotations

TORCH = {  # precision -> (param_dtype, autocast_dtype)
    "32-true": ("float32", None), "bf16-mixed": ("float32", "bfloat16"),
    "16-mixed": ("float32", "float16"), "bf16-true": ("bfloat16", None), "16-true": ("float16", None)}
FRAMEWORK = {"32-true": "float32", "bf16-mixed": "bfloat16", "16-mixed": "float16", "bf16-true": "bfloat16"}
"""precision -> dtype of the module a framework casts (DeepSpeed, ColossalAI plugins)."""
TRACE_OPTIMIZER = {"adamw_torch": "adamw_foreach", "adamw_torch_foreach": "adamw_foreach",
                   "adamw_torch_fused": "adamw_fused", "sgd": "sgd", "sgd_plain": "sgd_plain", "adafactor": "adafactor",
                   "adamw_bnb_8bit": "none", "paged_adamw_8bit": "none", "paged_adamw_32bit": "none"}
"""HF optim name -> the optimizer the tracer steps for real (bitsandbytes': modelled, launcher/backends/ddp/layout.py)."""


def model_dtype(precision: str, backend: str) -> str:
    """The dtype the worker builds the model in: DeepSpeed's engine dtype (built as the engine
    casts it, as from_pretrained(dtype=...) loads it), else the torch precision's parameter dtype
    (fp32 under autocast)."""
    return FRAMEWORK.get(precision, "float32") if backend == "deepspeed" else TORCH[precision][0]


def torch_trace_request(workload) -> dict:
    """TraceKey fields of a model run as torch runs it, its torch optimizer traced for real."""
    param_dtype, autocast = TORCH[workload.precision]
    return {"param_dtype": param_dtype, "autocast_dtype": autocast,
            "optimizer": TRACE_OPTIMIZER[workload.state_optimizer]}


def compute_dtype(precision: str) -> str:
    """Key of `Cluster.peak_tflops` for the matmuls of this precision."""
    if precision == "32-true":
        return "fp32"
    return "bf16" if precision.startswith("bf16") else "fp16"

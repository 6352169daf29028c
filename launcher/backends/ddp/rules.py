"""Capability table of torch DDP (`ddp`) and of one unwrapped process (`single`): what the worker
(launcher/backends/ddp/worker.py, launcher/worker/model.py `precision_plan`) runs."""
from __future__ import annotations

from launcher.backends.base import Rules
from launcher.types import Strategy

TORCH_PRECISIONS = frozenset({"32-true", "16-mixed", "bf16-mixed", "bf16-true"})
WHY = {
    "16-true": ("torch trains an fp16 model only with a GradScaler, and the scaler refuses fp16 "
                "gradients (torch/amp/grad_scaler.py unscale_: 'Attempting to unscale FP16 gradients'); "
                "use precision=16-mixed or bf16-true"),
    "qlora:cpu": "QLoRA needs GPU quantized kernels (bitsandbytes, auto-gptq); hardware=cpu has none (use peft=lora)",
}
DDP = Rules(precisions={"cuda": TORCH_PRECISIONS, "cpu": TORCH_PRECISIONS},
            peft=frozenset({"none", "lora", "qlora"}), why=WHY)
SINGLE = Rules(precisions=DDP.precisions, peft=DDP.peft, single_process=True, why=WHY)


def rules(strategy: Strategy) -> Rules:
    return SINGLE if strategy.name == "single" else DDP

"""Capability table of torch DDP (`ddp`) and of one unwrapped process (`single`): what the worker
(launcher/backends/ddp/worker.py, launcher/worker/model.py `precision_plan`) runs. QLoRA runs on
CPU processes too: bitsandbytes (>= 0.45) quantizes `Params4bit` when moved to the CPU and has
CPU kernels for its 4-bit matmul (bitsandbytes/backends/cpu/ops.py)."""
from __future__ import annotations

from launcher.backends.base import Rules
from launcher.types import Strategy

TORCH_PRECISIONS = frozenset({"32-true", "16-mixed", "bf16-mixed", "bf16-true"})
WHY = {
    "optimizer_in_backward": ("its gradients are reduced in buckets after their hooks run, so a parameter "
                              "cannot be stepped in its own hook; use strategy=single"),
    "16-true": ("torch trains an fp16 model only with a GradScaler, and the scaler refuses fp16 "
                "gradients (torch/amp/grad_scaler.py unscale_: 'Attempting to unscale FP16 gradients'); "
                "use precision=16-mixed or bf16-true"),
}
# QLoRA bases: bitsandbytes', torchtune's torchao NF4 (one unsharded model per process,
# launcher/torchao_nf4.py) and GPTQ's (launcher/gptq.py, as its LoRA recipes run it)
QUANT = frozenset({"bitsandbytes", "torchao", "gptq"})
DDP = Rules(precisions={"cuda": TORCH_PRECISIONS, "cpu": TORCH_PRECISIONS},
            peft=frozenset({"none", "lora", "qlora"}), peft_devices={"qlora": frozenset({"cuda", "cpu"})},
            quant=QUANT, kept_gradients=True, why=WHY)
SINGLE = Rules(precisions=DDP.precisions, peft=DDP.peft, peft_devices=DDP.peft_devices, single_process=True,
               optimizer_in_backward=True, kept_gradients=True, quant=QUANT, why=WHY)


def rules(strategy: Strategy) -> Rules:
    return SINGLE if strategy.name == "single" else DDP

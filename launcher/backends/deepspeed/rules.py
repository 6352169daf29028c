"""Capability table of DeepSpeed ZeRO 0-3 with the worker's torch optimizer (DeepSpeed 0.19,
checked by 2-rank gloo CPU runs with a torch AdamW; launcher/backends/deepspeed/worker.py)."""
from __future__ import annotations

from launcher.backends.base import Ask, Rules
from launcher.types import Strategy

WHY = {
    "16-true": ("ZeRO 1-3 keep fp16 master weights only under offload with DeepSpeedCPUAdam (base_optimizer.py "
                "_configure_master_weights), and ZeRO-0 would train fp16 without loss scaling, which the "
                "worker does not do; use precision=16-mixed or bf16-true"),
    "16-mixed": ("DeepSpeed's CPU accelerator lists fp16 only where oneDNN has fp16 kernels "
                 "(deepspeed/accelerator/cpu_accelerator.py supported_dtypes; engine.py raises 'Type fp16 is "
                 "not supported on your device'); use precision=bf16-mixed"),
    "qlora": "QLoRA's 4-bit base runs with torch DDP only (DeepSpeed casts the whole module)",
}
WHY_OFFLOAD = {**WHY, "bf16-true": ("DeepSpeed's bf16 master weights under offload need DeepSpeedCPUAdam "
                                    "(stage_1_and_2.py _enforce_cpu_offload, stage3.py "
                                    "_enforce_optimizer_offload); use precision=bf16-mixed")}
ZERO = Rules(precisions={"cuda": frozenset({"32-true", "16-mixed", "bf16-mixed", "bf16-true"}),
                         "cpu": frozenset({"32-true", "bf16-mixed", "bf16-true"})}, why=WHY)
OFFLOAD = Rules(precisions={"cuda": frozenset({"32-true", "16-mixed", "bf16-mixed"}),
                            "cpu": frozenset({"32-true", "bf16-mixed"})}, why=WHY_OFFLOAD)


def rules(strategy: Strategy) -> Rules:
    return OFFLOAD if strategy.offload_optimizer or strategy.offload_params else ZERO


def problem(strategy: Strategy, ask: Ask) -> str:
    """Offload on CPU processes moves states into the memory they already use."""
    if ask.device == "cpu" and (strategy.offload_optimizer or strategy.offload_params):
        return "offload moves states to host memory, which on CPU processes is the same memory"
    return ""

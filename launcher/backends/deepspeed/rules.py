"""Capability table of DeepSpeed ZeRO 0-3 with the worker's torch optimizer (DeepSpeed 0.19,
checked by 2-rank gloo CPU runs with a torch AdamW; launcher/backends/deepspeed/worker.py)."""
from __future__ import annotations

from dataclasses import replace

from launcher.backends.base import Ask, Rules
from launcher.types import Strategy

WHY = {
    "16-true": ("ZeRO 1-3 keep fp16 master weights only under offload with DeepSpeedCPUAdam (base_optimizer.py "
                "_configure_master_weights), and ZeRO-0 would train fp16 without loss scaling, which the "
                "worker does not do; use precision=16-mixed or bf16-true"),
    "16-mixed": ("DeepSpeed's CPU accelerator lists fp16 only where oneDNN has fp16 kernels "
                 "(deepspeed/accelerator/cpu_accelerator.py supported_dtypes; engine.py raises 'Type fp16 is "
                 "not supported on your device'); use precision=bf16-mixed"),
}
WHY_OFFLOAD = {**WHY, "bf16-true": ("DeepSpeed's bf16 master weights under offload need DeepSpeedCPUAdam "
                                    "(stage_1_and_2.py _enforce_cpu_offload, stage3.py "
                                    "_enforce_optimizer_offload); use precision=bf16-mixed"),
               "qlora": "QLoRA is planned under ZeRO 0-3 without offload; use strategy=zero2 or zero3"}
# QLoRA (`peft_settings`): ZeRO 0-2 hold the 4-bit base whole; ZeRO-3 partitions it, stored as bf16 as
# PEFT's DeepSpeed guide sets it (docs/source/accelerate/deepspeed.md, "Use PEFT QLoRA and DeepSpeed
# with ZeRO3"; zero3.py `zero_numels`); bitsandbytes' CPU kernels run both on CPU processes. GPTQ
# bases (launcher/gptq.py) as Qwen's Q-LoRA recipe runs them under ZeRO-2
ZERO = Rules(precisions={"cuda": frozenset({"32-true", "16-mixed", "bf16-mixed", "bf16-true"}),
                         "cpu": frozenset({"32-true", "bf16-mixed", "bf16-true"})}, why=WHY,
             peft=frozenset({"none", "lora", "qlora"}), peft_devices={"qlora": frozenset({"cuda", "cpu"})},
             quant=frozenset({"bitsandbytes", "gptq"}))
OFFLOAD = Rules(precisions={"cuda": frozenset({"32-true", "16-mixed", "bf16-mixed"}),
                            "cpu": frozenset({"32-true", "bf16-mixed"})}, why=WHY_OFFLOAD,
                quant=frozenset({"bitsandbytes", "gptq"}))


def rules(strategy: Strategy) -> Rules:
    return OFFLOAD if strategy.offload_optimizer or strategy.offload_params else ZERO


def peft_settings(strategy: Strategy, lora):
    """QLoRA under DeepSpeed: the rest of the base stays in the 16-bit dtype. DeepSpeed casts the
    whole module to it (engine.py `_configure_distributed_model`), which undoes
    `prepare_model_for_kbit_training`'s fp32 upcast, and TRL does not run that for a sharded QLoRA
    (trl SFTTrainer `_prepare_peft_model`). The 4-bit weights are integer tensors the cast leaves
    alone; ZeRO-3 stores them in the compute dtype instead (bitsandbytes `quant_storage`), as PEFT's
    DeepSpeed guide sets it, so that it partitions them with the other bf16 parameters."""
    if lora is None or lora.quant_type is None:
        return lora
    if strategy.zero_stage != 3:
        return replace(lora, upcast_non_quantized=False)
    return replace(lora, quant_storage=lora.compute_dtype, upcast_non_quantized=False)


def problem(strategy: Strategy, ask: Ask) -> str:
    """Offload on CPU processes moves states into the memory they already use."""
    if ask.device == "cpu" and (strategy.offload_optimizer or strategy.offload_params):
        return "offload moves states to host memory, which on CPU processes is the same memory"
    return ""

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
    "qlora": ("QLoRA under DeepSpeed is planned with ZeRO-3 only (its 4-bit weights stored as bf16 and "
              "partitioned); use strategy=zero3, or ddp/fsdp2 to run it"),
}
WHY_OFFLOAD = {**WHY, "bf16-true": ("DeepSpeed's bf16 master weights under offload need DeepSpeedCPUAdam "
                                    "(stage_1_and_2.py _enforce_cpu_offload, stage3.py "
                                    "_enforce_optimizer_offload); use precision=bf16-mixed")}
ZERO = Rules(precisions={"cuda": frozenset({"32-true", "16-mixed", "bf16-mixed", "bf16-true"}),
                         "cpu": frozenset({"32-true", "bf16-mixed", "bf16-true"})}, why=WHY)
# PEFT's DeepSpeed guide (docs/source/accelerate/deepspeed.md, "Use PEFT QLoRA and DeepSpeed with
# ZeRO3"): bnb_4bit_quant_storage in the model's 16-bit dtype, so ZeRO-3 partitions the packed
# 4-bit weights as bf16 parameters (zero3.py `zero_numels`); bitsandbytes' CPU kernels run it on CPU
ZERO3 = replace(ZERO, peft=frozenset({"none", "lora", "qlora"}), peft_devices={"qlora": frozenset({"cuda", "cpu"})})
OFFLOAD = Rules(precisions={"cuda": frozenset({"32-true", "16-mixed", "bf16-mixed"}),
                            "cpu": frozenset({"32-true", "bf16-mixed"})}, why=WHY_OFFLOAD)


def rules(strategy: Strategy) -> Rules:
    if strategy.offload_optimizer or strategy.offload_params:
        return OFFLOAD
    return ZERO3 if strategy.zero_stage == 3 else ZERO


def peft_settings(strategy: Strategy, lora):
    """ZeRO-3 QLoRA as PEFT's DeepSpeed guide and TRL run it: the packed 4-bit weights stored in the
    compute dtype (bitsandbytes `quant_storage`), and `prepare_model_for_kbit_training` not run (trl
    SFTTrainer `_prepare_peft_model`: never for a sharded QLoRA, whose 4-bit weights load on the
    CPU under zero3_init), so the rest of the base stays in the compute dtype."""
    if lora is None or lora.quant_type is None or strategy.zero_stage != 3:
        return lora
    return replace(lora, quant_storage=lora.compute_dtype, upcast_non_quantized=False)


def problem(strategy: Strategy, ask: Ask) -> str:
    """Offload on CPU processes moves states into the memory they already use."""
    if ask.device == "cpu" and (strategy.offload_optimizer or strategy.offload_params):
        return "offload moves states to host memory, which on CPU processes is the same memory"
    return ""

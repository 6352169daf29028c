"""Capability table of the ColossalAI plugins (ColossalAI 0.5.0; launcher/backends/colossalai/emit.py
names the plugin of each strategy, launcher/backends/colossalai/worker.py runs it)."""
from __future__ import annotations

from launcher.backends.base import Ask, Rules
from launcher.types import Strategy

TORCH = frozenset({"32-true", "16-mixed", "bf16-mixed", "bf16-true"})  # TorchDDPPlugin: the model as torch DDP runs it
PLUGIN = frozenset({"32-true", "bf16-mixed", "16-mixed"})  # plugin precision fp32 | bf16 | fp16
GEMINI = frozenset({"bf16-mixed", "16-mixed"})  # gemini_plugin.py SUPPORTED_PRECISION = ["fp16", "bf16"]
WHY = {
    "16-true": "the plugins keep fp32 master weights of a 16-bit model: use precision=16-mixed",
    "bf16-true": "the plugins keep fp32 master weights of a 16-bit model: use precision=bf16-mixed",
    "32-true": "GeminiPlugin supports fp16 and bf16 only (gemini_plugin.py SUPPORTED_PRECISION)",
    "lora": "LoRA with ColossalAI plugins is not modelled; use ddp or DeepSpeed zero0-3",
    "qlora": "LoRA with ColossalAI plugins is not modelled; use ddp or DeepSpeed zero0-3",
    "processes": "tensor/pipeline parallelism needs gpus >= 2",
}
NO_LORA = frozenset({"none"})
DDP_LIKE = Rules(precisions={"cuda": TORCH - {"16-true"}, "cpu": TORCH - {"16-true"}}, peft=NO_LORA, why=WHY)
ZERO = Rules(precisions={"cuda": PLUGIN, "cpu": PLUGIN}, peft=NO_LORA, why=WHY)
GEMINI_RULES = Rules(precisions={"cuda": GEMINI}, peft=NO_LORA,
                     why={**WHY, "cpu": "GeminiPlugin has no CPU path (fp32 unsupported, bf16 chunk handling fails)"})
TP = Rules(precisions={"cuda": PLUGIN, "cpu": PLUGIN}, peft=NO_LORA, min_processes=2, why=WHY)
PP = Rules(precisions={"cuda": PLUGIN, "cpu": PLUGIN}, peft=NO_LORA, min_processes=2, why=WHY)


def rules(strategy: Strategy) -> Rules:
    if strategy.name == "cai_ddp":
        return DDP_LIKE
    if strategy.name == "cai_gemini":
        return GEMINI_RULES
    if strategy.pp_size > 1 or strategy.name == "cai_pp":
        return PP
    if strategy.tp_size > 1 or strategy.name == "cai_tp":
        return TP
    return ZERO


def problem(strategy: Strategy, ask: Ask) -> str:
    """ColossalAI is an optional install. (On CPU processes the worker applies the CPU shim,
    launcher/backends/colossalai/cpu.py.)"""
    if "colossalai" not in ask.installed:
        return "ColossalAI is not installed (optional: scripts/setup installs it unless LAUNCHER_SKIP_COLOSSALAI=1)"
    return ""

"""Capability table of the ColossalAI plugins (ColossalAI 0.5.0; launcher/backends/colossalai/emit.py
names the plugin of each strategy, launcher/backends/colossalai/worker.py runs it)."""
from __future__ import annotations

from dataclasses import replace

from launcher.backends.base import OPTIMIZERS, Ask, Rules
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
ADAMW = frozenset({"adamw_torch", "adamw_torch_fused", "adamw_torch_foreach"})
# optimizers whose states ColossalAI's checkpoint IO can save from sharded parameters: every state
# has the parameter's shape, or is a 0-dim step count
SHAPED_STATES = ADAMW | {"sgd"}
UNSHAPED_STATES = ("ColossalAI's checkpoint IO reshapes every optimizer state to its parameter's "
                   "(low_level_optim.py `state_dict`, hybrid_parallel_checkpoint_io.py "
                   "`gather_from_sharded_optimizer_state`), which Adafactor's factored and bitsandbytes' "
                   "8-bit states are not: use adamw_torch or sgd")
SHARDED_WHY = {**WHY, **{o: UNSHAPED_STATES for o in OPTIMIZERS if o not in SHAPED_STATES}}
GEMINI_WHY = {**WHY, "cpu": "GeminiPlugin has no CPU path (fp32 unsupported, bf16 chunk handling fails)",
              **{o: "GeminiOptimizer steps only ColossalAI's FusedAdam, CPUAdam or HybridAdam "
                    "(gemini_optimizer.py `_AVAIL_OPTIM_LIST`): the worker runs HybridAdam in AdamW mode, "
                    "use adamw_torch" for o in OPTIMIZERS if o not in ADAMW}}
DDP_LIKE = Rules(precisions={"cuda": TORCH - {"16-true"}, "cpu": TORCH - {"16-true"}}, peft=NO_LORA, why=WHY)
ZERO = Rules(precisions={"cuda": PLUGIN, "cpu": PLUGIN}, optimizers=SHAPED_STATES, peft=NO_LORA, why=SHARDED_WHY)
GEMINI_RULES = Rules(precisions={"cuda": GEMINI}, optimizers=ADAMW, peft=NO_LORA, why=GEMINI_WHY)
TP = Rules(precisions={"cuda": PLUGIN, "cpu": PLUGIN}, optimizers=SHAPED_STATES, peft=NO_LORA, min_processes=2,
           why=SHARDED_WHY)
PP = Rules(precisions={"cuda": PLUGIN, "cpu": PLUGIN}, peft=NO_LORA, min_processes=2, why=WHY)
PP_SHARDED = replace(PP, optimizers=SHAPED_STATES, why=SHARDED_WHY)


def rules(strategy: Strategy) -> Rules:
    if strategy.name == "cai_ddp":
        return DDP_LIKE
    if strategy.name == "cai_gemini":
        return GEMINI_RULES
    if strategy.pp_size > 1 or strategy.name == "cai_pp":  # sharded states: tensor-parallel or ZeRO
        return PP if strategy.tp_size == 1 and strategy.zero_stage == 0 else PP_SHARDED
    if strategy.tp_size > 1 or strategy.name == "cai_tp":
        return TP
    return ZERO


def problem(strategy: Strategy, ask: Ask) -> str:
    """ColossalAI is an optional install. (On CPU processes the worker applies the CPU shim,
    launcher/backends/colossalai/cpu.py.)"""
    if "colossalai" not in ask.installed:
        return "ColossalAI is not installed (optional: scripts/setup installs it unless LAUNCHER_SKIP_COLOSSALAI=1)"
    return ""

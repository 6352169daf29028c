"""Which Python runs a ColossalAI strategy's ranks.

ColossalAI 0.5.0 pins transformers 4.51.3. Its shardformer (the HybridParallelPlugin behind
`cai_tp` and `cai_pp`) replaces each model family's forwards with its own, written against that
version (colossalai/shardformer/modeling/*.py), so those strategies run only where transformers
4.x is installed. The TorchDDP and LowLevelZero plugins (`cai_ddp`, `cai_zero1/2`) and Gemini
wrap the model unchanged and run with the launcher's own transformers.

`scripts/setup` builds a second environment, `.venv-colossalai` next to the repository's `.venv`
(the same torch, transformers 4.51.3, colossalai 0.5.0 and this package), and the launcher starts
torchrun with that environment's Python for the strategies that need it (`interpreter`,
consulted by launcher/launch.py `worker_python` through the backend registry). Where the
launcher's own environment already has transformers 4.x (e.g. ColossalAI installed with its
dependencies), the ranks run there. `LAUNCHER_COLOSSALAI_PYTHON` names another interpreter
(launcher/environment.py `colossalai_python`).
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Optional

from launcher.environment import COLOSSALAI_VENV, SHARDFORMER, shardformer_python
from launcher.types import Strategy


def uses_shardformer(strategy: Strategy) -> bool:
    """HybridParallelPlugin (tensor or pipeline parallel): ColossalAI's own model forwards."""
    return strategy.tp_size > 1 or strategy.pp_size > 1 or strategy.name in ("cai_tp", "cai_pp")


# Model types whose shardformer forwards keep transformers' SDPA attention correct (ColossalAI 0.5.0
# colossalai/shardformer/{policies,modeling}/*.py under transformers 4.51). Eager elsewhere:
# - OPT's policy maps only eager and flash_attention_2 (policies/opt.py ATTN_IMPLEMENTATION: KeyError 'sdpa');
# - BLOOM has no SDPA path in transformers 4.51;
# - GPT-2's pipeline forward always builds a padding-only mask from `attention_mask`
#   (modeling/gpt2.py `_get_attention_mask`), so transformers' SDPA path sees a mask, sets
#   `is_causal=False` and attends to later tokens; the eager path applies GPT-2's causal `bias`.
SDPA_POLICIES = frozenset({"llama", "mistral", "qwen2"})


def attention(strategy: Strategy, model_type: str, planned: str) -> str:
    """The attention implementation a shardformer strategy's ranks run: eager where the family's
    policy or transformers 4.51 has no SDPA path; the planned one otherwise."""
    if uses_shardformer(strategy) and planned != "eager" and model_type not in SDPA_POLICIES:
        return "eager"
    return planned


def interpreter(strategy: Strategy) -> Optional[str]:
    """The Python torchrun and the ranks run with for `strategy`; None: the launcher's own."""
    if not uses_shardformer(strategy):
        return None
    try:
        installed = version("transformers")
    except PackageNotFoundError:
        installed = "0"
    return shardformer_python(installed) or None


def candidate_problem(strategy: Strategy, spec, env) -> str:
    """Why a planned tensor- or pipeline-parallel candidate cannot run here, or '' (the backend's
    `launch_problem`). A vocabulary that tp does not divide is padded (launcher/tp_shard.py
    `vocab_multiple`), and ColossalAI 0.5.0 cannot checkpoint a padded layer's optimizer state; the
    shardformer's forwards need its transformers (`launch_problem`)."""
    if strategy.tp_size == 1 and strategy.pp_size == 1:
        return ""
    if spec.vocab_size % strategy.tp_size:
        return (f"tp_size={strategy.tp_size} does not divide the vocabulary ({spec.vocab_size}): ColossalAI pads it and "
                "cannot checkpoint the padded layers' optimizer state: estimate only")
    return launch_problem(strategy, env.installed, env.versions.get("transformers", "0"))


def launch_problem(strategy: Strategy, installed: frozenset, transformers_version: str) -> str:
    """Why a shardformer strategy cannot start its ranks here, or ''."""
    if not uses_shardformer(strategy) or SHARDFORMER in installed:
        return ""
    return (f"ColossalAI 0.5.0's shardformer forwards need transformers 4.51 (its pin), this environment has "
            f"transformers {transformers_version} and there is no ColossalAI environment "
            f"({COLOSSALAI_VENV}, built by scripts/setup): estimate only")

"""The parallel degrees a model and a cluster allow: tensor-parallel sizes within a node whose
heads divide evenly, pipeline sizes that divide the GPUs and the layers. Backends with tensor or
pipeline parallelism expand their strategy templates over these (Backend.expand)."""
from __future__ import annotations

from launcher.tp_shard import degree_problem


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]



def tp_degrees(config, spec) -> dict[int, str]:
    """Every tensor-parallel size > 1 that divides the GPUs of a node (TP all-reduces run every
    layer, on the intra-node link) -> why it is invalid for this model, or '' (whole attention and
    KV heads per rank: the shardformer policies assert both, launcher/tp_shard.py
    `degree_problem`)."""
    per_node = config.gpus // max(1, config.nodes)
    return {t: degree_problem(spec.model_type, spec.num_attention_heads, spec.num_key_value_heads, t)
            for t in divisors(per_node) if t > 1}



def tp_sizes(config, spec) -> list[int]:
    """The valid tensor-parallel sizes (`tp_degrees`)."""
    return [t for t, problem in tp_degrees(config, spec).items() if not problem]



def pp_sizes(config, spec) -> list[int]:
    """Pipeline sizes > 1 that divide the GPUs and the decoder layers (equal stages)."""
    return [p for p in divisors(config.gpus) if p > 1 and spec.num_layers % p == 0]


def no_tp_size(config, spec) -> str:
    """Why no tensor-parallel size > 1 can be planned on this cluster, and the GPU counts per node
    that would allow one."""
    per_node = config.gpus // max(1, config.nodes)
    tried = "; ".join(f"tp={t}: {why}" for t, why in tp_degrees(config, spec).items()) or "none above 1"
    heads, kv = spec.num_attention_heads, spec.num_key_value_heads
    valid = [t for t in range(2, 17) if not degree_problem(spec.model_type, heads, kv, t)]  # up to 16 GPUs a node
    return (f"no tensor-parallel size fits {per_node} GPU(s) per node ({tried}); "
            f"tp sizes valid for this model: {valid or 'none'}, so use gpus=<a multiple of one of them per node>")


def tp_size_problem(key: str, tp: int, config, spec, valid: list[int]) -> str:
    """Why the tensor-parallel size a backend's `key` asks for (`tp`) is not one of the `valid`
    ones (`tp_sizes`), or ''."""
    if tp in valid:
        return ""
    per_node = config.gpus // max(1, config.nodes)
    why = tp_degrees(config, spec).get(tp) or f"it does not divide the {per_node} GPUs of a node"
    return f"{key}={tp}: {why}; valid: {valid or 'none'}"

"""cai_tp and cai_pp templates expanded into their DP x TP x PP layouts, and the pipeline's
micro-batches as the step's gradient accumulation."""
from __future__ import annotations

from dataclasses import replace

from launcher import trace
from launcher.backends.colossalai.emit import num_microbatches
from launcher.errors import ConfigError
from launcher.parallel import divisors, no_tp_size, pp_sizes, tp_size_problem, tp_sizes
from launcher.types import Strategy


def expand(template: Strategy, config, spec) -> list[Strategy]:
    """cai_tp: every valid tp_size (or the given one) with colossalai.zero_stage on the DP
    dimension; cai_pp: every valid pp_size (or the given one) x (tp 1 or a valid tp_size), so
    DP x TP x PP combinations are all candidates; the other plugins are their template. Explicit
    sizes that are invalid are a ConfigError."""
    if template.name not in ("cai_tp", "cai_pp"):
        return [template]
    cai = config.colossalai
    tps, pps = tp_sizes(config, spec), pp_sizes(config, spec)
    if not trace.tp_traceable(spec.model_type):  # no config shard and no sharding rule (trace.py, tp_shard.py)
        if cai.tp_size not in (None, 1) or config.strategy.name == "cai_tp":
            raise ConfigError(f"strategy={template.name}: no tensor-parallel sharding rule for model type "
                              f"{spec.model_type} yet; use colossalai.tp_size=1 with cai_pp, or another strategy")
        tps = []
    if cai.tp_size is not None and cai.tp_size != 1 and cai.tp_size not in tps:
        raise ConfigError(tp_size_problem("colossalai.tp_size", cai.tp_size, config, spec, tps))
    if cai.pp_size is not None and cai.pp_size != 1 and cai.pp_size not in pps:
        raise ConfigError(f"colossalai.pp_size={cai.pp_size} must divide gpus ({config.gpus}) and the "
                          f"{spec.num_layers} layers; valid: {pps or 'none'}")
    if cai.zero_stage not in (0, 1, 2):
        raise ConfigError(f"colossalai.zero_stage={cai.zero_stage}; use 0, 1 or 2")
    if template.name == "cai_tp":
        sizes = [cai.tp_size] if cai.tp_size not in (None, 1) else tps
        if not sizes and config.strategy.name == "cai_tp":  # asked for by name, nothing to plan
            raise ConfigError(f"strategy=cai_tp: {no_tp_size(config, spec)}; or strategy=auto")
        return [replace(template, tp_size=t, zero_stage=cai.zero_stage) for t in sizes]
    stage = min(cai.zero_stage, 1)  # hybrid_parallel_plugin.py: ZeRO-2 is not compatible with pp
    out = []
    for p in ([cai.pp_size] if cai.pp_size not in (None, 1) else pps):
        for t in ([cai.tp_size] if cai.tp_size is not None else [1, *tps]):
            if config.gpus % (t * p) == 0:
                out.append(replace(template, pp_size=p, tp_size=t, zero_stage=stage))
    if not out and config.strategy.name == "cai_pp" and not pps:
        valid = [d for d in divisors(spec.num_layers) if d > 1]
        raise ConfigError(f"strategy=cai_pp: no pipeline size > 1 divides both gpus={config.gpus} and the "
                          f"{spec.num_layers} layers; pipeline sizes valid for this model: {valid}, so use "
                          "gpus=<a multiple of one of them>; or strategy=auto")
    if not out and config.strategy.name == "cai_pp":
        raise ConfigError(f"strategy=cai_pp: colossalai.tp_size={cai.tp_size} times any pipeline size in {pps} "
                          f"does not divide gpus={config.gpus}; use a smaller colossalai.tp_size or more GPUs, "
                          "or strategy=auto")
    return out


def grad_accum(strategy: Strategy, config, accum: int) -> int:
    """With pipeline stages the step's micro-batches are the 1F1B micro-batches: without a global
    batch, `colossalai.num_microbatches` of them; with one, its accumulation must be a multiple."""
    if strategy.pp_size <= 1:
        return accum
    m = num_microbatches(config.colossalai, strategy.pp_size)
    if config.training.global_batch_size is None:
        return m
    if accum % m:
        raise ConfigError(f"strategy=cai_pp: gradient accumulation {accum} is not a multiple of "
                          f"colossalai.num_microbatches={m}; change training.global_batch_size")
    return accum

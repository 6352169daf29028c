"""colossalai_plugin.json for a ColossalAI candidate: {"plugin": <class in colossalai.booster.plugin>,
"kwargs": {...}}; the worker builds `plugin_class(**kwargs)` and a `Booster` around it
(launcher/backends/colossalai/worker.py). Pure: every memory-relevant knob is copied from the same
`ColossalAIConfig` / `DDPConfig` the estimators read.

Plugin constructors (ColossalAI 0.5.0, colossalai/booster/plugin/):
- cai_ddp -> TorchDDPPlugin(broadcast_buffers, bucket_cap_mb, find_unused_parameters,
  gradient_as_bucket_view, static_graph) (torch_ddp_plugin.py); precision is the worker's autocast.
- cai_zero1/2 -> LowLevelZeroPlugin(stage, precision, max_norm, reduce_bucket_size_in_m,
  overlap_communication, cpu_offload, master_weights) (low_level_zero_plugin.py).
- cai_gemini -> GeminiPlugin(placement_policy, shard_param_frac, offload_optim_frac,
  offload_param_frac, precision, max_norm, search_range_m, min_chunk_size_m, hidden_dim,
  enable_gradient_accumulation) (gemini_plugin.py); the fractions only with placement 'static'.
- cai_tp / cai_pp -> HybridParallelPlugin(tp_size, pp_size, precision, zero_stage, max_norm,
  num_microbatches, pp_style='1f1b', parallel_output, make_vocab_size_divisible_by, DDP and
  ZeRO bucket sizes, overlap_communication, overlap_p2p) (hybrid_parallel_plugin.py).

Precision (Lightning name -> plugin `precision`): 32-true -> 'fp32', bf16-mixed -> 'bf16',
16-mixed -> 'fp16'; the plugins keep fp32 master weights in every 16-bit mode.
On CPU there are no streams: overlap_communication and overlap_p2p are written False.
"""
from __future__ import annotations

from launcher.config import ColossalAIConfig, DDPConfig, TrainingConfig
from launcher.errors import ConfigError
from launcher.tp_shard import vocab_multiple
from launcher.types import Strategy

PLUGIN_PRECISION = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}
PARALLEL_OUTPUT = True  # HybridParallelPlugin default: the LM-head output stays vocab-sharded

PLUGIN_OF = {"cai_ddp": "TorchDDPPlugin", "cai_zero1": "LowLevelZeroPlugin",
             "cai_zero2": "LowLevelZeroPlugin", "cai_gemini": "GeminiPlugin",
             "cai_tp": "HybridParallelPlugin", "cai_pp": "HybridParallelPlugin"}


def plugin_precision(strategy: Strategy, precision: str) -> str:
    """The plugin's `precision` argument, or ConfigError naming what is supported."""
    supported = dict(PLUGIN_PRECISION)
    if strategy.name == "cai_gemini":  # gemini_plugin.py SUPPORTED_PRECISION = ["fp16", "bf16"]
        supported.pop("32-true")
    if precision not in supported:
        raise ConfigError(f"training.precision={precision} is not supported by strategy={strategy.name}; "
                          f"use one of {', '.join(supported)}")
    return supported[precision]


def overlap(cai: ColossalAIConfig, device: str) -> bool:
    return (device != "cpu") if cai.overlap_communication is None else bool(cai.overlap_communication)


def num_microbatches(cai: ColossalAIConfig, pp_size: int) -> int:
    return cai.num_microbatches if cai.num_microbatches is not None else pp_size


def plugin_config(strategy: Strategy, training: TrainingConfig, cai: ColossalAIConfig, ddp: DDPConfig,
                  device: str, grad_accum_steps: int = 1, vocab_size: int = 0) -> dict:
    """colossalai_plugin.json of one strategy."""
    precision = getattr(training.precision, "value", training.precision)
    name = PLUGIN_OF[strategy.name]
    if name == "TorchDDPPlugin":
        return {"plugin": name, "kwargs": {
            "broadcast_buffers": False, "bucket_cap_mb": ddp.bucket_cap_mb,
            "find_unused_parameters": False, "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
            "static_graph": ddp.static_graph}}
    common = {"precision": plugin_precision(strategy, precision), "max_norm": float(training.max_grad_norm)}
    if name == "LowLevelZeroPlugin":
        return {"plugin": name, "kwargs": {
            **common, "stage": strategy.zero_stage, "reduce_bucket_size_in_m": cai.reduce_bucket_size_in_m,
            "overlap_communication": overlap(cai, device), "cpu_offload": False, "master_weights": True}}
    if name == "GeminiPlugin":
        kwargs = {**common, "placement_policy": cai.placement_policy, "search_range_m": cai.search_range_m,
                  "min_chunk_size_m": cai.min_chunk_size_m,
                  "enable_gradient_accumulation": grad_accum_steps > 1}
        if cai.hidden_dim:
            kwargs["hidden_dim"] = cai.hidden_dim
        if cai.placement_policy == "static":
            kwargs.update(shard_param_frac=cai.shard_param_frac, offload_optim_frac=cai.offload_optim_frac,
                          offload_param_frac=cai.offload_param_frac)
        return {"plugin": name, "kwargs": kwargs}
    kwargs = {**common, "tp_size": strategy.tp_size, "pp_size": strategy.pp_size,
              "zero_stage": strategy.zero_stage, "parallel_output": PARALLEL_OUTPUT,
              "make_vocab_size_divisible_by": vocab_multiple(vocab_size, strategy.tp_size),
              "ddp_bucket_cap_mb": int(ddp.bucket_cap_mb),
              "gradient_as_bucket_view": ddp.gradient_as_bucket_view, "broadcast_buffers": False,
              "zero_bucket_size_in_m": cai.reduce_bucket_size_in_m,
              "overlap_communication": overlap(cai, device), "overlap_p2p": device != "cpu"}
    if strategy.pp_size > 1:
        kwargs.update(pp_style="1f1b", num_microbatches=num_microbatches(cai, strategy.pp_size))
    return {"plugin": name, "kwargs": kwargs}

"""What the FSDP1 backend runs: its strategies and the capability table the planner, the tracer
and the worker all consult.

FSDP1 is torch's `FullyShardedDataParallel` wrapper (torch/distributed/fsdp/
fully_sharded_data_parallel.py): each wrapped unit's parameters are flattened into one
`FlatParameter` and sharded as a whole. It is what `accelerate launch` runs with `fsdp_version: 1`
(Accelerate's default), HF Trainer's `--fsdp "full_shard auto_wrap"` and torchtune before 0.4.
The worker wraps it as those do: one unit per decoder block (`ModuleWrapPolicy`, Accelerate's
`TRANSFORMER_BASED_WRAP`) and the root, `use_orig_params=True` (so frozen and trainable
parameters share a unit, as LoRA needs), `limit_all_gathers=True`, `BACKWARD_PRE` prefetch
(FSDP1's defaults and Accelerate's).

`strategy=auto` plans FSDP2 (`fully_shard`, launcher/backends/fsdp2/), FSDP1's successor in torch;
FSDP1 is planned when asked for by name, for runs made with it.
"""
from __future__ import annotations

from dataclasses import replace

from launcher.backends.base import Rules
from launcher.backends.fsdp2.rules import OPTIMIZERS, PRECISIONS, mixed_precision  # noqa: F401  (emit.py's)
from launcher.types import Strategy

BACKEND = "fsdp1"

STRATEGIES: dict[str, Strategy] = {
    # ShardingStrategy.FULL_SHARD: parameters re-sharded after each unit's forward (ZeRO-3-like)
    "fsdp1": Strategy("fsdp1", BACKEND, zero_stage=3),
    # ShardingStrategy.SHARD_GRAD_OP: unsharded parameters kept from forward to backward (ZeRO-2-like)
    "fsdp1_grad_op": Strategy("fsdp1_grad_op", BACKEND, zero_stage=2),
}

WHY = {
    "16-mixed": "fp16 under FSDP1 needs ShardedGradScaler, which the worker does not run; use bf16-mixed",
    "16-true": "fp16 under FSDP1 needs ShardedGradScaler, which the worker does not run; use bf16-true",
    "qlora": "QLoRA's sharded 4-bit base is planned under strategy=fsdp2; use strategy=fsdp2",
}
FSDP1 = Rules(precisions={"cuda": PRECISIONS, "cpu": PRECISIONS}, optimizers=OPTIMIZERS,
              peft=frozenset({"none", "lora"}), kept_gradients=True, why=WHY)


def rules(strategy: Strategy) -> Rules:
    return FSDP1


def sharding_strategy(strategy: Strategy) -> str:
    """FSDP1's `ShardingStrategy` member name."""
    return "SHARD_GRAD_OP" if strategy.name == "fsdp1_grad_op" else "FULL_SHARD"


def reshard_after_forward(strategy: Strategy) -> bool:
    return sharding_strategy(strategy) == "FULL_SHARD"


def adapter_autocast(precision: str) -> bool:
    """A `FlatParameter` holds one dtype (_flat_param.py `_validate_tensors_to_flatten`: 'must have
    uniform dtype'), so the worker keeps peft's adapters in the model's dtype
    (`autocast_adapter_dtype=False`): fp32 under 32-true and bf16-mixed (an fp32 model), bf16 under
    bf16-true."""
    return False


def peft_settings(strategy: Strategy, lora):
    """LoRA adapters built in the model's dtype (`adapter_autocast`)."""
    return replace(lora, autocast_adapter_dtype=False)

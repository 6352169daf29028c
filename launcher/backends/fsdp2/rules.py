"""What the FSDP2 backend runs: its strategies and the capability table the planner, the tracer
and the worker all consult (one rule, so a plan is never chosen that the worker refuses).

FSDP2 is `torch.distributed.fsdp.fully_shard` (torch/distributed/fsdp/_fully_shard/_fully_shard.py),
applied per decoder block and then to the root, as torchtitan (torchtitan/models/llama3/infra/
parallelize.py `apply_fsdp`) and Accelerate (`fsdp_version: 2`) apply it. Tensor parallelism is
torch's own `parallelize_module` (torch/distributed/tensor/parallel/api.py) on the second
dimension of a 2D DeviceMesh.
"""
from __future__ import annotations

from dataclasses import replace

from launcher.backends.base import Ask, Rules
from launcher import trace
from launcher.errors import ConfigError
from launcher.parallel import no_tp_size, tp_size_problem, tp_sizes
from launcher.types import Strategy

BACKEND = "fsdp2"

STRATEGIES: dict[str, Strategy] = {  # fsdp2_tp: the template; planner.py `fsdp2_tp_layouts` sizes it
    # reshard_after_forward=True: parameters re-sharded after each block's forward (ZeRO-3-like)
    "fsdp2": Strategy("fsdp2", BACKEND, zero_stage=3),
    # reshard_after_forward=False: unsharded parameters kept from forward to backward (ZeRO-2-like)
    "fsdp2_grad_op": Strategy("fsdp2_grad_op", BACKEND, zero_stage=2),
    # CPUOffloadPolicy: sharded parameters, gradients and optimizer step on the host
    "fsdp2_offload": Strategy("fsdp2_offload", BACKEND, zero_stage=3, offload_optimizer=True,
                              offload_params=True),
    # FSDP over the data-parallel mesh dimension, torch TP over tp_size (2D DeviceMesh)
    "fsdp2_tp": Strategy("fsdp2_tp", BACKEND, zero_stage=3, tp_size=2),
}

PRECISIONS = frozenset({"32-true", "bf16-mixed", "bf16-true"})
OPTIMIZERS = frozenset({"adamw_torch", "adamw_torch_foreach", "adamw_torch_fused", "sgd"})
TP_FAMILIES = ("llama", "mistral", "qwen2")  # the plan in tp_plan.py names these modules
WHY = {
    "16-mixed": "fp16 under FSDP2 needs a sharded gradient scaler the worker does not run; use bf16-mixed",
    "16-true": "fp16 under FSDP2 needs a sharded gradient scaler the worker does not run; use bf16-true",
    "qlora": ("QLoRA's 4-bit base is sharded by fsdp2 (and planned under fsdp2_offload), not with tensor parallelism; "
              "use strategy=fsdp2"),
    "cpu": "CPUOffloadPolicy moves shards and the optimizer step to the host; on CPU processes that is the same memory",
}
FSDP2 = Rules(precisions={"cuda": PRECISIONS, "cpu": PRECISIONS}, optimizers=OPTIMIZERS,
              peft=frozenset({"none", "lora", "qlora"}), peft_devices={"qlora": frozenset({"cuda", "cpu"})},
              kept_gradients=True, why=WHY)
# QLoRA with CPUOffloadPolicy: the sharded 4-bit base (bnb_4bit_quant_storage) on the host, gathered
# per block as the GPU plan models it; the worker's GPU path is not exercised here (no GPU to check it on)
OFFLOAD = Rules(precisions={"cuda": PRECISIONS}, optimizers=OPTIMIZERS, peft=frozenset({"none", "lora"}),
                estimate_only={"qlora": "QLoRA with CPU offload of the sharded 4-bit base is planned, not run: "
                                        "estimate only"}, why=WHY)
TP = Rules(precisions={"cuda": PRECISIONS, "cpu": PRECISIONS}, optimizers=OPTIMIZERS, peft=frozenset({"none"}),
           why={**WHY, "lora": "LoRA adapters are not in fsdp2_tp's tensor-parallel plan; use fsdp2"})


def rules(strategy: Strategy) -> Rules:
    if strategy.tp_size > 1:
        return TP
    return OFFLOAD if strategy.offload_params else FSDP2


def problem(strategy: Strategy, ask: Ask) -> str:
    """The 2D mesh must cover the processes: tp_size divides them."""
    if strategy.tp_size > 1 and ask.num_processes % strategy.tp_size:
        return (f"tp_size={strategy.tp_size} does not divide {ask.num_processes} processes; "
                f"use gpus=<a multiple of {strategy.tp_size}>")
    return ""


def peft_settings(strategy: Strategy, lora):
    """Sharded QLoRA as PEFT's FSDP-QLoRA guide and TRL run it: the 4-bit weights are stored in the
    compute dtype (bitsandbytes `quant_storage`, bitsandbytes/nn/modules.py Params4bit), so
    fully_shard shards them as it shards any parameter of that dtype, and
    `prepare_model_for_kbit_training` is not run (trl SFTTrainer `_prepare_peft_model`: never with
    QLoRA + FSDP), so the rest of the base stays in the compute dtype. Other settings: unchanged."""
    if lora is None or lora.quant_type is None:
        return lora
    return replace(lora, quant_storage=lora.compute_dtype, upcast_non_quantized=False)


def reshard_after_forward(strategy: Strategy) -> bool:
    return strategy.name != "fsdp2_grad_op"


def keep_last_block(strategy: Strategy, knobs=None) -> bool:
    """Whether the last decoder block keeps its parameters unsharded from its forward to its
    backward while the other blocks reshard after forward: torchtitan's policy ("As an
    optimization, do not reshard after forward for the last transformer block since FSDP would
    prefetch it immediately", torchtitan 9dec370 torchtitan/parallelisms/parallelize_llama.py
    `apply_fsdp`: `reshard_after_forward = int(layer_id) < len(model.layers) - 1`). It saves one
    all-gather per micro-batch and holds one block's unsharded parameters through the LM head and
    the loss. `knobs`: the fsdp2 config group (`fsdp2.keep_last_block`, default true)."""
    return reshard_after_forward(strategy) and bool(getattr(knobs, "keep_last_block", True))


def mixed_precision(precision: str) -> dict:
    """`MixedPrecisionPolicy` fields (torch/distributed/fsdp/_fully_shard/_fsdp_api.py) for a
    Lightning precision name, as torchtitan sets them (`mixed_precision_param`/`_reduce`):
    bf16-mixed keeps fp32 sharded parameters and optimizer states, all-gathers and computes in
    bf16 and reduce-scatters gradients in fp32; *-true runs in the model's dtype (no policy)."""
    if precision == "bf16-mixed":
        return {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    return {"param_dtype": None, "reduce_dtype": None}


def adapter_autocast(precision: str) -> bool:
    """Whether peft's fp32 adapters compute in fp32 (what the trace must run): without a
    MixedPrecisionPolicy param_dtype (32-true, bf16-true) fully_shard gathers every parameter in its
    own dtype, so the adapters stay fp32 and peft casts their input to fp32; under bf16-mixed the
    policy gathers them in bf16 like every other parameter (_fsdp_param.py `init_dtype_attrs`)."""
    return mixed_precision(precision)["param_dtype"] is None


def model_dtype(precision: str) -> str:
    """The dtype of the sharded parameters (and of the optimizer states)."""
    return "bfloat16" if precision == "bf16-true" else "float32"


def expand(template: Strategy, config, spec) -> list[Strategy]:
    """fsdp2_tp: fsdp2.tp_size, or every valid tensor-parallel size (launcher/parallel.py `tp_sizes`);
    none when no size is valid (a model whose heads no degree of a node divides, one GPU per node, a
    model type without a sharding rule), which is a ConfigError when fsdp2_tp is asked for by name,
    as is an invalid fsdp2.tp_size. The other FSDP2 strategies are their template."""
    if template.name != "fsdp2_tp":
        return [template]
    traceable = trace.tp_traceable(spec.model_type)  # a sharding rule (launcher/tp_shard.py)
    tps = tp_sizes(config, spec) if traceable else []
    t = config.fsdp2.tp_size
    if t is not None and t < 2:
        raise ConfigError(f"fsdp2.tp_size={t}: fsdp2_tp splits tensors over 2 or more GPUs; use fsdp2.tp_size=null "
                          "(every valid size) or strategy=fsdp2 for no tensor parallelism")
    if t and not traceable:
        raise ConfigError(f"fsdp2.tp_size={t}: no tensor-parallel sharding rule for model type {spec.model_type}; "
                          "valid: none")
    if t and t not in tps:
        raise ConfigError(tp_size_problem("fsdp2.tp_size", t, config, spec, tps))
    sizes = [t] if t else tps
    if not sizes and config.strategy.name == "fsdp2_tp":  # asked for by name, nothing to plan
        why = (f"no tensor-parallel sharding rule for model type {spec.model_type} yet" if not traceable
               else no_tp_size(config, spec))
        raise ConfigError(f"strategy=fsdp2_tp: {why}; or strategy=auto")
    return [replace(template, tp_size=t) for t in sizes]


def launch_problem(strategy: Strategy, spec, env=None) -> str:
    """Why a planned FSDP2 candidate cannot run here, or '': the tensor-parallel plan
    (tp_plan.py) names Llama-family modules."""
    if strategy.tp_size > 1 and spec.model_type not in TP_FAMILIES:
        return (f"fsdp2_tp's parallelize plan names Llama-family modules (launcher/backends/fsdp2/tp_plan.py), "
                f"not {spec.model_type}'s: estimate only")
    return ""

"""Which activations a checkpointed decoder layer keeps: `training.checkpoint_policy`.

The tracer and the worker both enable checkpointing through transformers'
`activation_checkpointing_enable` with the keyword arguments this module builds, so the traced
step saves and recomputes exactly what the real run does.

- `full`: the layer keeps only its inputs and recomputes everything in backward
  (torch.utils.checkpoint, non-reentrant; the default of transformers 5).
- `reentrant`: the same with torch's reentrant implementation (`use_reentrant=True`,
  torch/utils/checkpoint.py `CheckpointFunction`): the forward runs under no_grad and saves the
  layer's inputs; the backward recomputes the layer with grad enabled and runs a nested
  `torch.autograd.backward` through it. It is what transformers 4 runs when no
  checkpointing kwargs are given (modeling_utils.py `gradient_checkpointing_enable`:
  `gradient_checkpointing_kwargs = {"use_reentrant": True}`, e.g. 4.51.3; before 4.35, torch's
  own default), so HF Trainer, TRL and PEFT's example scripts of those versions ran it, and
  recipes that pass `use_reentrant: true` still do. It holds more in backward than `full`:
  `CheckpointFunction.backward` keeps the gradient of the layer's output until its nested
  backward returns (one hidden-state tensor on the CPU runs of tests/unit/test_trace.py). Traced,
  like the other policies, through the same checkpoint calls the worker makes.
- `selective_op`: torchtitan's per-op selective activation checkpointing
  (torchtitan/parallelisms/parallelize_llama.py `_apply_ac_to_transformer_block` with
  `selective_ac_option = "op"`, at the commit of its Llama 3.1 H100 benchmarks, 9dec370): inside
  each checkpointed layer the outputs of matrix multiplies, attention kernels and reduce-scatters
  are saved, except every second `aten.mm` of the layer, and everything else is recomputed
  (`torch.utils.checkpoint.create_selective_checkpoint_contexts`, `CheckpointPolicy.MUST_SAVE` /
  `PREFER_RECOMPUTE`). The count of matrix multiplies restarts in every layer (a fresh `meta` per
  checkpoint call). On CPU processes SDPA runs `_scaled_dot_product_flash_attention_for_cpu`, the
  CPU kernel of the flash attention op the GPU runs; it is saved like the GPU's.
"""
from __future__ import annotations

POLICIES = ("full", "reentrant", "selective_op")

DESCRIPTION = {
    "full": "gradient checkpointing: each decoder layer keeps only its inputs and its forward is "
            "recomputed in backward (torch.utils.checkpoint, non-reentrant; training.checkpoint_policy=full)",
    "reentrant": "gradient checkpointing with torch's reentrant checkpoint (use_reentrant=True, "
                 "transformers 4's default; training.checkpoint_policy=reentrant): as the non-reentrant one, "
                 "and each layer's backward also holds the gradient of its output until the nested backward returns",
    "selective_op": "per-op selective checkpointing as torchtitan runs it (training.checkpoint_policy="
                    "selective_op): each decoder layer saves its attention outputs and every other matrix "
                    "multiply and recomputes the rest in backward",
}
"""What the plan assumes of each policy, in its notes (launcher/trace.py `trace_notes`)."""


def _save_list():
    """torchtitan's `_save_list` (parallelize_llama.py @9dec370) plus the CPU flash-attention op."""
    import torch

    aten = torch.ops.aten
    ops = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default,
           aten.abs.default, aten.max.default}
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is not None and hasattr(c10d, "reduce_scatter_tensor"):
        ops.add(c10d.reduce_scatter_tensor.default)
    return frozenset(ops)


def selective_op_context():
    """The `context_fn` of one checkpoint call: torchtitan's op policy with a fresh mm count."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = _save_list()
    mm = torch.ops.aten.mm.default
    meta = {"forward_mm_count": 0, "recompute_mm_count": 0}

    def policy(ctx, func, *args, **kwargs):
        key = ("recompute" if ctx.is_recompute else "forward") + "_mm_count"
        if func == mm:
            meta[key] += 1
        keep = func in save and not (func == mm and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_kwargs(policy: str) -> dict | None:
    """Keyword arguments for `torch.utils.checkpoint.checkpoint` (via transformers'
    `activation_checkpointing_kwargs`); None = transformers' default ({"use_reentrant": False})."""
    if policy not in POLICIES:
        raise ValueError(f"checkpoint policy {policy!r}; expected one of {POLICIES}")
    if policy == "full":
        return None
    if policy == "reentrant":
        return {"use_reentrant": True}
    return {"use_reentrant": False, "context_fn": selective_op_context}


SCRIPT_SETTING = {
    "reentrant": "HF Trainer: gradient_checkpointing=True, gradient_checkpointing_kwargs={'use_reentrant': True}",
    "selective_op": "torchtitan: activation_checkpoint.mode=selective, selective_ac_option=op",
}


def accelerate_fsdp_note(policy: str, file_name: str) -> str:
    """Accelerate's `fsdp_activation_checkpointing` wraps every layer in torch's non-reentrant full
    checkpoint (accelerate/accelerator.py: `checkpoint_wrapper` with `CheckpointImpl.NO_REENTRANT`),
    so an FSDP export turns it on only under the `full` policy. Under another policy: the line that
    says so and where the planned policy is set instead ('' under `full`)."""
    if policy == "full":
        return ""
    return (f"training.checkpoint_policy={policy}: {file_name} leaves fsdp_activation_checkpointing off (Accelerate "
            f"applies non-reentrant full checkpointing); turn on the planned one in the script ({SCRIPT_SETTING[policy]})")


def enable(model, policy: str = "full") -> None:
    """Turn on activation checkpointing of `model`'s decoder layers with `policy`."""
    kwargs = checkpoint_kwargs(policy)
    enable_fn = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5
    if enable_fn is not None:
        enable_fn(activation_checkpointing_kwargs=kwargs)
    else:  # transformers 4 (the ColossalAI environment)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or {"use_reentrant": False})

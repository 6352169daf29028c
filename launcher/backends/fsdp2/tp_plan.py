"""The tensor-parallel plan of a decoder LM as `parallelize_module` plans
(torch/distributed/tensor/parallel/style.py), Megatron's split (arXiv:1909.08053 sec. 3):
attention q/k/v and MLP gate/up `ColwiseParallel` (output features sharded), attention o and
MLP down `RowwiseParallel` (input features sharded, outputs all-reduced), the token embedding
`RowwiseParallel` over the vocabulary (each rank looks up its rows, outputs all-reduced:
torch/distributed/tensor/_ops/_embedding_ops.py MaskPartial), and the LM head `ColwiseParallel`
with `Shard(-1)` outputs kept as DTensor for loss parallelism (cross-entropy on the
vocabulary-sharded logits without gathering them: loss.py). Norms stay replicated (no sequence
parallelism).

The plan is written into the emitted plan JSON (emit.py) and read back by the worker, so what
runs is what was planned.
"""
from __future__ import annotations

LAYER_PLAN = {  # module name inside a decoder layer -> style
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}
ROOT_PLAN = {"model.embed_tokens": "rowwise_embedding", "lm_head": "colwise_loss_parallel"}


def plan_json() -> dict:
    return {"layers": "model.layers.*", "layer_plan": dict(LAYER_PLAN), "root_plan": dict(ROOT_PLAN)}


def style(name: str):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name == "rowwise_embedding":
        return RowwiseParallel(input_layouts=Replicate())
    if name == "colwise_loss_parallel":
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    raise ValueError(f"unknown tensor-parallel style {name!r}")


def apply(model, tp_mesh, plan: dict) -> None:
    """`parallelize_module` on the root's modules and on each decoder layer's modules."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, {k: style(v) for k, v in plan["root_plan"].items()})
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, {k: style(v) for k, v in plan["layer_plan"].items()})


def decoder_layers(model) -> list:
    """The repeated decoder blocks of a transformers causal LM (or of a PEFT wrapper around one):
    the largest `nn.ModuleList` of the model, as launcher/trace.py `_watch_layers` finds them."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []

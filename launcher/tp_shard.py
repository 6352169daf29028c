"""One tensor-parallel rank's shard of a transformers model, made by applying a family's 1D
tensor-parallel rule to the built (fake-tensor) model, as ColossalAI's shardformer policy for that
family replaces its modules (colossalai/shardformer/policies/<family>.py, 0.5.0):

- column-parallel Linears (`Linear1D_Col`, and `GPT2FusedLinearConv1D_Col` for GPT-2's fused
  Conv1D): output features / tp;
- row-parallel Linears (`Linear1D_Row`): input features / tp, the bias kept whole (added after the
  all-reduce);
- the attention modules' head count and width attributes divided by tp (the policies'
  `attribute_replacement`), so the model's own forward reshapes to the rank's heads;
- the token embedding and the LM head vocabulary-parallel (`VocabParallelEmbedding1D`,
  `VocabParallelLMHead1D`): the padded vocabulary / tp rows (trace.py `tp_padded_vocab`);
- norms, position embeddings and everything else replicated.

Families whose config can say all of this (Llama, Mistral, Qwen2) are traced as a smaller config
of the same kind instead (trace.py `tp_shard_config`); this module serves the families whose
shard no config expresses: fused QKV projections, a head size tied to the hidden size, an MLP
width fixed by the code (BLOOM, OPT, GPT-2). The all-reduce and gather buffers that a shard
model does not allocate are added by launcher/backends/colossalai/layout.py, as for the config shards.
"""
from __future__ import annotations

from dataclasses import dataclass, field

VOCAB_MULTIPLE = 64  # HybridParallelPlugin make_vocab_size_divisible_by default


def vocab_multiple(vocab_size: int, tp_size: int) -> int:
    """`make_vocab_size_divisible_by` for HybridParallelPlugin: the largest power of two up to the
    plugin's default 64 that divides each rank's vocabulary shard, so the vocab-parallel embedding
    and LM head are not padded (colossalai/shardformer/layer/embedding.py `VocabParallelEmbedding1D`
    and linear.py `VocabParallelLMHead1D` pad to a multiple of `make_vocab_size_divisible_by x
    tp_size`). ColossalAI 0.5.0 cannot save the sharded optimizer state of a padded layer
    (checkpoint_io/utils.py `search_tp_partition_dim` asserts original == tp x shard rows), and an
    unpadded shard also holds no dead rows. A vocabulary that tp does not divide must be padded:
    the default 64 is kept (launcher/backends/colossalai/runtime.py `candidate_problem` says the run
    cannot checkpoint)."""
    if vocab_size <= 0 or vocab_size % tp_size:
        return VOCAB_MULTIPLE
    shard, multiple = vocab_size // tp_size, 1
    while multiple < VOCAB_MULTIPLE and shard % (2 * multiple) == 0:
        multiple *= 2
    return multiple


@dataclass(frozen=True)
class ShardRule:
    """A family's 1D tensor-parallel rule, relative to each decoder block."""

    blocks: str  # dotted path of the decoder-block list in the causal-LM model
    column: tuple  # block-relative paths of column-parallel Linears / Conv1Ds
    row: tuple  # block-relative paths of row-parallel Linears / Conv1Ds
    divided: tuple  # block-relative attributes divided by tp (head counts, widths)
    model_divided: tuple = ()  # model-relative attributes divided by tp (e.g. BLOOM's alibi heads)
    embedding: str = ""  # model-relative path of the token embedding (vocabulary-parallel)
    lm_head: str = "lm_head"
    heads: str = "num_attention_heads"  # config field the head count is read from
    kv_heads: str = ""  # config field of the key/value head count (grouped-query attention), if any
    heads_per_group: int = 1  # heads per rank must also divide by this (CodeGen's mp_num groups)


RULES = {
    # colossalai/shardformer/policies/llama.py LlamaPolicy.module_policy (transformers 5 reshapes by
    # head_dim, so no attribute changes); Llama is traced as a config shard (trace.py), and this rule
    # is the cross-check that both ways give the same shard (tests/unit/test_tp_shard.py)
    "llama": ShardRule(
        blocks="model.layers",
        column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
        row=("self_attn.o_proj", "mlp.down_proj"),
        divided=(),
        embedding="model.embed_tokens", kv_heads="num_key_value_heads"),
    # colossalai/shardformer/policies/bloom.py BloomPolicy.module_policy / BloomForCausalLMPolicy
    "bloom": ShardRule(
        blocks="transformer.h",
        column=("self_attention.query_key_value", "mlp.dense_h_to_4h"),
        row=("self_attention.dense", "mlp.dense_4h_to_h"),
        divided=("self_attention.hidden_size", "self_attention.split_size", "self_attention.num_heads"),
        model_divided=("transformer.num_heads",),
        embedding="transformer.word_embeddings", heads="n_head"),
    # colossalai/shardformer/policies/opt.py OPTPolicy.module_policy / OPTForCausalLMPolicy
    "opt": ShardRule(
        blocks="model.decoder.layers",
        column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1"),
        row=("self_attn.out_proj", "fc2"),
        divided=("self_attn.embed_dim", "self_attn.num_heads"),
        embedding="model.decoder.embed_tokens"),
    # colossalai/shardformer/policies/gpt2.py GPT2Policy.module_policy / GPT2LMHeadModelPolicy
    "gpt2": ShardRule(
        blocks="transformer.h",
        column=("attn.c_attn", "mlp.c_fc"),
        row=("attn.c_proj", "mlp.c_proj"),
        divided=("attn.embed_dim", "attn.split_size", "attn.num_heads"),
        embedding="transformer.wte"),
    # colossalai/shardformer/policies/gptj.py GPTJPolicy.module_policy
    "gptj": ShardRule(
        blocks="transformer.h",
        column=("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"),
        row=("attn.out_proj", "mlp.fc_out"),
        divided=("attn.embed_dim", "attn.num_attention_heads"),
        embedding="transformer.wte"),
    # The families below have no shardformer policy in ColossalAI 0.5.0; their rule is the same
    # Megatron-LM split (arXiv:1909.08053 sec. 3) the policies apply to their closest relatives:
    # GPT-Neo as GPT-J (separate q/k/v), CodeGen as GPT-J with its fused qkv_proj split by column
    # (its 4 mp_num groups need heads per rank divisible by 4), BioGPT as OPT, Phi and Gemma as Llama.
    "gpt_neo": ShardRule(
        blocks="transformer.h",
        column=("attn.attention.q_proj", "attn.attention.k_proj", "attn.attention.v_proj", "mlp.c_fc"),
        row=("attn.attention.out_proj", "mlp.c_proj"),
        divided=("attn.attention.embed_dim", "attn.attention.num_heads"),
        embedding="transformer.wte"),
    "codegen": ShardRule(
        blocks="transformer.h",
        column=("attn.qkv_proj", "mlp.fc_in"),
        row=("attn.out_proj", "mlp.fc_out"),
        divided=("attn.embed_dim", "attn.num_attention_heads"),
        embedding="transformer.wte", heads_per_group=4),
    "biogpt": ShardRule(
        blocks="biogpt.layers",
        column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1"),
        row=("self_attn.out_proj", "fc2"),
        divided=("self_attn.embed_dim", "self_attn.num_heads"),
        embedding="biogpt.embed_tokens", lm_head="output_projection"),
    "phi": ShardRule(
        blocks="model.layers",
        column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc1"),
        row=("self_attn.dense", "mlp.fc2"),
        divided=(),
        embedding="model.embed_tokens", kv_heads="num_key_value_heads"),
    "gemma": ShardRule(
        blocks="model.layers",
        column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
        row=("self_attn.o_proj", "mlp.down_proj"),
        divided=(),
        embedding="model.embed_tokens", kv_heads="num_key_value_heads"),
}


def shardable(model_type: str) -> bool:
    return model_type in RULES


def _get(obj, path: str):
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj


def _set(obj, path: str, value) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(obj, parent), name, value)


def _sharded(module, tp: int, column: bool):
    """A plain module of the rank's shard shape, in the original's dtype (nn.Linear weights are
    [out, in]; transformers' Conv1D weights are [in, out])."""
    import torch
    from transformers.pytorch_utils import Conv1D

    w = module.weight
    kw = {"dtype": w.dtype, "device": w.device}
    bias = module.bias is not None
    if isinstance(module, Conv1D):  # built in the default dtype, its parameters replaced in place of .to()
        n_in, n_out = w.shape
        n_in, n_out = (n_in, n_out // tp) if column else (n_in // tp, n_out)
        conv = Conv1D(n_out, n_in)
        conv.weight = torch.nn.Parameter(torch.empty(n_in, n_out, **kw))
        conv.bias = torch.nn.Parameter(torch.empty(n_out, **kw))
        return conv
    n_out, n_in = w.shape
    if column:
        return torch.nn.Linear(n_in, n_out // tp, bias=bias, **kw)
    return torch.nn.Linear(n_in // tp, n_out, bias=bias, **kw)


def degree_problem(model_type: str, num_heads: int, num_kv_heads: int, tp: int) -> str:
    """Why `tp` is not a valid tensor-parallel degree for these head counts, or '': every rank must
    hold whole attention heads and whole key/value heads (the policies assert it) and, for CodeGen,
    whole groups of heads."""
    rule = RULES.get(model_type)
    per_group = rule.heads_per_group if rule else 1
    if num_heads % (tp * per_group):
        return (f"tp_size={tp} does not divide the {num_heads} attention heads"
                + (f" into groups of {per_group} per rank" if per_group > 1 else ""))
    if num_kv_heads % tp:
        return f"tp_size={tp} does not divide the {num_kv_heads} key/value heads"
    return ""


def shard_problem(config, tp: int) -> str:
    """Why `tp` is not a valid degree for this config under its rule, or ''."""
    rule = RULES.get(config.model_type)
    if rule is None:
        return f"no tensor-parallel sharding rule for model_type {config.model_type!r}"
    heads = getattr(config, rule.heads)
    kv = (getattr(config, rule.kv_heads, None) if rule.kv_heads else None) or heads
    return degree_problem(config.model_type, heads, kv, tp)


def shard_model(model, tp: int, padded_vocab: int) -> None:
    """Replace, in place, the modules of `model` (a transformers causal LM) by those one rank of
    `tp` holds under its family's rule (module docstring); `padded_vocab`: the vocabulary the
    vocab-parallel layers pad to."""
    import torch

    config = model.config
    problem = shard_problem(config, tp)
    if problem:
        raise ValueError(problem)
    rule = RULES[config.model_type]
    for block in _get(model, rule.blocks):
        for path in rule.column:
            _set(block, path, _sharded(_get(block, path), tp, True))
        for path in rule.row:
            _set(block, path, _sharded(_get(block, path), tp, False))
        for path in rule.divided:
            _set(block, path, _get(block, path) // tp)
    for path in rule.model_divided:
        _set(model, path, _get(model, path) // tp)
    emb = _get(model, rule.embedding)
    shard = torch.nn.Embedding(padded_vocab // tp, emb.weight.shape[1], dtype=emb.weight.dtype,
                               device=emb.weight.device)
    _set(model, rule.embedding, shard)
    head = _get(model, rule.lm_head)
    new_head = torch.nn.Linear(head.weight.shape[1], padded_vocab // tp, bias=head.bias is not None,
                               dtype=head.weight.dtype, device=head.weight.device)
    if getattr(config, "tie_word_embeddings", False):
        new_head.weight = shard.weight
    _set(model, rule.lm_head, new_head)
    config.vocab_size = padded_vocab // tp

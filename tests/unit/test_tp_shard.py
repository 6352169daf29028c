"""Tensor-parallel shards made by a family's rule (launcher/tp_shard.py): for Llama the rule gives
the same traced step as the config shard the planner uses (and cai_tp runs measure that one within
1% on CPU); for BLOOM, OPT and GPT-2 the shard holds exactly its share of every weight."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from launcher import trace as tr  # noqa: E402
from launcher.tp_shard import shard_problem  # noqa: E402

VOCAB = 320


def key(cfg, tp, **kw):
    fields = dict(num_layers=2, micro_batch_size=2, seq_len=64, tp_size=tp, optimizer="none")
    fields.update(kw)
    return tr.TraceKey(tr.canonical_config_json(cfg), **fields)


def test_llama_rule_shard_traces_as_the_config_shard(monkeypatch):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, num_hidden_layers=2)
    by_config = tr.trace_step(key(cfg, 2))
    monkeypatch.setattr(tr, "TP_SHARDABLE", ())
    by_rule = tr.trace_step(key(cfg, 2))
    assert by_rule.params.numel.tolist() == by_config.params.numel.tolist()
    assert int(by_rule.live_curve().max()) == int(by_config.live_curve().max())
    step = lambda t: sorted(t.nbytes[t.alloc >= t.phases["forward"][0]].tolist())  # noqa: E731
    assert step(by_rule) == step(by_config)  # every storage of the step (the rule's build also made the full weights)


CONFIGS = {
    "bloom": (transformers.BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=VOCAB), 4 * 64),
    "opt": (transformers.OPTConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, ffn_dim=256,
                                   vocab_size=VOCAB, word_embed_proj_dim=64, max_position_embeddings=256), 256),
    "gpt2": (transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=VOCAB, n_positions=256), 4 * 64),
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_rule_shard_holds_its_share_of_every_weight(family):
    """Per layer the attention projections (4 h^2) and the MLP (2 h f) are split over tp with their
    column biases (3h + f); the vocabulary-parallel embedding is split; the rest (norms, positions,
    row biases) is whole. Counted from the architecture, not from the code under test."""
    cfg, ffn = CONFIGS[family]
    h, layers = 64, 2
    full = tr.trace_step(key(cfg, 1, attn_implementation="eager"))
    shard = tr.trace_step(key(cfg, 2, attn_implementation="eager"))
    count = lambda t: int(t.params.numel[t.params.tied_to < 0].sum())  # noqa: E731
    split = layers * (4 * h * h + 2 * h * ffn + 3 * h + ffn) + VOCAB * h
    assert count(full) - count(shard) == split // 2
    assert shard.live_curve().max() < full.live_curve().max()


def test_invalid_degree_is_one_reason():
    cfg = transformers.BloomConfig(hidden_size=96, n_head=6, n_layer=2, vocab_size=VOCAB)
    assert shard_problem(cfg, 4) == "tp_size=4 does not divide the 6 attention heads"
    assert shard_problem(cfg, 3) == ""
    assert "no tensor-parallel sharding rule" in shard_problem(transformers.FalconConfig(), 2)
    gemma = transformers.GemmaConfig(num_attention_heads=8, num_key_value_heads=1)
    assert shard_problem(gemma, 2) == "tp_size=2 does not divide the 1 key/value heads"


TINY = {
    "gptj": lambda: transformers.GPTJConfig(n_embd=64, n_head=4, n_layer=2, vocab_size=VOCAB, n_positions=256,
                                            rotary_dim=8),
    "gpt_neo": lambda: transformers.GPTNeoConfig(hidden_size=64, num_heads=4, num_layers=2, vocab_size=VOCAB,
                                                 max_position_embeddings=256,
                                                 attention_types=[[["global", "local"], 1]], window_size=32),
    "codegen": lambda: transformers.CodeGenConfig(n_embd=128, n_head=8, n_layer=2, vocab_size=VOCAB,
                                                  n_positions=256, rotary_dim=8),
    "biogpt": lambda: transformers.BioGptConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                                intermediate_size=256, vocab_size=VOCAB, max_position_embeddings=256),
    "phi": lambda: transformers.PhiConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                          intermediate_size=256, vocab_size=VOCAB),
    "gemma": lambda: transformers.GemmaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=16, num_hidden_layers=2, intermediate_size=256,
                                              vocab_size=VOCAB),
}


@pytest.mark.parametrize("family", sorted(TINY) + sorted(CONFIGS))
def test_every_rule_halves_its_split_weights_and_keeps_the_rest(family):
    """Traced at tp=2, each weight the rule splits (by name) holds half its elements, the token
    embedding and LM head half the vocabulary, and every other parameter is whole."""
    from launcher.tp_shard import RULES

    cfg = TINY[family]() if family in TINY else CONFIGS[family][0]
    rule = RULES[cfg.model_type]
    full = tr.trace_step(key(cfg, 1, attn_implementation="eager")).params
    shard = tr.trace_step(key(cfg, 2, attn_implementation="eager")).params
    split = tuple(f"{p}.weight" for p in rule.column + rule.row) + (f"{rule.embedding}.weight", f"{rule.lm_head}.weight")
    column_biases = tuple(f"{p}.bias" for p in rule.column) + (f"{rule.lm_head}.bias",)
    sizes = lambda p: dict(zip(p.names, p.numel.tolist()))  # noqa: E731
    f, s = sizes(full), sizes(shard)
    assert f.keys() == s.keys()
    for name, n in f.items():
        halved = name.endswith(split) or name.endswith(column_biases)
        assert s[name] == (n // 2 if halved else n), name
    assert any(name.endswith(split) for name in f)

"""ColossalAI arithmetic against hand-computed cases: Gemini's chunk search and packing
(colossalai/zero/gemini/chunk/search_utils.py, manager.py) and the tensor-parallel shard
(colossalai/shardformer: vocab padding, sharded heads and MLP)."""
from __future__ import annotations

import json

import pytest

from launcher.backends.colossalai import gemini
from launcher.backends.colossalai.layout import buckets, gather_peak_numel, padded
from launcher.tp_shard import vocab_multiple
from launcher.trace import TraceKey, build_config, tp_padded_vocab

MEGA = 1024**2


def test_unused_elements_by_hand():
    # chunk 10: [4, 4] -> 2 left; 5 opens a new chunk (waste 2); [5, 3] -> 2 left; total 4
    assert gemini.unused_elements([4, 4, 5, 3], 10) == 4
    assert gemini.unused_elements([10, 10], 10) == 0


def test_small_model_is_one_gathered_chunk():
    s = gemini.search_chunk_size([1000, 2000], dp=4, min_chunk_size_m=32)
    assert (s.chunk_size, s.keep_gathered) == (3000, True)
    b = gemini.gemini_bytes([1000, 2000], 4, 2, s)
    # kept gathered: every rank holds the whole chunk, 16-bit + fp32 master + 2 fp32 Adam states
    assert (b.param_shards, b.master_shards, b.optimizer_states) == (6000, 12000, 24000)


def test_chunk_search_picks_least_waste_then_rounds_to_dp():
    # layers of 3 MiB-elements each, min chunk 4 MiB, interval 1 MiB, range 4 MiB:
    # candidates 4..8 MiB; 6 MiB holds exactly two layers (no waste) -> 6 MiB
    sizes = [3 * MEGA] * 8
    s = gemini.search_chunk_size(sizes, dp=3, search_range_m=4, min_chunk_size_m=4, hidden_dim=MEGA)
    assert s.keep_gathered is False and s.wasted_elements == 0
    assert s.chunk_size == 6 * MEGA + (-6 * MEGA % 3)


def test_extra_large_tensor_gets_its_own_chunk():
    # 30 small tensors and one huge embedding: the embedding is filtered from the search (> mean +
    # 3 std) and packed alone into a chunk of its own size rounded up to dp
    sizes = [100 * MEGA + 1] + [MEGA] * 30
    assert gemini.filter_extra_large(sizes) == [MEGA] * 30
    s = gemini.search_chunk_size(sizes, dp=2, search_range_m=0, min_chunk_size_m=4, hidden_dim=MEGA)
    assert s.chunk_size == 4 * MEGA
    chunks = gemini.pack_chunks(sizes, s.chunk_size, dp=2)
    assert chunks == [100 * MEGA + 2] + [4 * MEGA] * 8  # 30 tensors of 1 MiB in chunks of 4 (last partly)
    b = gemini.gemini_bytes(sizes, 2, 2, s)
    assert b.param_shards == 2 * sum(chunks) // 2
    assert b.gathered == 2 * (100 * MEGA + 2 + 4 * MEGA)  # the two largest chunks


def test_static_fractions_move_bytes_to_host():
    sizes = [MEGA] * 64
    s = gemini.search_chunk_size(sizes, dp=4, search_range_m=0, min_chunk_size_m=8, hidden_dim=MEGA)
    full = gemini.gemini_bytes(sizes, 4, 2, s)
    half = gemini.gemini_bytes(sizes, 4, 2, s, offload_optim_frac=0.5)
    assert half.master_shards == full.master_shards // 2
    assert half.host == (full.master_shards + full.optimizer_states) // 2


def test_lowlevel_zero_padding_and_buckets():
    assert padded(10, 4) == 12 and padded(12, 4) == 12
    # bucket flushes when elements + numel > bucket size; padded numels are recorded
    order = [(0, 6), (1, 6), (2, 3)]
    assert buckets(order, 12, 4) == [(1, [8]), (3, [8, 4])]


@pytest.mark.parametrize("vocab,tp,multiple", [(320, 2, 32), (32000, 4, 64), (32000, 8, 32), (128256, 8, 32),
                                               (50258, 2, 1), (50257, 2, 64)])
def test_vocab_multiple_avoids_padding_where_tp_divides_the_vocabulary(vocab, tp, multiple):
    # 320 / 2 = 160 = 2^5 * 5; 32000 / 8 = 4000 = 2^5 * 125; 128256 / 8 = 16032 = 2^5 * 501;
    # 50258 / 2 = 25129 is odd; 50257 is odd, so tp=2 forces padding and the default 64 stays
    assert vocab_multiple(vocab, tp) == multiple


@pytest.mark.parametrize("vocab,tp,expected", [(320, 2, 320), (32000, 4, 32000), (250880, 4, 250880),
                                               (50257, 2, 50304)])
def test_vocab_padding(vocab, tp, expected):
    # only a vocabulary that tp does not divide is padded: 50257 -> next multiple of 64 x 2 = 50304
    assert tp_padded_vocab(vocab, tp) == expected


def test_tp_shard_config_of_tiny_llama():
    import yaml

    from conftest import ROOT

    hf = yaml.safe_load((ROOT / "conf" / "model" / "tiny-llama.yaml").read_text())["hf_config"]
    full = build_config(TraceKey(json.dumps(hf), 2, 1, 8))
    shard = build_config(TraceKey(json.dumps(hf), 2, 1, 8, tp_size=2))
    assert (shard.num_attention_heads, shard.num_key_value_heads) == (2, 1)
    assert shard.head_dim == full.hidden_size // full.num_attention_heads == 16
    assert shard.intermediate_size == 88 and shard.vocab_size == 320 // 2
    # parameters of one rank, by hand: q,o 64x32; k,v 64x16; gate,up,down 64x88; 2 norms of 64;
    # embedding and LM head 160x64; final norm 64
    per_layer = 2 * 64 * 32 + 2 * 64 * 16 + 3 * 64 * 88 + 2 * 64
    assert _num_params(shard) == 2 * per_layer + 2 * 160 * 64 + 64


def _num_params(cfg) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def test_step_all_gather_holds_two_consecutive_rebuilt_parameters():
    # one bucket: partitions, their flat copy, a dp x flat buffer and two consecutive rebuilt
    # parameters (dp x partition each): 10 + 1 is the largest adjacent pair, not 10 + 10
    assert gather_peak_numel([10, 1, 10], dp=2, bucket_numel=100, cast=False) == 21 + 42 + 2 * 11
    # a 16-bit model adds the partitions' cast copies (`param_to_gather`)
    assert gather_peak_numel([10, 1, 10], dp=2, bucket_numel=100, cast=True) == 21 + 21 + 42 + 2 * 11
    # bucket of 11: [10, 1] gathers when 10 would overflow it, then [10]; a lone partition rebuilds alone
    assert gather_peak_numel([10, 1, 10], dp=2, bucket_numel=11, cast=False) == 11 + 22 + 2 * 11
    assert gather_peak_numel([3], dp=2, bucket_numel=11, cast=False) == 3 + 6 + 6
    # a partition larger than the bucket is gathered straight into its parameter (its cast copy only)
    assert gather_peak_numel([20], dp=2, bucket_numel=11, cast=True) == 20
    # 16-bit: the cast copy of the partition that overflows the bucket exists while the bucket gathers
    assert gather_peak_numel([10, 1, 10], dp=2, bucket_numel=11, cast=True) == 11 + 11 + 22 + 2 * 11 + 10

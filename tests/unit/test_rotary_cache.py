"""transformers 4.37-4.44's Qwen2 gives every attention layer its own rotary embedding, whose
`_set_cos_sin_cache` registers `cos_cached` and `sin_cached` over all max_position_embeddings
positions (training.rotary_cache; launcher/trace.py `_rotary_caches`): module buffers in the
model's dtype, alive through the whole step."""
from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from launcher import trace as tr  # noqa: E402
from launcher.steptrace import Kind  # noqa: E402

LAYERS, POSITIONS, HEADS, HIDDEN = 3, 4096, 4, 64
QWEN2 = transformers.Qwen2Config(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=HEADS,
                                 num_key_value_heads=2, vocab_size=320, num_hidden_layers=LAYERS,
                                 max_position_embeddings=POSITIONS)


def _trace(rotary_cache: bool, dtype: str):
    return tr.trace_step(tr.TraceKey(tr.canonical_config_json(QWEN2), LAYERS, 2, 32, param_dtype=dtype,
                                     optimizer="none", rotary_cache=rotary_cache))


@pytest.mark.parametrize("dtype,size", [("bfloat16", 2), ("float32", 4)])
def test_each_layer_holds_two_tables_over_every_position_through_the_step(dtype, size):
    plain, cached = _trace(False, dtype), _trace(True, dtype)
    table = POSITIONS * (HIDDEN // HEADS) * size  # 4.43's cos_cached: (max_position_embeddings, head_dim)
    extra = cached.nbytes[cached.kind == Kind.BUFFER].sum() - plain.nbytes[plain.kind == Kind.BUFFER].sum()
    assert extra == 2 * LAYERS * table
    # alive at every moment of the step, so the peak moves by all of them
    assert cached.live_curve().max() - plain.live_curve().max() == 2 * LAYERS * table


def test_the_trace_cache_tells_them_apart_and_the_plan_is_estimate_only(cli):
    assert tr.cache_key(tr.TraceKey("{}", 2, 2, 64)) != tr.cache_key(tr.TraceKey("{}", 2, 2, 64, rotary_cache=True))
    r = cli("model=tiny-llama", "hardware=cpu", "gpus=1", "training.seq_len=64", "training.micro_batch_size=1",
            "training.rotary_cache=true", "mode=plan", "report=json")
    assert r.returncode == 0, r.stderr[-2000:]
    reasons = [c["reason"] for c in json.loads(r.stdout)["candidates"]]
    assert reasons and all("training.rotary_cache=true plans transformers 4's per-layer rotary tables" in why
                           and why.endswith("estimate only") for why in reasons), reasons

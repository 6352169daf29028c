"""The model's build on the host (launcher/memory/host_build.py), from the traced `build` phase at
depths 2 and 3, against the same build at full depth on real CPU tensors under the worker's own
storage tracker."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from launcher import trace as tr  # noqa: E402
from launcher.memory.host_build import build_peak_bytes  # noqa: E402
from launcher.worker.storage_tracker import StorageTracker  # noqa: E402

FULL_DEPTH = 6


def tied_llama():
    """A model whose LM head is tied to a large embedding: its construction first allocates the
    head's own weight, which `tie_weights` drops."""
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=8192, num_hidden_layers=2,
                                    tie_word_embeddings=True)


def real_build_peak(cfg, dtype: str) -> int:
    """Peak live bytes while the worker's `from_config` builds the full-depth model."""
    cfg = transformers.AutoConfig.for_model(**json.loads(tr.canonical_config_json(cfg)))
    cfg.num_hidden_layers, cfg.use_cache = FULL_DEPTH, False
    with StorageTracker() as tracker:
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype),
                                                              attn_implementation="sdpa")
    del model
    return tracker.peak_bytes


@pytest.mark.parametrize("traced,built", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                          ("bfloat16", "float32")])
def test_build_peak_equals_the_real_build(traced, built):
    """The traced build, at the real depth and in the dtype the worker builds in (the last case:
    an FSDP2 bf16 step traced in its compute dtype, the model built in fp32), against the real
    build. The construction's tied-head weight is part of the peak: without it the estimate
    reads one embedding's bytes low."""
    k = tr.TraceKey(tr.canonical_config_json(tied_llama()), 2, 1, 8, param_dtype=traced,
                    attn_implementation="sdpa", optimizer="none")
    traces = tr.trace_set(k, FULL_DEPTH)
    estimate, real = build_peak_bytes(traces, traced, built), real_build_peak(tied_llama(), built)
    assert abs(estimate - real) <= 0.01 * real, (estimate, real)
    cfg = tied_llama()
    cfg.num_hidden_layers = FULL_DEPTH
    itemsize = getattr(torch, built).itemsize
    params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(cfg).parameters()) * itemsize
    embedding = cfg.vocab_size * cfg.hidden_size * itemsize
    assert real >= params + embedding, (real, params, embedding)

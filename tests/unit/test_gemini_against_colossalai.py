"""Gemini's chunk layout (launcher/backends/colossalai/gemini.py) against ColossalAI 0.5.0's own code, run on
the CPU: the chunk-size search (`search_chunk_configuration`, on the real transformers model built
on the meta device) and the chunk packing (`ChunkManager.register_tensor` with real `Chunk`s on a
small model). Only the data-parallel size is set from outside, as the process group would set it."""
from __future__ import annotations

import pytest
import yaml

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("colossalai")

from launcher.backends.colossalai.gemini import pack_chunks, search_chunk_size  # noqa: E402

from test_catalogue import CONF_DIR  # noqa: E402


def meta_model(name: str):
    hf = yaml.safe_load((CONF_DIR / "model" / f"{name}.yaml").read_text())["hf_config"]
    cfg = transformers.AutoConfig.for_model(**hf)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg), cfg


@pytest.mark.parametrize("name", ["llama-2-7b", "bloom-1b1", "opt-1.3b", "gpt2-large", "qwen2.5-0.5b", "small-llama"])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_chunk_size_search_equals_colossalai(name, dp, monkeypatch):
    from colossalai.zero.gemini.chunk import search_utils

    monkeypatch.setattr(search_utils.dist, "get_world_size", lambda group=None: dp)
    model, cfg = meta_model(name)
    theirs, _, waste = search_utils.search_chunk_configuration(model, search_range_m=32,
                                                               search_interval=cfg.hidden_size,
                                                               min_chunk_size_m=32, filter_exlarge_params=True)
    sizes = [p.numel() for p in model.parameters()]
    ours = search_chunk_size(sizes, dp, 32, 32, cfg.hidden_size)
    assert (ours.chunk_size, ours.keep_gathered) == (theirs[dp]["chunk_size"], theirs[dp]["keep_gathered"])
    if not ours.keep_gathered:
        assert ours.wasted_elements == waste


@pytest.mark.parametrize("dp", [1, 2])
def test_chunk_packing_equals_colossalai_chunk_manager(dp, monkeypatch):
    """gpt2's fp16 parameters registered in order with ColossalAI's ChunkManager: the same chunks,
    including the embedding that exceeds the chunk size and gets one of its own."""
    from colossalai.zero.gemini.chunk import chunk as chunk_mod
    from colossalai.zero.gemini.chunk import manager as manager_mod

    for mod in (chunk_mod, manager_mod):
        monkeypatch.setattr(mod.dist, "get_world_size", lambda group=None: dp)
        monkeypatch.setattr(mod.dist, "get_rank", lambda group=None: 0)
    cfg = transformers.GPT2Config(n_layer=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float16)
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    chunk_size = 4 * 1024 * 1024
    mgr = manager_mod.ChunkManager({dp: dict(chunk_size=chunk_size, keep_gathered=False)})
    for p in params:
        mgr.register_tensor(p.data, "fp16_param", dp, zero_group=None)
    theirs = [c.chunk_size for c in mgr.chunk_groups[f"fp16_param_{dp}"]]
    assert len(theirs) > 1 and max(theirs) > chunk_size  # several chunks, one oversize (the embedding)
    assert pack_chunks(sizes, chunk_size, dp) == theirs

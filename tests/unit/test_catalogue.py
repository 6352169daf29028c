"""The model and hardware catalogues (conf/model/*.yaml, conf/hardware/*.yaml).

Model files: each must load through the `ModelConfig` schema, build with transformers (on the meta
device, no memory) and, where a parameter count has been published for the released model, match
it within 1%. The published counts below come from model cards, papers and the Hugging Face hub,
never from this code. Synthetic models are checked against closed-form parameter counts instead,
and those formulas are first checked against published counts.

Hardware files: each must load through the `HardwareConfig` schema, cite a source for every
number, and agree with facts that can be checked without the card (nominal memory size, dtype
rate ordering, compute capability of the architecture).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from launcher.config import HardwareConfig, ModelConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# model=custom is a placeholder that reads a user's config.json; it has no catalogue values.
MODEL_NAMES = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if p.stem != "custom")
HARDWARE_NAMES = sorted(p.stem for p in (CONF_DIR / "hardware").glob("*.yaml"))

REQUIRED_MODELS = {
    "bloom-560m", "bloom-1b1", "bloom-3b", "bloom-7b1", "opt-125m", "opt-350m", "opt-1.3b",
    "opt-2.7b", "opt-6.7b", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt-neo-1.3b",
    "codegen-350m-mono", "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3.1-8b",
    "llama-3.1-70b", "llama-3.2-1b", "llama-3.2-3b", "mistral-7b", "qwen2.5-0.5b", "qwen2.5-7b",
    "tiny-llama", "tiny-bloom", "small-llama", "small-bloom",
}
REQUIRED_HARDWARE = {
    "v100-16g", "v100-32g", "a10g", "l4", "l40s", "a100-40g", "a100-80g", "h100-80g", "h200",
    "rtx3090", "rtx4090", "a6000", "cpu",
}
SYNTHETIC_MODELS = {"tiny-llama", "tiny-bloom", "small-llama", "small-bloom"}

_CARD = "model card on huggingface.co"
_HUB = "Hugging Face hub safetensors total of the released checkpoint (HfApi.model_info)"
# name -> (published parameter count, where it is published). Rounded figures ("0.49B") are
# written out; the 1% tolerance covers their rounding.
PUBLISHED_PARAMS = {
    "bloom-560m": (559_214_592, "bigscience/bloom-560m " + _CARD),
    "bloom-1b1": (1_065_314_304, "bigscience/bloom-1b1 " + _CARD),
    "bloom-3b": (3_002_557_440, "bigscience/bloom-3b " + _CARD),
    "bloom-7b1": (7_069_016_064, "bigscience/bloom-7b1 " + _CARD),
    "opt-125m": (125_000_000, "OPT paper (arXiv:2205.01068) Table 1: 125M"),
    "opt-350m": (331_196_416, "facebook/opt-350m: " + _HUB),
    "opt-1.3b": (1_315_758_080, "facebook/opt-1.3b: " + _HUB),
    "opt-2.7b": (2_651_596_800, "facebook/opt-2.7b: " + _HUB),
    "opt-6.7b": (6_700_000_000, "OPT paper (arXiv:2205.01068) Table 1: 6.7B"),
    "opt-30b": (30_000_000_000, "OPT paper (arXiv:2205.01068) Table 1: 30B"),
    "gpt2": (124_439_808, "openai-community/gpt2: released checkpoint, weights without attention-mask buffers"),
    "gpt2-medium": (354_823_168, "openai-community/gpt2-medium: released checkpoint, weights without buffers"),
    "gpt2-large": (774_030_080, "openai-community/gpt2-large: released checkpoint, weights without buffers"),
    "gpt2-xl": (1_557_611_200, "openai-community/gpt2-xl: released checkpoint, weights without buffers"),
    "llama-2-7b": (6_738_415_616, "meta-llama/Llama-2-7b-hf: " + _HUB),
    "llama-2-13b": (13_015_864_320, "meta-llama/Llama-2-13b-hf: " + _HUB),
    "llama-2-70b": (68_976_648_192, "meta-llama/Llama-2-70b-hf: " + _HUB),
    "llama-3.1-8b": (8_030_261_248, "meta-llama/Llama-3.1-8B: " + _HUB + " (card: 8B)"),
    "llama-3.1-70b": (70_553_706_496, "meta-llama/Llama-3.1-70B: " + _HUB + " (card: 70B)"),
    "llama-3.2-1b": (1_230_000_000, "meta-llama/Llama-3.2-1B " + _CARD + ": 1.23B"),
    "llama-3.2-3b": (3_210_000_000, "meta-llama/Llama-3.2-3B " + _CARD + ": 3.21B"),
    "mistral-7b": (7_300_000_000, "Mistral 7B paper (arXiv:2310.06825): 7.3B"),
    "qwen2.5-0.5b": (490_000_000, "Qwen/Qwen2.5-0.5B " + _CARD + ": 0.49B"),
    "qwen2.5-1.5b": (1_540_000_000, "Qwen/Qwen2.5-1.5B " + _CARD + ": 1.54B"),
    "qwen2.5-3b": (3_090_000_000, "Qwen/Qwen2.5-3B " + _CARD + ": 3.09B"),
    "qwen2.5-7b": (7_610_000_000, "Qwen/Qwen2.5-7B " + _CARD + ": 7.61B"),
    "qwen2.5-14b": (14_700_000_000, "Qwen/Qwen2.5-14B " + _CARD + ": 14.7B"),
    "qwen-1.8b": (1_840_000_000, "Qwen/Qwen-1_8B " + _CARD + ": 1.8B (Qwen technical report Table 1: 1.8B)"),
    "qwen-7b": (7_700_000_000, "Qwen/Qwen-7B " + _CARD + ": 7.7B"),
    "qwen-14b": (14_200_000_000, "Qwen/Qwen-14B " + _CARD + ": 14.2B"),
    "qwen-72b": (72_300_000_000, "Qwen/Qwen-72B " + _CARD + ": 72.3B"),
    "mixtral-8x7b": (46_700_000_000, "Mixtral of experts (arXiv:2401.04088) / Mistral announcement: 46.7B total"),
    "tinyllama-1.1b": (1_100_000_000, "TinyLlama/TinyLlama-1.1B " + _CARD + ": 1.1B"),
    "phi-2": (2_779_683_840, "microsoft/phi-2: " + _HUB),
    "gpt-j-6b": (6_053_381_344, "EleutherAI/gpt-j-6b " + _CARD + ": n_parameters"),
    "gpt-neox-20b": (20_554_567_680, "EleutherAI/gpt-neox-20b " + _CARD + ": n_parameters"),
    "gemma-2b": (524_550_144 + 1_981_622_272, "Gemma report (arXiv:2403.08295) Table 2: embedding + non-embedding"),
}


def _load(group: str, name: str):
    return OmegaConf.load(CONF_DIR / group / f"{name}.yaml")


def _build_meta(hf_config: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def _num_params(hf_config: dict) -> int:
    return sum(p.numel() for p in _build_meta(hf_config).parameters())


def _model_hf(name: str) -> dict:
    return OmegaConf.to_container(_load("model", name).hf_config)


# ---- model catalogue ---------------------------------------------------------------------------

def test_required_models_present():
    assert REQUIRED_MODELS <= set(MODEL_NAMES), REQUIRED_MODELS - set(MODEL_NAMES)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_file_validates_against_schema(name):
    raw = _load("model", name)
    mc = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw))
    assert mc.name == name
    assert mc.source.startswith("https://")
    assert mc.config_path is None
    assert isinstance(mc.hf_config["model_type"], str) and mc.hf_config["architectures"]
    text = (CONF_DIR / "model" / f"{name}.yaml").read_text()
    assert text.startswith(f"# {name}: ") and mc.source in text.splitlines()[0]
    assert f"# Run: python -m launcher model={name} " in text


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_numbers_are_numbers(name):
    """YAML 1.1 reads '1e-05' as a string; every numeric-looking value must load as a number."""
    def walk(v):
        if isinstance(v, dict):
            for x in v.values():
                yield from walk(x)
        elif isinstance(v, list):
            for x in v:
                yield from walk(x)
        else:
            yield v
    strings = [v for v in walk(_model_hf(name)) if isinstance(v, str)]
    assert not [s for s in strings if re.fullmatch(r"[-+0-9.eE]+", s)]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_builds_and_matches_published_count(name):
    hf = _model_hf(name)
    model = _build_meta(hf)
    assert type(model).__name__ == hf["architectures"][0]
    n = sum(p.numel() for p in model.parameters())
    if name in PUBLISHED_PARAMS:
        published, _source = PUBLISHED_PARAMS[name]
        assert abs(n - published) <= 0.01 * published, (name, n, published)
    else:
        assert name in SYNTHETIC_MODELS or name in {"gpt-neo-1.3b", "codegen-350m-mono", "codegen-2b-mono",
                                                     "biogpt-large", "falcon-7b"}


def _llama_params(h: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool) -> int:
    """Llama decoder: q,o (h x h), k,v (h x kv_heads*head_dim), gate/up/down (h x inter), two RMSNorm
    weights per layer, a final norm, the embedding and (untied) LM head. No biases. Layout from
    transformers/models/llama/modeling_llama.py (LlamaAttention, LlamaMLP, LlamaDecoderLayer)."""
    head_dim = h // heads
    per_layer = 2 * h * h + 2 * h * kv_heads * head_dim + 3 * h * inter + 2 * h
    return vocab * h * (1 if tied else 2) + layers * per_layer + h


def _bloom_params(h: int, layers: int, vocab: int) -> int:
    """BLOOM: fused qkv (3h x h + bias), dense (h x h + bias), MLP h->4h->h with biases, two LayerNorms
    (weight+bias) per layer; embedding LayerNorm and final LayerNorm; LM head tied to the embedding.
    Layout from transformers/models/bloom/modeling_bloom.py (BloomAttention, BloomMLP, BloomBlock)."""
    per_layer = 12 * h * h + 13 * h
    return vocab * h + 2 * h + layers * per_layer + 2 * h


def test_closed_forms_reproduce_published_counts():
    assert _llama_params(4096, 11008, 32, 32, 32, 32000, False) == PUBLISHED_PARAMS["llama-2-7b"][0]
    assert _llama_params(8192, 28672, 80, 64, 8, 32000, False) == PUBLISHED_PARAMS["llama-2-70b"][0]
    assert _bloom_params(1536, 24, 250880) == PUBLISHED_PARAMS["bloom-1b1"][0]
    assert _bloom_params(1024, 24, 250880) == PUBLISHED_PARAMS["bloom-560m"][0]


@pytest.mark.parametrize("name", ["tiny-llama", "small-llama"])
def test_synthetic_llama_count(name):
    hf = _model_hf(name)
    expected = _llama_params(hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"],
                             hf["num_attention_heads"], hf["num_key_value_heads"], hf["vocab_size"],
                             hf["tie_word_embeddings"])
    assert _num_params(hf) == expected


@pytest.mark.parametrize("name", ["tiny-bloom", "small-bloom"])
def test_synthetic_bloom_count(name):
    hf = _model_hf(name)
    assert _num_params(hf) == _bloom_params(hf["hidden_size"], hf["n_layer"], hf["vocab_size"])


def test_synthetic_models_fit_their_purpose():
    from launcher.worker.tokenizer import BYTE_VOCAB_SIZE

    tiny = _model_hf("tiny-llama")
    assert (tiny["hidden_size"], tiny["intermediate_size"], tiny["num_hidden_layers"]) == (64, 176, 2)
    assert (tiny["num_attention_heads"], tiny["num_key_value_heads"]) == (4, 2)
    assert tiny["max_position_embeddings"] == 512 and tiny["tie_word_embeddings"] is False
    for name in SYNTHETIC_MODELS:
        assert _model_hf(name)["vocab_size"] >= BYTE_VOCAB_SIZE, name
    for name in ("small-llama", "small-bloom"):
        hf = _model_hf(name)
        n = _num_params(hf)
        embedding = hf["vocab_size"] * hf["hidden_size"]
        assert n < 40_000_000, (name, n)
        assert embedding > (n - embedding * (1 if hf.get("tie_word_embeddings", True) else 2)), name


# ---- hardware catalogue ------------------------------------------------------------------------

# Nominal memory of each card in GiB-sized marketing units (datasheets), and its architecture's
# compute capability (https://developer.nvidia.com/cuda-gpus).
NOMINAL = {
    "v100-16g": (16, 70), "v100-32g": (32, 70), "a10g": (24, 86), "l4": (24, 89),
    "l40s": (48, 89), "a100-40g": (40, 80), "a100-80g": (80, 80), "h100-80g": (80, 90),
    "h200": (141, 90), "rtx3090": (24, 86), "rtx4090": (24, 89), "a6000": (48, 86), "titan-rtx": (24, 75),
}
_NUMERIC_KEYS = ("memory_bytes", "host_memory_bytes", "matmul_efficiency", "memory_bandwidth_gbps",
                 "intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps", "host_link_bandwidth_gbps",
                 "sm_arch", "cuda_context_bytes", "peak_tflops")


def test_required_hardware_present():
    assert REQUIRED_HARDWARE <= set(HARDWARE_NAMES), REQUIRED_HARDWARE - set(HARDWARE_NAMES)


@pytest.mark.parametrize("name", HARDWARE_NAMES)
def test_hardware_file_validates_against_schema(name):
    hw = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareConfig), _load("hardware", name)))
    assert hw.name == name and hw.source
    assert set(hw.peak_tflops) == {"fp32", "tf32", "fp16", "bf16"}
    assert all(v > 0 for v in hw.peak_tflops.values())
    assert 0 < hw.matmul_efficiency <= 1
    for key in ("memory_bandwidth_gbps", "intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps",
                "host_link_bandwidth_gbps"):
        assert getattr(hw, key) > 0, key
    assert hw.host_memory_bytes >= hw.memory_bytes or hw.device == "cpu"


@pytest.mark.parametrize("name", HARDWARE_NAMES)
def test_hardware_numbers_cite_a_source(name):
    text = (CONF_DIR / "hardware" / f"{name}.yaml").read_text()
    assert f"# Use: python -m launcher model=bloom-1b1 gpus=4 hardware={name}" in text or name == "cpu"
    for key in _NUMERIC_KEYS:
        line = next(ln for ln in text.splitlines() if ln.startswith(f"{key}:"))
        assert "#" in line and len(line.split("#", 1)[1].strip()) > 10, line


@pytest.mark.parametrize("name", sorted(NOMINAL))
def test_gpu_numbers_agree_with_the_card(name):
    hw = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareConfig), _load("hardware", name)))
    nominal_gib, sm = NOMINAL[name]
    assert hw.device == "cuda" and hw.sm_arch == sm
    assert hw.memory_bytes % 2**20 == 0  # nvidia-smi reports MiB
    # Drivers report a little less than the nominal size (ECC, reserved regions), never more.
    assert 0.93 * nominal_gib * 2**30 <= hw.memory_bytes <= nominal_gib * 2**30
    pk = hw.peak_tflops
    assert pk["fp32"] <= pk["tf32"] <= pk["fp16"]
    if sm >= 80:  # Ampere and newer run bf16 on tensor cores at the fp16 rate
        assert pk["bf16"] == pk["fp16"]
    else:  # Volta: no bf16 tensor cores
        assert pk["bf16"] <= pk["fp32"]
    assert 2**29 <= hw.cuda_context_bytes <= 2**30  # GPU_MEMORY.md: 0.5-1 GiB after the first step


def test_cpu_profile_has_no_cuda_terms():
    hw = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareConfig), _load("hardware", "cpu")))
    assert hw.device == "cpu" and hw.cuda_context_bytes == 0
    assert hw.memory_bytes == 16 * 2**30


# ---- Hydra composition -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose(tmp_path_factory):
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    primary = tmp_path_factory.mktemp("conf")
    (primary / "catalogue_probe.yaml").write_text(yaml.safe_dump({
        "defaults": [{"model": "tiny-llama"}, {"hardware": "a100-80g"}, "_self_"],
        "hydra": {"searchpath": [f"file://{CONF_DIR}"]},
    }))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(primary), version_base="1.3"):
        yield lambda overrides: hydra_compose(config_name="catalogue_probe", overrides=overrides)
    GlobalHydra.instance().clear()


def test_hydra_composes_every_model(compose):
    for name in MODEL_NAMES:
        cfg = compose([f"model={name}"])
        mc = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg.model))
        assert mc.name == name and mc.hf_config == _model_hf(name)


def test_hydra_composes_every_hardware(compose):
    for name in HARDWARE_NAMES:
        cfg = compose([f"hardware={name}"])
        hw = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareConfig), cfg.hardware))
        assert hw.name == name

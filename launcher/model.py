"""ModelSpec: the architecture numbers of a catalogue or custom model, read through transformers'
own config classes (so attribute names like n_layer / num_hidden_layers are normalised)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from launcher.config import ModelConfig
from launcher.errors import ConfigError
from launcher.environment import DEFAULT_CACHE_DIR, installed_version

# Encoder families whose config can build a *LMHeadModel but are not decoders.
_ENCODER_ARCH_SUFFIXES = ("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
                          "ForQuestionAnswering", "ForConditionalGeneration", "Model")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hf_config: dict  # config.json values (JSON-serialisable)
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_positions: Optional[int]  # None when positions are unbounded (ALiBi)
    tie_word_embeddings: bool
    attn_implementations: tuple  # what transformers supports for this architecture
    no_split_modules: tuple = ()  # the causal-LM class's `_no_split_modules` (its decoder block classes)

    @property
    def hf_config_json(self) -> str:
        return json.dumps(self.hf_config, sort_keys=True)


def read_config_path(path: str) -> dict:
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"model.config_path={path}: no such file; give a config.json or a directory holding one")
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"model.config_path={path}: not valid JSON ({err.__class__.__name__}); give a Hugging Face config.json") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.config_path={path}: not a JSON object; give a Hugging Face config.json")
    return data


SPEC_FORMAT = 2  # bump when ModelSpec's fields change


def load_spec(mc: ModelConfig, cache_dir: Optional[str] = None) -> ModelSpec:
    """Validate that the config describes a decoder LLM transformers can build, and read its numbers.
    A spec read before (same config.json values, same transformers version) comes from the cache,
    so a plan whose traces are cached never imports transformers."""
    hf = read_config_path(mc.config_path) if mc.config_path else dict(mc.hf_config)
    name = custom_name(mc.config_path) if mc.name == "custom" and mc.config_path else mc.name
    path = _spec_cache_path(hf, cache_dir)
    try:
        data = json.loads(path.read_text())
        return ModelSpec(**{**data, "name": name, "hf_config": hf,
                            "attn_implementations": tuple(data["attn_implementations"])})
    except (OSError, ValueError, TypeError, KeyError):
        pass
    spec = _read_spec(mc, hf, name)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({k: v for k, v in asdict(spec).items() if k not in ("name", "hf_config")}))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs time
    return spec


def _spec_cache_path(hf: dict, cache_dir: Optional[str]) -> Path:
    blob = json.dumps([SPEC_FORMAT, installed_version("transformers"), hf], sort_keys=True, default=str)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:24]
    root = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR.parent
    return root / "specs" / f"{digest}.json"


def _read_spec(mc: ModelConfig, hf: dict, name: str) -> ModelSpec:
    where = f"model.config_path={mc.config_path}" if mc.config_path else f"model={mc.name}"
    cfg = _auto_config(hf, where)
    _require_decoder(cfg, hf, where)

    def get(*names, default=None):
        for n in names:
            v = getattr(cfg, n, None)
            if v is not None:
                return v
        return default

    heads = int(get("num_attention_heads"))
    max_pos = get("max_position_embeddings", "n_positions")
    return ModelSpec(
        name=name,
        hf_config=hf,
        model_type=cfg.model_type,
        num_layers=int(get("num_hidden_layers")),
        hidden_size=int(get("hidden_size")),
        num_attention_heads=heads,
        num_key_value_heads=1 if getattr(cfg, "multi_query", False) and not getattr(cfg, "new_decoder_architecture", False)
        else int(get("num_key_value_heads", "num_kv_heads", default=heads)),
        vocab_size=int(get("vocab_size")),
        max_positions=None if max_pos is None or cfg.model_type == "bloom" else int(max_pos),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
        attn_implementations=supported_attention(cfg.model_type),
        no_split_modules=no_split_modules(cfg.model_type),
    )


def supported_attention(model_type: str) -> tuple:
    """Attention implementations transformers' causal-LM class declares (`_supports_sdpa`,
    `_supports_flash_attn`; eager always)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], None)
    out = ["eager"]
    if cls is None or getattr(cls, "_supports_sdpa", False):
        out.append("sdpa")
    if cls is None or getattr(cls, "_supports_flash_attn", False):
        out.append("flash_attention_2")
    return tuple(out)


def no_split_modules(model_type: str) -> tuple:
    """The decoder block classes transformers names for this family: `_no_split_modules` of its
    causal-LM class (what Accelerate's TRANSFORMER_BASED_WRAP falls back to); () if none."""
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    except (KeyError, AttributeError, ImportError):
        return ()
    return tuple(getattr(cls, "_no_split_modules", None) or ())


def effective_attention(spec: ModelSpec, requested: str) -> tuple[str, str]:
    """(implementation used, note): the requested one if the architecture supports it, else
    eager, which transformers falls back to for such architectures."""
    if requested in spec.attn_implementations:
        return requested, ""
    return "eager", (f"{spec.model_type} does not support attn_implementation={requested} in transformers; "
                     "eager attention is planned and used")


def custom_name(config_path: str) -> str:
    """A readable name for model=custom: the directory holding config.json, or the file stem."""
    p = Path(config_path).expanduser()
    return p.name if p.is_dir() else (p.parent.name if p.stem == "config" else p.stem) or "custom"


def _auto_config(hf: dict, where: str):
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = hf.get("model_type")
    if not model_type:
        raise ConfigError(f"{where}: config has no model_type; give a Hugging Face decoder config.json")
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{where}: model_type '{model_type}' is not known to this transformers; "
                          "use a supported architecture or upgrade transformers")
    fields = {k: v for k, v in hf.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: transformers rejects this config ({err}); fix the config.json values") from None


def _require_decoder(cfg, hf: dict, where: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = hf.get("architectures") or []
    causal_arch = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    encoder_arch = archs and not causal_arch and all(a.endswith(_ENCODER_ARCH_SUFFIXES) for a in archs)
    if (getattr(cfg, "is_encoder_decoder", False) or cfg.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            or encoder_arch):
        raise ConfigError(f"{where}: '{cfg.model_type}' ({', '.join(archs) or 'no architectures'}) is not a "
                          "decoder-only causal LM; give the config.json of a decoder LLM (e.g. Llama, BLOOM, OPT, GPT-2)")

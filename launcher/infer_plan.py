"""mode=infer_plan: per-GPU memory of serving a catalogue model with transformers' `generate`
(weights at bf16/fp16, LLM.int8 or bitsandbytes 4-bit, KV cache, activations of the largest
forward), split over `inference.tp_size` GPUs. The arithmetic is launcher/infer.py; this module
validates the request, adds the GPU runtime terms outside tensors, and formats the report.

Per GPU: peak tensor bytes = weights + max(prefill, last decode step) (infer.estimate_inference);
device total = that + CUDA context (the hardware profile's `cuda_context_bytes`) + NCCL buffers
when tp_size > 1 (launcher/memory/runtime.py). The caching allocator's reserve above allocated is
not included (no traced allocation sequence for generate).
"""
from __future__ import annotations

from launcher.errors import ConfigError
from launcher import infer
from launcher.memory import runtime

GIB = 2**30


def check(config, spec) -> list[str]:
    """Every problem with the `inference` section for this model, each naming the key and fix."""
    inf = config.inference
    out = [f"inference.{k}={getattr(inf, k)}: must be at least 1"
           for k in ("batch_size", "prompt_len", "gen_len", "tp_size") if getattr(inf, k) < 1]
    if inf.tp_size >= 1 and config.gpus % inf.tp_size:
        out.append(f"inference.tp_size={inf.tp_size} does not divide gpus={config.gpus}; e.g. gpus={inf.tp_size}")
    total = inf.prompt_len + inf.gen_len
    if spec.max_positions is not None and total > spec.max_positions:
        out.append(f"inference.prompt_len + gen_len = {total} is above {spec.name}'s maximum positions "
                   f"({spec.max_positions}); shorten inference.gen_len or prompt_len")
    return out


def infer_plan(config, spec) -> dict:
    """The serving estimate of `spec` under `config.inference` on `config.hardware`, as JSON data."""
    problems = check(config, spec)
    if problems:
        raise ConfigError(*problems)
    inf, hw = config.inference, config.hardware
    ispec = infer.inference_spec_from_hf_config(spec.hf_config)
    try:
        est = infer.estimate_inference(ispec, inf.precision.name, inf.batch_size, inf.prompt_len,
                                       inf.gen_len, tp_size=inf.tp_size, double_quant=inf.double_quant,
                                       attn_implementation=inf.attn_implementation.name)
    except ValueError as err:
        raise ConfigError(f"inference.tp_size={inf.tp_size}: {err}") from None
    cuda = hw.device == "cuda"
    outside = (runtime.cuda_context_bytes(hw.cuda_context_bytes)
               + (runtime.nccl_bytes(inf.tp_size) if inf.tp_size > 1 else 0)) if cuda else 0
    activation = max(est["prefill_activation_bytes"], est["decode_activation_bytes"])
    total = est["peak_bytes"] + outside
    return {
        "model": {"name": spec.name, "num_params": ispec.num_params, "num_layers": ispec.num_layers,
                  "num_attention_heads": ispec.num_attention_heads,
                  "num_key_value_heads": ispec.num_key_value_heads, "head_dim": ispec.head_dim},
        "hardware": hw.name, "memory_bytes": hw.memory_bytes,
        "request": {"precision": inf.precision.name, "batch_size": inf.batch_size,
                    "prompt_len": inf.prompt_len, "gen_len": inf.gen_len, "tp_size": inf.tp_size,
                    "attn_implementation": inf.attn_implementation.name,
                    "double_quant": inf.double_quant},
        "per_gpu": {"weight_bytes": est["weight_bytes"], "kv_cache_bytes": est["kv_cache_bytes"],
                    "activation_bytes": activation, "peak_phase": est["peak_phase"],
                    "peak_allocated_bytes": est["peak_bytes"], "runtime_bytes": outside,
                    "device_total_bytes": total},
        "kv_cache_bytes_per_token": est["kv_cache_bytes_per_token"],
        "weight_breakdown": est["weight_breakdown"],
        "fits": total <= hw.memory_bytes,
        "notes": ["weights: Linear layers quantized as transformers' bitsandbytes integration does "
                  "(lm_head, embeddings, norms stay in the load dtype); KV cache in the load dtype "
                  f"({infer.value_bytes(inf.precision.name) * 8} bits); {inf.attn_implementation.name} attention; "
                  "launcher/infer.py",
                  "device total = peak tensor bytes + CUDA context"
                  + (" + NCCL (one process group)" if inf.tp_size > 1 else "")
                  + "; the allocator's reserve above allocated is not included"],
    }


def format_report(r: dict) -> str:
    q, g = r["request"], r["per_gpu"]
    gib = lambda n: f"{n / GIB:8.2f} GiB"  # noqa: E731
    lines = [f"{r['model']['name']} ({r['model']['num_params'] / 1e9:.2f}B params) served at {q['precision']}, "
             f"batch {q['batch_size']} x ({q['prompt_len']} prompt + {q['gen_len']} generated) tokens, "
             f"tensor parallel over {q['tp_size']} x {r['hardware']}; per GPU:",
             f"  weights          {gib(g['weight_bytes'])}",
             f"  KV cache         {gib(g['kv_cache_bytes'])}  ({r['kv_cache_bytes_per_token']:,} B per token, "
             f"{r['model']['num_key_value_heads']} KV heads)",
             f"  activations      {gib(g['activation_bytes'])}  (largest forward; peak in {g['peak_phase']})",
             f"  peak allocated   {gib(g['peak_allocated_bytes'])}",
             f"  runtime          {gib(g['runtime_bytes'])}",
             f"  device total     {gib(g['device_total_bytes'])}  of {r['memory_bytes'] / GIB:.2f} GiB: "
             + ("fits" if r["fits"] else "does NOT fit")]
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)

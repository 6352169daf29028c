"""mode=infer_plan: per-GPU memory of serving a catalogue model with transformers' `generate`
(weights at bf16/fp16, LLM.int8 or bitsandbytes 4-bit, KV cache, activations of the largest
forward), split over `inference.tp_size` GPUs. The arithmetic is launcher/infer.py; this module
validates the request, adds the GPU runtime terms outside tensors, and formats the report.

Per GPU: peak tensor bytes = weights + the largest phase of generate: the prompt's forward or a decode
step (infer.estimate_inference; `inference.kv_cache` and `inference.prompt_logits` say what the model's
own code keeps alive);
device total = that + CUDA context (the hardware profile's `cuda_context_bytes`) + NCCL buffers
when tp_size > 1 (launcher/memory/runtime.py). The caching allocator's reserve above allocated is
not included (no traced allocation sequence for generate).

With `inference.device_map`, transformers' device map splits the layers over the GPUs and the CPU
(launcher/device_map.py) and each GPU is estimated with what it holds and runs
(infer.estimate_placed); `per_gpu` is then the GPU with the largest device total.
"""
from __future__ import annotations

import dataclasses
import os

from launcher.hardware import job_nccl_version
from launcher.errors import ConfigError
from launcher import device_map, infer, margin, quant
from launcher.memory import runtime

GIB = 2**30
LOAD_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # device_map: unquantized loads
BNB = ("int8", "nf4", "fp4")  # device_map: bitsandbytes loads (16-bit load dtype for what stays unquantized)


DEFAULT_PROMPT_LEN = 1024


def prompt_len(inf, spec) -> int:
    """The prompt length asked (`inference.prompt_len`), or for null the default: 1024 tokens, or
    the model's maximum positions minus `gen_len` when that is shorter (at least 1, so a `gen_len`
    that leaves no room is reported by `check` against the positions)."""
    if inf.prompt_len is not None:
        return inf.prompt_len
    if spec.max_positions is None:
        return DEFAULT_PROMPT_LEN
    return max(1, min(DEFAULT_PROMPT_LEN, spec.max_positions - inf.gen_len))


def _resolved(config, spec):
    """`config` with `inference.prompt_len` resolved (`prompt_len`)."""
    inf = config.inference
    return dataclasses.replace(config, inference=dataclasses.replace(inf, prompt_len=prompt_len(inf, spec)))


def check(config, spec) -> list[str]:
    """Every problem with the `inference` section for this model, each naming the key and fix."""
    config = _resolved(config, spec)
    inf = config.inference
    out = [f"inference.{k}={getattr(inf, k)}: must be at least 1"
           for k in ("batch_size", "prompt_len", "gen_len", "tp_size") if getattr(inf, k) < 1]
    if inf.tp_size >= 1 and config.gpus % inf.tp_size:
        out.append(f"inference.tp_size={inf.tp_size} does not divide gpus={config.gpus}; e.g. gpus={inf.tp_size}")
    if inf.device_map is not None:
        dm = f"inference.device_map={inf.device_map.name}"
        if inf.tp_size != 1:
            out.append(f"{dm} splits layers, not tensors: set inference.tp_size=1 or inference.device_map=null")
        if inf.precision.name not in (*LOAD_DTYPES, *BNB):
            out.append(f"{dm} is planned for 16-bit, fp32 and bitsandbytes weights, not "
                       f"inference.precision={inf.precision.name}; use inference.precision=bf16 or nf4, "
                       "or inference.device_map=null")
        if config.hardware.device != "cuda":
            out.append(f"{dm} places layers on GPUs: use a GPU hardware profile, e.g. hardware=a100-80g")
    if inf.max_memory_gib is not None:
        if inf.device_map is None:
            out.append(f"inference.max_memory_gib={inf.max_memory_gib} applies to a device map: set "
                       "inference.device_map=auto, or inference.max_memory_gib=null")
        elif inf.max_memory_gib <= 0:
            out.append(f"inference.max_memory_gib={inf.max_memory_gib}: must be above 0, e.g. 20")
    if inf.gptq_kernel.name == "exllama" and inf.precision.name != "gptq_int4":
        out.append(f"inference.gptq_kernel=exllama is AutoGPTQ's 4-bit kernel, not for inference.precision="
                   f"{inf.precision.name}; use inference.precision=gptq_int4 or inference.gptq_kernel=cuda_old")
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
    resolved = _resolved(config, spec)
    result = _plan(resolved, spec)
    n = resolved.inference.prompt_len
    if config.inference.prompt_len is None and n != DEFAULT_PROMPT_LEN:
        result["notes"].append(f"inference.prompt_len=null: {n} tokens, {spec.name}'s {spec.max_positions} "
                               f"positions minus gen_len {resolved.inference.gen_len}")
    return result


def _plan(config, spec) -> dict:
    inf, hw = config.inference, config.hardware
    if inf.device_map is not None:
        return placed_plan(config, spec)
    ispec = infer.inference_spec_from_hf_config(spec.hf_config)
    try:
        est = infer.estimate_inference(ispec, inf.precision.name, inf.batch_size, inf.prompt_len,
                                       inf.gen_len, tp_size=inf.tp_size, double_quant=inf.double_quant,
                                       attn_implementation=inf.attn_implementation.name,
                                       kv_cache=inf.kv_cache.name, prompt_logits=inf.prompt_logits.name,
                                       gptq_kernel=inf.gptq_kernel.name)
    except ValueError as err:
        raise ConfigError(f"inference.tp_size={inf.tp_size}: {err}") from None
    cuda = hw.device == "cuda"
    nccl = job_nccl_version(hw) if cuda and inf.tp_size > 1 else None
    release = runtime.nccl_version(nccl) if nccl else None
    env = runtime.nccl_env(os.environ)  # the job inherits this environment
    nvls = runtime.nvls_bytes(inf.tp_size, release) if release and hw.nvls and env.nvls else 0
    nvls += runtime.nvls_peer_bytes(release, env) if nvls else 0
    group = runtime.nccl_bytes(inf.tp_size, release, int(hw.nccl_channels), str(hw.nccl_transport),
                               p2p_read=int(hw.sm_arch) == 80, env=env) if release else 0
    outside = (runtime.cuda_context_bytes(hw.cuda_context_bytes) + group + nvls) if cuda else 0
    activation = max(est["prefill_activation_bytes"], est["decode_activation_bytes"])
    total = est["peak_bytes"] + outside
    return {
        **_header(config, spec, ispec),
        "per_gpu": {"weight_bytes": est["weight_bytes"], "kv_cache_bytes": est["kv_cache_bytes"],
                    "held_bytes": est["held_bytes"], "activation_bytes": activation, "peak_phase": est["peak_phase"],
                    "peak_allocated_bytes": est["peak_bytes"], "runtime_bytes": outside,
                    "device_total_bytes": total},
        "kv_cache_bytes_per_token": est["kv_cache_bytes_per_token"],
        "weight_breakdown": est["weight_breakdown"],
        "fits": total <= hw.memory_bytes,
        "notes": ["weights: Linear layers quantized as transformers' bitsandbytes integration does "
                  "(lm_head, embeddings, norms stay in the load dtype); KV cache in the load dtype "
                  f"({infer.value_bytes(inf.precision.name) * 8} bits); {inf.attn_implementation.name} attention; "
                  "launcher/infer.py",
                  *_cache_notes(inf),
                  "device total = peak tensor bytes + CUDA context"
                  + (f" + NCCL (one process group: {group / 2**20:.0f} MiB, NCCL {nccl}, {hw.nccl_channels} "
                     f"channels over {hw.nccl_transport}: runtime.py nccl_bytes)" if group else "")
                  + (f" + its NVLS buffers ({nvls / 2**20:.0f} MiB, NCCL {nccl}: runtime.py nvls_bytes)"
                     if nvls else "")
                  + "; the allocator's reserve above allocated is not included",
                  *_how_sure(total, hw)],
    }


def _cache_notes(inf) -> list[str]:
    """What the model's own generate code keeps alive, when it is not transformers' current one."""
    out = []
    if inf.kv_cache.name != "dynamic":
        out.append(f"inference.kv_cache={inf.kv_cache.name}: each forward rebuilds the (key, value) tuples "
                   "while generate holds the previous step's"
                   + ("; the prompt's cache keeps the fused q|k|v projection output" if inf.kv_cache.name ==
                      "tuple_fused_qkv" else "") + " (launcher/infer.py _generate_phases)")
    if inf.prompt_logits.name == "all":
        out.append("inference.prompt_logits=all: the head computes every prompt position's logits, "
                   "held through the first decode step")
    return out


def _bnb_tensor_bytes(precision: str, double_quant: bool):
    """Bytes of a tensor of a bitsandbytes-converted meta model once loaded: a Linear4bit weight as
    quant.four_bit_weight_bytes (packed codes and QuantState, its default blocksize 64), a Linear8bitLt weight as
    quant.int8_weight_bytes (int8 plus fp32 row scales), anything else as it is."""
    def nbytes(module, t) -> int:
        kind = type(module).__name__
        if kind == "Linear4bit" and t is module.weight:
            return quant.four_bit_weight_bytes(t.numel(), double_quant=double_quant, quant_type=precision)["total_bytes"]
        if kind == "Linear8bitLt" and t is module.weight:
            return quant.int8_weight_bytes(*t.shape)["total_bytes"]
        return t.numel() * t.element_size()
    return nbytes


def _how_sure(device_total: int, hw) -> list[str]:
    """How sure a serving plan's "fits" is on a GPU: its headroom against the published
    underestimates (launcher/margin.py). Serving plans apply no margin; this says what one would."""
    sure = margin.confidence_note(device_total, hw.memory_bytes) if hw.device == "cuda" else ""
    return [f"the fullest GPU's {sure}"] if sure else []


def _header(config, spec, ispec) -> dict:
    """The model, hardware and request parts of a serving plan."""
    inf, hw = config.inference, config.hardware
    return {
        "model": {"name": spec.name, "num_params": ispec.num_params, "num_layers": ispec.num_layers,
                  "num_attention_heads": ispec.num_attention_heads,
                  "num_key_value_heads": ispec.num_key_value_heads, "head_dim": ispec.head_dim},
        "hardware": hw.name, "memory_bytes": hw.memory_bytes,
        "request": {"precision": inf.precision.name, "batch_size": inf.batch_size,
                    "prompt_len": inf.prompt_len, "gen_len": inf.gen_len, "tp_size": inf.tp_size,
                    "attn_implementation": inf.attn_implementation.name,
                    "double_quant": inf.double_quant, "kv_cache": inf.kv_cache.name,
                    "prompt_logits": inf.prompt_logits.name, "gptq_kernel": inf.gptq_kernel.name},
    }


def placed_plan(config, spec) -> dict:
    """infer_plan under `inference.device_map`: one entry per GPU in `devices`, the offloaded bytes
    in `offload`."""
    inf, hw = config.inference, config.hardware
    precision = inf.precision.name
    model = infer.meta_model(spec.hf_config, LOAD_DTYPES.get(precision, "bfloat16"))
    ispec = infer.inference_spec_from_hf_config(spec.hf_config, model)
    context = runtime.cuda_context_bytes(hw.cuda_context_bytes)
    cap = None if inf.max_memory_gib is None else int(inf.max_memory_gib * GIB)
    memory = device_map.max_memory(config.gpus, hw.memory_bytes - context, hw.host_memory_bytes, cap)
    if precision in BNB:
        quantizer = device_map.bnb_quantizer(model, precision, inf.double_quant)
        try:
            placement = device_map.place(model, inf.device_map.name, memory, quantizer,
                                         _bnb_tensor_bytes(precision, inf.double_quant))
        except ValueError as err:  # transformers' bitsandbytes quantizer refuses a map that offloads
            if "dispatched on the CPU" not in str(err):
                raise
            raise ConfigError(
                f"inference.device_map={inf.device_map.name} at inference.precision={precision} does not fit on "
                f"gpus={config.gpus} x {hw.name}: transformers would offload to the CPU, which bitsandbytes does only "
                "with llm_int8_enable_fp32_cpu_offload (not planned); use more GPUs (gpus=...) or a larger "
                "hardware profile") from None
    else:
        placement = device_map.place(model, inf.device_map.name, memory)
    per = infer.estimate_placed(ispec, placement, inf.precision.name, inf.batch_size, inf.prompt_len,
                                inf.gen_len, inf.attn_implementation.name, inf.kv_cache.name,
                                inf.prompt_logits.name)
    devices = []
    for gpu, e in per.items():
        total = e["peak_bytes"] + context
        devices.append({"device": gpu, "weight_bytes": e["weight_bytes"], "layers": e["layers"],
                        "layers_run": e["layers_run"],
                        "kv_cache_bytes": e["kv_cache_bytes"], "held_bytes": e["held_bytes"],
                        "activation_bytes": e["activation_bytes"],
                        "offload_transient_bytes": e["offload_transient_bytes"], "peak_phase": e["peak_phase"],
                        "peak_allocated_bytes": e["peak_bytes"], "runtime_bytes": context,
                        "device_total_bytes": total, "fits": total <= hw.memory_bytes})
    worst = max(devices, key=lambda d: d["device_total_bytes"])
    offload = {"cpu_bytes": placement.weight_bytes.get("cpu", 0), "disk_bytes": placement.weight_bytes.get("disk", 0),
               "layers": placement.layers.get("cpu", 0) + placement.layers.get("disk", 0),
               "cpu_limit_bytes": memory["cpu"], "main_gpu": placement.main_gpu,
               "max_memory": {str(k): v for k, v in memory.items()}}
    notes = [f"device_map={inf.device_map.name}: transformers' own device map (from_pretrained) of the model "
             f"on the meta device, with max_memory per GPU = "
             + (f"inference.max_memory_gib={inf.max_memory_gib}" if cap is not None else
                "capacity - CUDA context (what torch.cuda.mem_get_info reports after CUDA initialises)")
             + " and 90% of the host memory for the CPU; launcher/device_map.py",
             "KV cache and activations on the GPU that runs each layer; offloaded layers run on GPU "
             f"{placement.main_gpu}, which also holds the largest offloaded submodule's weights while it runs",
             "device total = peak tensor bytes + CUDA context; the allocator's reserve above allocated is not included",
             *_cache_notes(inf),
             *_how_sure(worst["device_total_bytes"], hw)]
    if offload["disk_bytes"]:
        notes.append("weights offloaded to disk: from_pretrained needs offload_folder=...")
    header = _header(config, spec, ispec)
    header["request"].update(device_map=inf.device_map.name, max_memory_gib=inf.max_memory_gib, gpus=config.gpus)
    return {
        **header,
        "per_gpu": {k: worst[k] for k in ("weight_bytes", "kv_cache_bytes", "held_bytes", "activation_bytes", "peak_phase",
                                          "peak_allocated_bytes", "runtime_bytes", "device_total_bytes")},
        "devices": devices,
        "offload": offload,
        "kv_cache_bytes_per_token": infer.kv_cache_bytes(ispec, 1, 1, 1, infer.value_bytes(inf.precision.name)),
        "fits": all(d["fits"] for d in devices),  # the map never gives the CPU more than its limit (disk)
        "notes": notes,
    }


def format_report(r: dict) -> str:
    q, g = r["request"], r["per_gpu"]
    gib = lambda n: f"{n / GIB:8.2f} GiB"  # noqa: E731
    if "devices" in r:
        return _format_placed(r, gib)
    lines = [f"{_served(r)}tensor parallel over {q['tp_size']} x {r['hardware']}; per GPU:",
             f"  weights          {gib(g['weight_bytes'])}",
             f"  KV cache         {gib(g['kv_cache_bytes'])}  ({r['kv_cache_bytes_per_token']:,} B per token, "
             f"{r['model']['num_key_value_heads']} KV heads)",
             *([f"  held by generate {gib(g['held_bytes'])}  (the previous step's cache"
                 + ("; at the first decode step also the prompt's logits)" if q["prompt_logits"] == "all" else ")")]
               if g["held_bytes"] else []),
             f"  activations      {gib(g['activation_bytes'])}  (largest forward; peak in {g['peak_phase']})",
             f"  peak allocated   {gib(g['peak_allocated_bytes'])}",
             f"  runtime          {gib(g['runtime_bytes'])}",
             f"  device total     {gib(g['device_total_bytes'])}  of {r['memory_bytes'] / GIB:.2f} GiB: "
             + ("fits" if r["fits"] else "does NOT fit")]
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def _served(r: dict) -> str:
    q = r["request"]
    return (f"{r['model']['name']} ({r['model']['num_params'] / 1e9:.2f}B params) served at {q['precision']}, "
            f"batch {q['batch_size']} x ({q['prompt_len']} prompt + {q['gen_len']} generated) tokens, ")


def _format_placed(r: dict, gib) -> str:
    q, o = r["request"], r["offload"]
    held = any(d["held_bytes"] for d in r["devices"])  # a column only where generate holds a previous cache
    lines = [f"{_served(r)}device_map={q['device_map']} over {q['gpus']} x {r['hardware']} "
             f"({r['memory_bytes'] / GIB:.2f} GiB each):",
             f"  {'GPU':>4} {'layers':>6} {'weights':>12} {'KV cache':>12} " + (f"{'held':>12} " if held else "")
             + f"{'activations':>12} {'offload copy':>12} {'peak alloc':>12} {'device total':>12}"]
    for d in r["devices"]:
        lines.append(f"  {d['device']:>4} {d['layers']:>6} {gib(d['weight_bytes'])} {gib(d['kv_cache_bytes'])} "
                     + (f"{gib(d['held_bytes'])} " if held else "")
                     + f"{gib(d['activation_bytes'])} {gib(d['offload_transient_bytes'])} "
                     f"{gib(d['peak_allocated_bytes'])} {gib(d['device_total_bytes'])}  "
                     + ("fits" if d["fits"] else "does NOT fit"))
    lines.append(f"  offloaded to the CPU: {gib(o['cpu_bytes']).strip()} (limit {o['cpu_limit_bytes'] / GIB:.2f} GiB)"
                 + (f", to disk: {gib(o['disk_bytes']).strip()}" if o["disk_bytes"] else "")
                 + (f"; its {o['layers']} layers run on GPU {o['main_gpu']}" if o["cpu_bytes"] or o["disk_bytes"] else ""))
    lines.append("  " + ("fits" if r["fits"] else "does NOT fit"))
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)

"""Per-GPU memory of serving a decoder LLM with transformers' `generate`: weights (16-bit, fp32 or
bitsandbytes int8/nf4/fp4), KV cache, and the activations of the largest forward.

`estimate_inference` is pure arithmetic on an `InferenceSpec` of plain numbers; `inference_spec_from_hf_config`
fills one from a config.json dict by building the model on the meta device (no weights).

Assumptions (stated once; each function cites its sources):
- Quantization follows transformers' bitsandbytes integration: every `nn.Linear`/`Conv1D` is replaced
  except the modules of `HfQuantizer.get_modules_to_not_convert` (tied weights, the output embeddings
  `lm_head`, the last module, `_keep_in_fp32_modules`), see transformers/integrations/bitsandbytes.py
  replace_with_bnb_linear and quantizers/base.py get_keys_to_not_convert. Embeddings, norms, biases and
  lm_head stay in the 16-bit load dtype. Defaults are BitsAndBytesConfig's (utils/quantization_config.py):
  no double quantization, blocksize 64 (bitsandbytes/nn/modules.py Params4bit).
- Tensor parallelism follows transformers' tp_plan for Llama (models/llama/configuration_llama.py
  base_model_tp_plan, modeling_llama.py `_tp_plan = {"lm_head": "colwise_gather_output"}`): every
  Linear inside the decoder layers is split over tp ranks (numel/tp, rows/tp for int8 scales; the small
  K/V projection replication when kv_heads < tp is ignored), an untied lm_head is split over the
  vocabulary, token/position embeddings, norms and biases are replicated. KV heads are split as vLLM's
  QKVParallelLinear does: kv_heads/tp per rank, or one replicated head per rank when tp >= kv_heads.
- Runtime terms outside tensors (CUDA context, allocator caching, NCCL) are not included here.
"""
from __future__ import annotations

from dataclasses import dataclass

from launcher import quant
from launcher.gptq import GPTQ_BITS, KERNEL_SWITCH_THRESHOLD, gptq_weight_bytes

PRECISIONS = ("bf16", "fp16", "fp32", "int8", "nf4", "fp4", "gptq_int4", "gptq_int8")
GPTQ_GROUP_SIZE = 128  # the group size of published GPTQ checkpoints (quantize_config.json), e.g. Qwen's Int4/Int8
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
KV_CACHES = ("dynamic", "tuple", "tuple_fused_qkv")  # launcher/config.py KvCache
PROMPT_LOGITS = ("last", "all")  # launcher/config.py PromptLogits
HALF_BYTES = 2
FP32_BYTES = 4


def value_bytes(precision: str) -> int:
    """Bytes of one unquantized weight, activation or cache value: 4 when the model is served in
    fp32 (from_pretrained(torch_dtype=torch.float32), transformers' default load dtype), else 2 (the
    16-bit load dtype, which the quantized types also keep for what they do not quantize)."""
    return FP32_BYTES if precision == "fp32" else HALF_BYTES


@dataclass(frozen=True)
class InferenceSpec:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    embedding_params: int  # nn.Embedding weights (tokens, positions): 16-bit, replicated under TP
    head_params: int  # untied output projection (0 when tied to the embedding): 16-bit, vocab-split under TP
    linear_weight_shapes: tuple  # (out_features, in_features) of every Linear weight bitsandbytes converts
    other_params: int  # norms, biases and anything else: 16-bit, replicated under TP
    gated_mlp: bool  # act(gate(x)) * up(x) (Llama) rather than act(fc(x)) (GPT-2, StarCoder)
    rotary_keys: bool = True  # keys rotated by rotary positions (a new tensor, not a view of the projection)

    @property
    def num_params(self) -> int:
        linear = sum(o * i for o, i in self.linear_weight_shapes)
        return self.embedding_params + self.head_params + linear + self.other_params


def kv_heads_per_gpu(num_key_value_heads: int, tp_size: int) -> int:
    """KV heads held by one TP rank. Source: vLLM model_executor/layers/linear.py QKVParallelLinear
    (`if tp_size >= total_num_kv_heads: num_kv_heads = 1` (replicated) else total/tp)."""
    if tp_size >= num_key_value_heads:
        if tp_size % num_key_value_heads:
            raise ValueError(f"tp_size={tp_size} is not a multiple of num_key_value_heads={num_key_value_heads}")
        return 1
    if num_key_value_heads % tp_size:
        raise ValueError(f"num_key_value_heads={num_key_value_heads} is not divisible by tp_size={tp_size}")
    return num_key_value_heads // tp_size


def kv_cache_bytes(spec: InferenceSpec, batch_size: int, num_tokens: int, tp_size: int = 1,
                   bytes_per_value: int = HALF_BYTES) -> int:
    """Keys and values of every layer: 2 x num_layers x batch x tokens x kv_heads x head_dim x bytes.
    GQA/MQA store num_key_value_heads, not attention heads (GQA, arXiv:2305.13245). Source:
    transformers/cache_utils.py DynamicLayer.update (keys/values [batch, kv_heads, seq, head_dim])."""
    kv_heads = kv_heads_per_gpu(spec.num_key_value_heads, tp_size)
    return 2 * spec.num_layers * batch_size * num_tokens * kv_heads * spec.head_dim * bytes_per_value


def gptq_buffer_bytes(spec: InferenceSpec, precision: str, gptq_kernel: str, tp_size: int = 1) -> int:
    """AutoGPTQ's exllama buffers on a GPU: `autogptq_post_init` allocates, per device, a `temp_dq` of
    fp16 [1, max over its exllama layers of qweight.numel() * 8] (in x out values at 4 bits), into which
    a large input's matmul dequantizes the weight before cuBLAS, and a `temp_state` of [1, 1] without
    act-order (auto_gptq v0.4.2 modeling/_utils.py autogptq_post_init; the exllama QuantLinear is chosen
    for 4 bits unless disable_exllama, utils/import_utils.py dynamically_import_QuantLinear)."""
    if gptq_kernel != "exllama" or precision != "gptq_int4" or not spec.linear_weight_shapes:
        return 0
    temp_dq = HALF_BYTES * max(-(-o // tp_size) * i for o, i in spec.linear_weight_shapes)
    return temp_dq + HALF_BYTES  # and temp_state, fp16 [1, 1]


def weight_bytes(spec: InferenceSpec, precision: str, tp_size: int = 1, blocksize: int = 64,
                 double_quant: bool = False, gptq_kernel: str = "cuda_old") -> dict:
    """Per-GPU weight bytes. Linear weights use launcher.quant's bitsandbytes layouts for int8/nf4/fp4
    and 2 bytes otherwise; see the module docstring for what is kept 16-bit and what TP splits. A GPTQ
    model served by the exllama kernel adds its dequantization buffer (gptq_buffer_bytes)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    dense = value_bytes(precision)
    linear = 0
    for out_features, in_features in spec.linear_weight_shapes:
        shard_out = -(-out_features // tp_size)
        if precision == "int8":
            linear += quant.int8_weight_bytes(shard_out, in_features)["total_bytes"]
        elif precision in ("nf4", "fp4"):
            linear += quant.four_bit_weight_bytes(shard_out * in_features, blocksize, double_quant,
                                                  quant_type=precision)["total_bytes"]
        elif precision in GPTQ_BITS:  # QuantLinear buffers; its fp16 bias is counted with the others
            linear += gptq_weight_bytes(in_features, shard_out, GPTQ_BITS[precision], GPTQ_GROUP_SIZE)
        else:
            linear += shard_out * in_features * dense
    out = {
        "linear_weight_bytes": linear,
        "embedding_bytes": spec.embedding_params * dense,
        "head_bytes": -(-spec.head_params // tp_size) * dense,
        "other_weight_bytes": spec.other_params * dense,
    }
    if gptq_kernel == "exllama" and precision == "gptq_int4":
        out["gptq_buffer_bytes"] = gptq_buffer_bytes(spec, precision, gptq_kernel, tp_size)
    out["total_bytes"] = sum(out.values())
    return out


def forward_activation_bytes(spec: InferenceSpec, precision: str, batch_size: int, query_len: int,
                             key_len: int, tp_size: int = 1, attn_implementation: str = "sdpa",
                             logits_to_keep: int = 1, head: bool = True, gptq_kernel: str = "cuda_old") -> int:
    """Peak live activations of one no-grad forward over `query_len` new tokens attending to `key_len`
    (the largest of the attention, MLP and head phases, plus the quantized matmul's temporary):
    - each phase keeps the residual stream and its normed copy: 2 x batch x q x hidden;
    - attention: q, k, v and the output; eager adds the scores, upcast to fp32 by the softmax while the
      16-bit scores and the 16-bit result are alive (batch x heads x q x k x (2+4+2) bytes:
      models/llama/modeling_llama.py eager_attention_forward), and repeat_kv's copies of K and V expanded
      to all heads; sdpa/flash keep no q x k tensor (on GPU);
    - MLP: act(gate(x)) and up(x) and their product (3 x batch x q x intermediate) for gated MLPs,
      fc(x) and act(fc(x)) (2 x) otherwise;
    - head: `generate` sets logits_to_keep=1 (generation/utils.py GenerationMixin.generate, "avoid
      computing the whole logit matrix") and copies the last logits to fp32 (`_sample`:
      `outputs.logits[:, -1].to(copy=True, dtype=torch.float32)`); logits_to_keep=0 means all positions;
      head=False: a GPU of a device map that does not compute the logits;
    - nf4/fp4 prefill: bitsandbytes' gemm_4bit dequantizes the weight to 16 bits and calls F.linear
      when the row count exceeds its kernel's limit (backends/cuda/ops.py gemm_4bit,
      _dequant_linear_fallback): one 16-bit copy of the largest weight shard;
    - int8: MatMul8bitLt quantizes the input to int8 plus fp32 row scales and int8_scaled_mm makes an
      int32 product before dequantizing (autograd/_functions.py, backends/default/ops.py);
    - GPTQ: cuda_old as launcher/gptq.py; exllama writes its fp16 output only, dequantizing a large
      input's weight into its preallocated buffer (auto_gptq v0.4.2 nn_modules/qlinear/qlinear_exllama.py
      ext_q4_matmul; the buffer is in weight_bytes)."""
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}")
    tokens = batch_size * query_len
    heads = max(1, spec.num_attention_heads // tp_size)
    kv_heads = kv_heads_per_gpu(spec.num_key_value_heads, tp_size)
    v = value_bytes(precision)
    residual = 2 * tokens * spec.hidden_size * v
    attention = tokens * (2 * heads + 2 * kv_heads) * spec.head_dim * v
    if attn_implementation == "eager":  # an fp32 model's softmax result is already fp32: no third copy
        scores = v + FP32_BYTES + (v if v != FP32_BYTES else 0)
        attention += batch_size * heads * query_len * key_len * scores
        attention += 2 * batch_size * heads * key_len * spec.head_dim * v  # repeat_kv copies
    mlp = (3 if spec.gated_mlp else 2) * tokens * -(-spec.intermediate_size // tp_size) * v
    kept = query_len if logits_to_keep == 0 else min(logits_to_keep, query_len)
    logits = batch_size * spec.vocab_size * (kept * v + FP32_BYTES) if head else 0
    temp = 0 if gptq_kernel == "exllama" else _matmul_temp_bytes(spec, precision, tokens, tp_size)
    return max(residual + attention, residual + mlp, logits) + temp


def _matmul_temp_bytes(spec: InferenceSpec, precision: str, tokens: int, tp_size: int) -> int:
    """Transient of one quantized matmul (see forward_activation_bytes)."""
    if not spec.linear_weight_shapes or precision in ("bf16", "fp16", "fp32"):
        return 0
    if precision == "int8":
        return max(tokens * (i + FP32_BYTES * -(-o // tp_size)) + tokens * FP32_BYTES
                   for o, i in spec.linear_weight_shapes)
    if precision in GPTQ_BITS:  # launcher/gptq.py: the CUDA kernel's fp32 output up to 128 rows,
        # above them the torch path's int32 unpacking plus its int8 narrowing of the whole weight
        if tokens <= KERNEL_SWITCH_THRESHOLD:
            return max(tokens * -(-o // tp_size) * FP32_BYTES for o, _ in spec.linear_weight_shapes)
        return max(-(-o // tp_size) * i for o, i in spec.linear_weight_shapes) * (FP32_BYTES + 1)
    return max(-(-o // tp_size) * i for o, i in spec.linear_weight_shapes) * HALF_BYTES


def estimate_inference(spec: InferenceSpec, precision: str, batch_size: int, prompt_len: int, gen_len: int,
                       tp_size: int = 1, attn_implementation: str = "sdpa", blocksize: int = 64,
                       double_quant: bool = False, kv_bytes_per_value: int | None = None,
                       kv_cache: str = "dynamic", prompt_logits: str = "last", gptq_kernel: str = "cuda_old") -> dict:
    """Per-GPU bytes of `generate(batch_size x prompt_len, max_new_tokens=gen_len)`.

    peak = weights + the largest phase of `_generate_phases`: the prompt's forward (prefill), or a
    decode step's forward with the cache it builds, what generate still holds from the step before
    and the forward's activations (forward_activation_bytes at q=1)."""
    total_tokens = prompt_len + gen_len
    kv_bytes_per_value = kv_bytes_per_value or value_bytes(precision)  # the cache keeps the model's dtype
    weights = weight_bytes(spec, precision, tp_size, blocksize, double_quant, gptq_kernel)
    keep = 0 if prompt_logits == "all" else 1
    prefill_act = forward_activation_bytes(spec, precision, batch_size, prompt_len, prompt_len, tp_size,
                                           attn_implementation, logits_to_keep=keep, gptq_kernel=gptq_kernel)
    decode_act = forward_activation_bytes(spec, precision, batch_size, 1, total_tokens, tp_size,
                                          attn_implementation, gptq_kernel=gptq_kernel)
    phase = _generate_phases(spec, spec.num_layers, batch_size, prompt_len, total_tokens, tp_size, kv_bytes_per_value,
                             prefill_act, decode_act, kv_cache, _prompt_logits_bytes(spec, precision, batch_size,
                                                                                    prompt_len, prompt_logits))
    return {
        "precision": precision,
        "tp_size": tp_size,
        "weight_bytes": weights["total_bytes"],
        "weight_breakdown": weights,
        "kv_cache_bytes": phase.kv,
        "kv_cache_bytes_per_token": kv_cache_bytes(spec, 1, 1, tp_size, kv_bytes_per_value),
        "held_bytes": phase.held,
        "prefill_activation_bytes": prefill_act,
        "decode_activation_bytes": decode_act + phase.cat_transient,
        "peak_phase": phase.name,
        "peak_bytes": weights["total_bytes"] + phase.peak,
    }


def _prompt_logits_bytes(spec: InferenceSpec, precision: str, batch_size: int, prompt_len: int,
                         prompt_logits: str) -> int:
    """The prompt's 16-bit logits over every position (prompt_logits=all): generate's loop binds the
    forward's output to `outputs` and rebinds it only when the next forward returns, so they are alive
    through the first decode step (transformers 4.3x generation/utils.py greedy_search/sample:
    `outputs = self(**model_inputs, ...)` at the top of the loop)."""
    if prompt_logits not in PROMPT_LOGITS:
        raise ValueError(f"prompt_logits must be one of {PROMPT_LOGITS}, got {prompt_logits!r}")
    return batch_size * prompt_len * spec.vocab_size * value_bytes(precision) if prompt_logits == "all" else 0


@dataclass(frozen=True)
class Phase:
    """The peak phase of one GPU's share of generate: its name, the KV cache the model holds or
    builds then, what generate still holds besides it (the previous step's tuple, the prompt's
    logits), DynamicCache's torch.cat transient, and the peak tensor bytes above the weights."""
    name: str
    kv: int
    held: int
    cat_transient: int
    peak: int


def _generate_phases(spec: InferenceSpec, layers: int, batch_size: int, prompt_len: int, total_tokens: int,
                     tp_size: int, kv_bytes_per_value: int, prefill_act: int, decode_act: int,
                     kv_cache: str = "dynamic", prompt_logits_bytes: int = 0) -> Phase:
    """The peak phase of `layers` layers of generate on one GPU (see Phase), by cache kind:

    - dynamic (transformers' DynamicCache): prefill = KV cache of the prompt + prefill activations;
      last decode = full KV cache (prompt + gen) + decode activations + one layer's K (or V) being
      re-allocated: DynamicLayer.update grows the cache with torch.cat, so old and new tensors of that
      layer are both alive (transformers/cache_utils.py).
    - tuple: each layer returns a new (key, value) made by torch.cat(past, new) and generate keeps the
      previous step's tuple in `model_kwargs["past_key_values"]` until the forward returns
      (transformers 4.35 models/llama/modeling_llama.py LlamaAttention.forward
      `key_states = torch.cat([past_key_value[0], key_states], dim=2)`, `past_key_value = (key_states,
      value_states)`; generation/utils.py `_update_model_kwargs_for_generation` after the forward), so a
      decode step over n cached tokens holds the old cache (n) and the new one (n + 1). The first
      decode step also holds the prompt's logits when the head computed all of them. With gen_len
      tokens there are gen_len - 1 decode forwards (the last token is sampled, never fed back).
    - tuple_fused_qkv: as tuple, but the prompt's cache entries are views of a fused q|k|v projection
      output, so each layer's prompt cache keeps that whole output (q, k and v) alive, plus the key's
      own copy when rotary positions make a new tensor of it (Qwen's modeling_qwen.py
      QWenAttention.forward: `query, key, value = mixed_x_layer.split(...)`, `_split_heads` a view,
      `key = apply_rotary_pos_emb(key, ...)`, `present = (key, value)`). Decode steps cat into new
      tensors, as tuple."""
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")
    per_token = kv_cache_bytes(spec, batch_size, 1, tp_size, kv_bytes_per_value) // spec.num_layers  # one layer
    if kv_cache == "dynamic":
        kv_full = layers * per_token * total_tokens
        cat_transient = per_token * total_tokens // 2 if layers else 0  # one layer's K (or V)
        prefill = layers * per_token * prompt_len + prefill_act
        decode = kv_full + decode_act + cat_transient
        if prefill >= decode:
            return Phase("prefill", kv_full, 0, cat_transient, prefill)
        return Phase("decode", kv_full, 0, cat_transient, decode)
    prompt_token = per_token
    if kv_cache == "tuple_fused_qkv":
        kv_heads = kv_heads_per_gpu(spec.num_key_value_heads, tp_size)
        heads = max(1, spec.num_attention_heads // tp_size)
        fused = (heads + 2 * kv_heads) * spec.head_dim
        rotated_key = kv_heads * spec.head_dim if spec.rotary_keys else 0
        prompt_token = batch_size * (fused + rotated_key) * kv_bytes_per_value
    prompt_cache = layers * prompt_token * prompt_len
    phases = [Phase("prefill", prompt_cache, 0, 0, prompt_cache + prefill_act)]
    steps = total_tokens - prompt_len - 1  # decode forwards
    if steps >= 1:  # the first: the prompt's cache (and logits) held, the cache of prompt + 1 built
        new = layers * per_token * (prompt_len + 1)
        held = prompt_cache + prompt_logits_bytes
        phases.append(Phase("decode", new, held, 0, new + held + decode_act))
    if steps >= 2:  # the last: the cache of total - 2 tokens held, that of total - 1 built
        new, held = layers * per_token * (total_tokens - 1), layers * per_token * (total_tokens - 2)
        phases.append(Phase("decode", new, held, 0, new + held + decode_act))
    return max(phases, key=lambda p: p.peak)


def estimate_placed(spec: InferenceSpec, placement, precision: str, batch_size: int, prompt_len: int,
                    gen_len: int, attn_implementation: str = "sdpa", kv_cache: str = "dynamic",
                    prompt_logits: str = "last") -> dict:
    """Per-GPU bytes of `generate` on a model split by a device map (launcher/device_map.py
    `Placement`): each GPU holds the weights placed on it and the KV cache of the layers that run on
    it (DynamicCache keeps each layer's keys and values on that layer's device: cache_utils.py
    DynamicLayer.update concatenates onto the incoming keys); a GPU that runs layers holds the
    activations of one layer's forward (forward_activation_bytes), the logits only where the head
    runs; the main GPU also holds the largest offloaded submodule's weights while it runs
    (launcher/device_map.py). Peak per GPU = weights + offload transient + max(prefill, last decode
    step), the phases as in estimate_inference."""
    total_tokens = prompt_len + gen_len
    gpus = sorted(d for d in placement.max_memory if d not in ("cpu", "disk"))  # every GPU, used or not
    out = {}
    for gpu in gpus:
        layers = placement.layers_run(gpu)
        head = gpu == placement.head_gpu
        runs = layers > 0 or head
        keep = {prompt_len: 0 if prompt_logits == "all" else 1, 1: 1}
        act = {q: forward_activation_bytes(spec, precision, batch_size, q, k, 1, attn_implementation,
                                           logits_to_keep=keep[q], head=head)
               if runs else 0 for q, k in ((prompt_len, prompt_len), (1, total_tokens))}
        logits = _prompt_logits_bytes(spec, precision, batch_size, prompt_len, prompt_logits) if head else 0
        phase = _generate_phases(spec, layers, batch_size, prompt_len, total_tokens, 1, value_bytes(precision),
                                 act[prompt_len], act[1], kv_cache, logits)
        weights = placement.weight_bytes.get(gpu, 0)
        transient = placement.offload_transient_bytes if gpu == placement.main_gpu else 0
        out[gpu] = {"weight_bytes": weights, "layers": placement.layers.get(gpu, 0), "layers_run": layers,
                    "kv_cache_bytes": phase.kv, "held_bytes": phase.held,
                    "activation_bytes": max(act.values()), "offload_transient_bytes": transient,
                    "peak_phase": phase.name,
                    "peak_bytes": weights + transient + phase.peak}
    return out


def meta_model(hf_config: dict, dtype: str | None = None):
    """The model of a config.json dict on the meta device (no weights), in `dtype` (a torch dtype
    name, e.g. "float16"; None: transformers' default)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in hf_config.items() if k != "model_type"}
    cfg = AutoConfig.for_model(hf_config["model_type"], **fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, **({"dtype": getattr(torch, dtype)} if dtype else {}))


def inference_spec_from_hf_config(hf_config: dict, model=None) -> InferenceSpec:
    """Count parameters by role on a meta-device model built from a config.json dict (or on `model`,
    built by `meta_model`). Which Linear weights are quantized is decided by transformers itself
    (HfQuantizer.get_modules_to_not_convert, as quantizers/quantizer_bnb_4bit.py calls it, and
    should_convert_module)."""
    import torch
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    model = meta_model(hf_config) if model is None else model
    cfg = model.config
    skip = HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    owners = {}  # a tied weight has two owners; the embedding role wins
    for name, m in model.named_modules():
        for p in m.parameters(recurse=False):
            if id(p) not in owners or not isinstance(owners[id(p)][1], torch.nn.Embedding):
                owners[id(p)] = (name, m)
    head = model.get_output_embeddings()
    counts = {"embedding": 0, "head": 0, "other": 0}
    shapes = []
    for p in model.parameters():
        name, module = owners[id(p)]
        if isinstance(module, torch.nn.Embedding):
            counts["embedding"] += p.numel()
        elif module is head and p is module.weight:
            counts["head"] += p.numel()
        elif (type(module) is torch.nn.Linear or isinstance(module, Conv1D)) and p is module.weight \
                and should_convert_module(name, skip):
            shape = tuple(p.shape) if type(module) is torch.nn.Linear else tuple(p.shape)[::-1]
            shapes.append(shape)
        else:
            counts["other"] += p.numel()
    rotary = any("rotary" in type(m).__name__.lower() for m in model.modules())
    return _spec_numbers(cfg, shapes, counts, rotary)


def _spec_numbers(cfg, shapes: list, counts: dict, rotary: bool = True) -> InferenceSpec:
    def get(*names, default=None):
        return next((getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None), default)

    hidden = int(get("hidden_size", "n_embd"))
    heads = int(get("num_attention_heads", "n_head"))
    if getattr(cfg, "multi_query", False) and not getattr(cfg, "new_decoder_architecture", False):
        kv_heads = 1
    else:
        kv_heads = int(get("num_key_value_heads", "num_kv_heads", default=heads))
    intermediate = int(get("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden))
    num_intermediate_outputs = sum(1 for o, i in shapes if (o, i) == (intermediate, hidden))
    num_layers = int(get("num_hidden_layers", "n_layer"))
    return InferenceSpec(
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=int(get("head_dim", default=hidden // heads)), intermediate_size=intermediate,
        vocab_size=int(cfg.vocab_size), embedding_params=counts["embedding"], head_params=counts["head"],
        linear_weight_shapes=tuple(shapes), other_params=counts["other"],
        gated_mlp=num_intermediate_outputs >= 2 * num_layers, rotary_keys=rotary,
    )


"""Inference memory: KV cache, quantized weights per GPU, tensor-parallel splitting."""
import warnings

import pytest

from launcher import infer

torch = pytest.importorskip("torch")

STARCODER = {  # bigcode/starcoder config.json (architecture fields)
    "model_type": "gpt_bigcode", "architectures": ["GPTBigCodeForCausalLM"], "n_embd": 6144, "n_layer": 40,
    "n_head": 48, "multi_query": True, "n_inner": 24576, "vocab_size": 49152, "n_positions": 8192,
    "activation_function": "gelu_pytorch_tanh", "bos_token_id": 0, "eos_token_id": 0,
}
TINY_LLAMA = {  # GQA (4 heads, 2 KV heads) with an explicit head_dim different from hidden/heads
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 384,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 48,
    "vocab_size": 1000, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


def _spec(num_layers, heads, kv_heads, head_dim, hidden=8192, intermediate=28672, vocab=32000):
    return infer.InferenceSpec(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
                               num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
                               vocab_size=vocab, embedding_params=vocab * hidden, head_params=vocab * hidden,
                               linear_weight_shapes=((hidden, hidden),) * num_layers, other_params=hidden,
                               gated_mlp=True)


def test_kv_cache_per_token_llama2_70b_uses_kv_heads():
    spec = _spec(num_layers=80, heads=64, kv_heads=8, head_dim=128)
    assert infer.kv_cache_bytes(spec, batch_size=1, num_tokens=1) == 2 * 80 * 8 * 128 * 2 == 327_680
    assert infer.kv_cache_bytes(spec, batch_size=4, num_tokens=4096) == 4 * 4096 * 327_680


def test_kv_cache_without_gqa_llama2_7b():
    spec = _spec(num_layers=32, heads=32, kv_heads=32, head_dim=128, hidden=4096)
    assert infer.kv_cache_bytes(spec, 1, 1) == 2 * 32 * 32 * 128 * 2 == 524_288
    assert infer.estimate_inference(spec, "bf16", 1, 8, 8)["kv_cache_bytes_per_token"] == 524_288


def test_tp2_halves_kv_cache_and_sharded_weights():
    spec = _spec(num_layers=80, heads=64, kv_heads=8, head_dim=128)
    one = infer.estimate_inference(spec, "bf16", 2, 1024, 256, tp_size=1)
    two = infer.estimate_inference(spec, "bf16", 2, 1024, 256, tp_size=2)
    assert two["kv_cache_bytes"] * 2 == one["kv_cache_bytes"]
    w1, w2 = one["weight_breakdown"], two["weight_breakdown"]
    assert w2["linear_weight_bytes"] * 2 == w1["linear_weight_bytes"]
    assert w2["head_bytes"] * 2 == w1["head_bytes"]
    assert w2["embedding_bytes"] == w1["embedding_bytes"]  # replicated (transformers tp_plan)


def test_mqa_kv_head_is_replicated_not_split_under_tp():
    spec = _spec(num_layers=40, heads=48, kv_heads=1, head_dim=128, hidden=6144)
    assert infer.kv_cache_bytes(spec, 1, 100, tp_size=2) == infer.kv_cache_bytes(spec, 1, 100, tp_size=1)
    with pytest.raises(ValueError):
        infer.kv_heads_per_gpu(8, 3)


def test_generate_keeps_only_last_token_logits():
    spec = _spec(num_layers=2, heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=1024, vocab=128_000)
    full_logits = infer.forward_activation_bytes(spec, "bf16", 4, 2048, 2048, logits_to_keep=0)
    last_only = infer.forward_activation_bytes(spec, "bf16", 4, 2048, 2048, logits_to_keep=1)
    assert full_logits >= 4 * 2048 * 128_000 * 2
    assert last_only < 4 * 2048 * 128_000 * 2 / 5  # the layers dominate once only one position is kept


def test_eager_attention_adds_quadratic_scores():
    spec = _spec(num_layers=2, heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=1024, vocab=1000)
    sdpa = infer.forward_activation_bytes(spec, "bf16", 1, 4096, 4096, attn_implementation="sdpa")
    eager = infer.forward_activation_bytes(spec, "bf16", 1, 4096, 4096, attn_implementation="eager")
    # 16-bit scores, their fp32 softmax and the 16-bit result: at least 8 bytes per score.
    assert eager >= 32 * 4096 * 4096 * 8 > sdpa


@pytest.fixture(scope="module")
def starcoder_spec():
    return infer.inference_spec_from_hf_config(STARCODER)


def test_starcoder_sizes_match_published_orders(starcoder_spec):
    spec = starcoder_spec
    assert 15.4e9 < spec.num_params < 15.6e9  # "15.5B parameter models" (StarCoder paper, arXiv:2305.06161)
    assert spec.num_key_value_heads == 1 and spec.head_dim == 128 and spec.head_params == 0  # MQA, tied head
    gb = {p: infer.weight_bytes(spec, p)["total_bytes"] / 1e9 for p in ("bf16", "int8", "nf4")}
    assert 30.5 < gb["bf16"] < 31.5
    assert 15.0 < gb["int8"] < 16.5
    assert 9.0 < gb["nf4"] < 10.0
    dq = infer.weight_bytes(spec, "nf4", double_quant=True)["total_bytes"] / 1e9
    assert dq < gb["nf4"]


def test_starcoder_tp2_splits_layer_linears(starcoder_spec):
    one = infer.weight_bytes(starcoder_spec, "bf16", tp_size=1)
    two = infer.weight_bytes(starcoder_spec, "bf16", tp_size=2)
    assert two["linear_weight_bytes"] * 2 == one["linear_weight_bytes"]
    assert two["embedding_bytes"] == one["embedding_bytes"]


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    cfg = AutoConfig.for_model("llama", **fields)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    return path


def _loaded_weight_bytes(model) -> int:
    """Bytes of every parameter storage plus bitsandbytes' QuantState tensors and int8 row scales."""
    storages = {}

    def add(t):
        if isinstance(t, torch.Tensor):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    def add_state(qs):
        for t in (qs.absmax, qs.code, qs.offset):
            add(t)
        if qs.state2 is not None:
            add_state(qs.state2)

    for p in model.parameters():
        add(p)
        add(getattr(p, "SCB", None))
        if getattr(p, "quant_state", None) is not None:
            add_state(p.quant_state)
    return sum(storages.values())


@pytest.mark.parametrize("precision,double_quant", [("nf4", True), ("fp4", False), ("int8", False),
                                                    ("bf16", False), ("fp32", False)])
def test_weights_match_transformers_bitsandbytes_load(tiny_llama_dir, precision, double_quant):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if precision == "int8":
        qconfig = BitsAndBytesConfig(load_in_8bit=True)
    elif precision in ("nf4", "fp4"):
        qconfig = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=precision,
                                     bnb_4bit_use_double_quant=double_quant,
                                     bnb_4bit_compute_dtype=torch.bfloat16)
    else:
        qconfig = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            tiny_llama_dir, quantization_config=qconfig, device_map="cpu",
            dtype=torch.float32 if precision == "fp32" else torch.bfloat16)
    spec = infer.inference_spec_from_hf_config(TINY_LLAMA)
    expected = infer.weight_bytes(spec, precision, double_quant=double_quant)["total_bytes"]
    assert _loaded_weight_bytes(model) == expected


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_kv_cache_matches_dynamic_cache_after_generate(tiny_llama_dir, precision):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32 if precision == "fp32" else torch.bfloat16)
    batch_size, prompt_len, gen_len = 3, 11, 5
    ids = torch.randint(3, 1000, (batch_size, prompt_len))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len, min_new_tokens=gen_len,
                         do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    cache_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    spec = infer.inference_spec_from_hf_config(TINY_LLAMA)
    assert spec.head_dim == 48 and spec.num_key_value_heads == 2 and spec.gated_mlp
    # The last generated token is sampled but never fed back, so the cache holds prompt + gen - 1 tokens.
    assert cache_bytes == infer.kv_cache_bytes(spec, batch_size, prompt_len + gen_len - 1,
                                               bytes_per_value=infer.value_bytes(precision))


def _storage_bytes(*trees) -> int:
    """Bytes of the distinct storages behind every tensor of nested tuples (views share one)."""
    seen = {}
    stack = list(trees)
    while stack:
        x = stack.pop()
        if isinstance(x, tuple):
            stack.extend(x)
        else:
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    return sum(seen.values())


def _qwen_prompt_presents(layers, batch, prompt_len, heads, kv_heads, head_dim, fused):
    """Per-layer (key, value) of a prompt's forward as Qwen's modeling_qwen.py QWenAttention.forward
    makes them: one fused c_attn output split into views, the key rotated into a new tensor, the value
    kept as the view (fused=False: a separate value projection, as Llama's v_proj)."""
    out = []
    for _ in range(layers):
        q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
        if fused:
            mixed = torch.ones(batch, prompt_len, q_dim + 2 * kv_dim, dtype=torch.bfloat16)
            _, key, value = mixed.split([q_dim, kv_dim, kv_dim], dim=2)
        else:
            key = torch.ones(batch, prompt_len, kv_dim, dtype=torch.bfloat16)
            value = torch.ones(batch, prompt_len, kv_dim, dtype=torch.bfloat16)
        key = key.view(batch, prompt_len, kv_heads, head_dim) * 2  # rotary: a new tensor
        out.append((key, value.view(batch, prompt_len, kv_heads, head_dim)))
    return tuple(out)


@pytest.mark.parametrize("kv_cache", ["tuple", "tuple_fused_qkv"])
def test_tuple_caches_hold_what_the_prompt_forward_and_decode_steps_keep_alive(kv_cache):
    """A tuple cache's peaks against the storages a Qwen-style forward and generate loop really keep:
    the prompt's presents (views of the fused projection keep all of it), then each decode step's new
    tuple made by torch.cat while the previous step's is still held; gen_len - 1 decode forwards."""
    layers, batch, prompt_len, gen_len, heads, kv_heads, head_dim = 3, 2, 7, 4, 4, 2, 8
    spec = _spec(layers, heads, kv_heads, head_dim, hidden=heads * head_dim, intermediate=64, vocab=50)
    fused = kv_cache == "tuple_fused_qkv"
    past = _qwen_prompt_presents(layers, batch, prompt_len, heads, kv_heads, head_dim, fused)
    prefill = infer._generate_phases(spec, layers, batch, prompt_len, prompt_len + 1, 1, 2, 0, 0, kv_cache)
    assert prefill.name == "prefill" and prefill.kv == _storage_bytes(past)

    peak = 0
    for _ in range(gen_len - 1):
        step = torch.ones(batch, 1, kv_heads, head_dim, dtype=torch.bfloat16)
        new = tuple((torch.cat((k, step), dim=1), torch.cat((v, step), dim=1)) for k, v in past)
        peak = max(peak, _storage_bytes(past, new))  # generate rebinds its past only after the forward
        past = new
    phase = infer._generate_phases(spec, layers, batch, prompt_len, prompt_len + gen_len, 1, 2, 0, 0, kv_cache)
    assert phase.kv + phase.held == phase.peak == max(peak, prefill.peak)
    assert _storage_bytes(past) == infer.kv_cache_bytes(spec, batch, prompt_len + gen_len - 1)
    if fused:  # the prompt's fused cache is larger than keys and values
        assert prefill.kv > infer.kv_cache_bytes(spec, batch, prompt_len)


def test_prompt_logits_all_are_held_through_the_first_decode_step():
    spec = _spec(8, 4, 4, 8, hidden=32, intermediate=64, vocab=1000)
    last = infer.estimate_inference(spec, "bf16", 1, 512, 2, kv_cache="tuple", prompt_logits="last")
    every = infer.estimate_inference(spec, "bf16", 1, 512, 2, kv_cache="tuple", prompt_logits="all")
    assert last["peak_phase"] == every["peak_phase"] == "decode"
    assert last["held_bytes"] == infer.kv_cache_bytes(spec, 1, 512)  # the prompt's tuple
    assert every["held_bytes"] - last["held_bytes"] == 512 * 1000 * 2  # and its [1, 512, vocab] 16-bit logits
    assert every["prefill_activation_bytes"] >= 512 * 1000 * 2


def test_exllama_buffer_is_autogptqs_temp_dq_of_the_largest_quantized_weight():
    """auto_gptq v0.4.2 autogptq_post_init: temp_dq = fp16 [1, max qweight.numel() * 8] per device,
    temp_state fp16 [1, 1] without act-order; qweight as launcher/gptq.py's stand-in lays it out."""
    from launcher import gptq

    linears = [torch.nn.Linear(256, 768, bias=False), torch.nn.Linear(512, 128, bias=False)]
    gptq.gptq_stand_in(linears, bits=4, group_size=128)
    temp_dq = max(m.qweight.numel() for m in linears) * 8 * 2
    spec = infer.InferenceSpec(num_layers=1, hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                               head_dim=64, intermediate_size=512, vocab_size=100, embedding_params=0,
                               head_params=0, linear_weight_shapes=((768, 256), (128, 512)), other_params=0,
                               gated_mlp=False)
    assert infer.gptq_buffer_bytes(spec, "gptq_int4", "exllama") == temp_dq + 2
    with_buffer = infer.weight_bytes(spec, "gptq_int4", gptq_kernel="exllama")
    assert with_buffer["total_bytes"] - infer.weight_bytes(spec, "gptq_int4")["total_bytes"] == temp_dq + 2
    assert infer.gptq_buffer_bytes(spec, "gptq_int8", "exllama") == 0  # the exllama kernel is 4-bit only


def test_rotary_keys_are_read_from_the_model(starcoder_spec):
    assert infer.inference_spec_from_hf_config(TINY_LLAMA).rotary_keys  # LlamaRotaryEmbedding
    assert not starcoder_spec.rotary_keys  # learned positions: the key stays a view of c_attn

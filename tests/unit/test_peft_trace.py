"""The LoRA / QLoRA trace (launcher/trace.py trainable='lora') against a real CPU step of the same
peft model (live storage bytes), and QLoRA's 4-bit storage rows against bitsandbytes."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from launcher import peft as lp  # noqa: E402
from launcher import quant  # noqa: E402
from launcher import trace as tr  # noqa: E402
from launcher.steptrace import Kind  # noqa: E402
from reference_step import train_one_step  # noqa: E402

VOCAB = 320


def llama(num_layers=2):
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, num_hidden_layers=num_layers)


def lora_key(cfg=None, **kw):
    fields = dict(num_layers=2, micro_batch_size=2, seq_len=128, trainable="lora", lora_r=8,
                  lora_alpha=16, lora_dropout=0.05, optimizer="adamw_foreach")
    fields.update(kw)
    return tr.TraceKey(tr.canonical_config_json(cfg or llama()), **fields)


def real_lora_step(k: tr.TraceKey):
    """The step on real tensors: build, peft.get_peft_model (launcher.peft.apply_lora), AdamW over
    the trainable parameters, forward + loss, backward, step, zero_grad, under the worker's live
    storage tracker (the MemTracker accounting; MemTracker itself cannot hook a frozen model's
    outputs that need no gradient), entered before the model is built."""
    from launcher.worker.storage_tracker import StorageTracker

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(**json.loads(k.hf_config_json))
    cfg.num_hidden_layers, cfg.use_cache = k.num_layers, False
    mt = StorageTracker()
    with mt:
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, k.param_dtype),
                                                              attn_implementation=k.attn_implementation)
        model.train()
        if k.gradient_checkpointing:
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        model = lp.apply_lora(model, k.lora_settings(), autocast_adapter_dtype=k.adapter_autocast)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, foreach=True) if k.optimizer != "none" else None
        train_one_step(model, k, opt, VOCAB)
    return mt.peak_bytes, model


@pytest.mark.parametrize("param_dtype,autocast,optimizer,checkpointing", [
    ("float32", None, "adamw_foreach", False),
    ("float32", "bfloat16", "adamw_foreach", False),
    ("bfloat16", None, "none", False),
    ("float32", None, "none", True),
])
def test_lora_peak_equals_a_real_step(param_dtype, autocast, optimizer, checkpointing):
    k = lora_key(param_dtype=param_dtype, autocast_dtype=autocast, optimizer=optimizer,
                 gradient_checkpointing=checkpointing)
    traced = tr.trace_step(k)
    measured, model = real_lora_step(k)
    estimate = int(traced.live_curve().max())
    assert abs(estimate - measured) / measured <= 0.01, (estimate, measured)
    # the trace holds the real peft model's parameters: names, sizes, which ones train
    real = list(model.named_parameters(remove_duplicate=False))
    assert traced.params.names == tuple(n for n, _ in real)
    assert traced.params.trainable.tolist() == [p.requires_grad for _, p in real]
    assert traced.params.numel.tolist() == [p.numel() for _, p in real]


@pytest.mark.parametrize("fields", [{"lora_dora": True},
                                    {"lora_modules_to_save": ("embed_tokens", "lm_head")}],
                         ids=["dora", "modules_to_save"])
def test_dora_and_modules_to_save_equal_a_real_step(fields):
    """DoRA's magnitude vectors and peft's trainable copies of saved modules are traced as peft builds
    them: the peak equals the real step's, and the saved modules' copies train."""
    k = lora_key(**fields)
    traced = tr.trace_step(k)
    measured, model = real_lora_step(k)
    assert abs(int(traced.live_curve().max()) - measured) / measured <= 0.01
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert traced.params.trainable.sum() == len(names)
    if "lora_dora" in fields:
        assert any("lora_magnitude_vector" in n for n in names)
    else:
        assert any("embed_tokens.modules_to_save" in n for n in names)
        assert any("lm_head.modules_to_save" in n for n in names)


def test_frozen_base_has_no_gradients_or_optimizer_state():
    t = tr.trace_step(lora_key())
    grads = t.param[(t.kind == Kind.GRAD)]
    states = t.param[(t.kind == Kind.OPTIM)]
    trainable = set(np.nonzero(t.params.trainable)[0].tolist())
    assert set(grads.tolist()) == trainable
    assert set(states.tolist()) == trainable
    assert all(".lora_" in t.params.names[i] for i in trainable)


def test_default_targets_are_peft_s_own():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping

    t = tr.trace_step(lora_key(optimizer="none"))
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in t.params.names if ".lora_" in n}
    assert adapted == set(mapping["llama"])
    # rank r adapters: A is r x in, B is out x r (q_proj 64 -> 64, v_proj 64 -> 32 with 2 kv heads)
    sizes = {n.rsplit(".layers.", 1)[1].split(".", 1)[1]: int(v)
             for n, v in zip(t.params.names, t.params.numel) if ".layers.0." in n and ".lora_" in n}
    assert sizes == {"self_attn.q_proj.lora_A.default.weight": 8 * 64,
                     "self_attn.q_proj.lora_B.default.weight": 64 * 8,
                     "self_attn.v_proj.lora_A.default.weight": 8 * 64,
                     "self_attn.v_proj.lora_B.default.weight": 32 * 8}


@pytest.mark.parametrize("quant_type,double_quant", [("nf4", True), ("nf4", False), ("fp4", True)])
def test_qlora_base_weights_are_stored_four_bit(quant_type, double_quant):
    """Every Linear transformers' bitsandbytes integration converts (all but lm_head) holds the
    bytes bitsandbytes' own quantize_4bit produces for a tensor of its shape; the rest of the trace
    is the 16-bit LoRA trace plus the dequantization temporaries."""
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    k16 = lora_key(param_dtype="bfloat16", optimizer="none")
    k4 = dataclasses.replace(k16, quant_type=quant_type, double_quant=double_quant)
    t16, t4 = tr.trace_step(k16), tr.trace_step(k4)
    p = t4.params
    rows = {int(i): r for r, i in enumerate(t4.param) if t4.kind[r] == Kind.PARAM}
    checked = 0
    for i, name in enumerate(p.names):
        base_linear = name.endswith("proj.weight") or name.endswith("proj.base_layer.weight")
        if not base_linear or p.trainable[i]:
            continue
        w = torch.randn(int(p.numel[i]), dtype=torch.bfloat16)
        packed, state = bnb_functional.quantize_4bit(w, blocksize=64, compress_statistics=double_quant,
                                                     quant_type=quant_type)
        tensors = [packed, state.absmax, state.code]
        if double_quant:
            tensors += [state.state2.absmax, state.state2.code, state.offset]
        expected = sum(t.untyped_storage().nbytes() for t in tensors)
        assert t4.nbytes[rows[i]] == expected, name
        checked += 1
    assert checked == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    head = p.names.index("base_model.model.lm_head.weight")
    assert t4.nbytes[rows[head]] == 2 * p.numel[head]  # lm_head stays 16-bit
    # the adapters, their gradients and the loss path are the same as in the 16-bit LoRA trace
    g4, g16 = t4.nbytes[t4.kind == Kind.GRAD], t16.nbytes[t16.kind == Kind.GRAD]
    assert sorted(g4.tolist()) == sorted(g16.tolist())
    assert t4.live_curve().max() < t16.live_curve().max()


def test_qlora_upcast_is_peft_prepare_model_for_kbit_training():
    """With `kbit_upcast` every parameter that is not 4-bit has the dtype peft's own
    prepare_model_for_kbit_training gives it on a real model (fp32); without, the compute dtype."""
    from peft import prepare_model_for_kbit_training

    k = lora_key(param_dtype="bfloat16", optimizer="none", quant_type="nf4", kbit_upcast=True)
    t_up, t_plain = tr.trace_step(k), tr.trace_step(dataclasses.replace(k, kbit_upcast=False))
    real = transformers.AutoModelForCausalLM.from_config(llama(), dtype=torch.bfloat16)
    real = prepare_model_for_kbit_training(real, use_gradient_checkpointing=False)
    real_dtypes = {n: p.element_size() for n, p in real.named_parameters()}
    checked = 0
    for t, plain in ((t_up, False), (t_plain, True)):
        p = t.params
        for i, name in enumerate(p.names):
            base = name.removeprefix("base_model.model.").replace(".base_layer", "")
            if p.trainable[i] or base.endswith("proj.weight"):  # adapters; 4-bit base Linears
                continue
            assert p.element_size[i] == (2 if plain else real_dtypes[base]), name
            checked += 1
    assert checked >= 2 * (2 + 2 * 2 + 1)  # embed, lm_head, 2 norms per layer, final norm


def test_moe_experts_are_four_bit_per_expert():
    """QLoRA of a transformers-5 MoE (experts as 3D parameters): each expert's matrix holds the bytes
    bitsandbytes' quantize_4bit produces for one matrix of that shape."""
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=VOCAB, num_hidden_layers=2,
                                     num_local_experts=4, num_experts_per_tok=2)
    k = lora_key(cfg, param_dtype="bfloat16", optimizer="none", quant_type="nf4", double_quant=True,
                 lora_target_modules=("q_proj", "v_proj"))
    t = tr.trace_step(k)
    p = t.params
    rows = {int(i): r for r, i in enumerate(t.param) if t.kind[r] == Kind.PARAM}
    experts = [i for i, n in enumerate(p.names) if ".experts." in n]
    assert len(experts) == 2 * 2  # gate_up_proj and down_proj in each layer
    for i in experts:
        one = int(p.numel[i]) // 4
        packed, state = bnb_functional.quantize_4bit(torch.randn(one, dtype=torch.bfloat16), blocksize=64,
                                                     compress_statistics=True, quant_type="nf4")
        per_matrix = sum(x.untyped_storage().nbytes() for x in
                         (packed, state.absmax, state.code, state.state2.absmax, state.state2.code, state.offset))
        assert t.nbytes[rows[i]] == 4 * per_matrix, p.names[i]


def _real_qlora_step(k: tr.TraceKey) -> int:
    """The QLoRA step on real tensors with bitsandbytes' own 4-bit Linear on CPU (launcher/peft.py
    `quantize_base_4bit`, as the worker builds it), under the live storage tracker."""
    from launcher.worker.storage_tracker import StorageTracker

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(**json.loads(k.hf_config_json))
    cfg.num_hidden_layers, cfg.use_cache = k.num_layers, False
    settings = k.lora_settings()
    mt = StorageTracker()
    with mt:
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, k.param_dtype),
                                                              attn_implementation=k.attn_implementation)
        model.train()
        model = lp.apply_lora(lp.quantize_base_4bit(model, settings, "cpu"), settings,
                              autocast_adapter_dtype=k.adapter_autocast)
        train_one_step(model, k, None, VOCAB)
    return mt.peak_bytes


def test_bitsandbytes_before_0_43_2_keeps_each_4bit_matmul_input():
    """peft.bnb_keeps_input: bitsandbytes until 0.43.1 kept the input of every 4-bit matmul on its
    context (MatMul4Bit.forward `ctx.tensors = (A, B)`, 0.43.0 autograd/_functions.py), where 0.43.2
    on keeps `(None, B)`. The real step with the installed bitsandbytes, and again with that one
    line as 0.43.0 had it, grows by what the traced step grows by."""
    pytest.importorskip("bitsandbytes.functional")
    from bitsandbytes.autograd._functions import MatMul4Bit
    base = lora_key(param_dtype="bfloat16", optimizer="none", quant_type="nf4", double_quant=True,
                    adapter_autocast=False, seq_len=64)
    keeps = dataclasses.replace(base, bnb_keeps_input=True)
    traced = {k: int(tr.trace_step(key).live_curve().max()) for k, key in (("now", base), ("0.43.0", keeps))}
    real = {"now": _real_qlora_step(base)}
    forward = MatMul4Bit.forward

    def forward_0_43_0(ctx, A, B, out=None, bias=None, quant_state=None):
        output = forward(ctx, A, B, out, bias, quant_state)
        if ctx.tensors[1] is not None:  # any(ctx.needs_input_grad[:2])
            ctx.tensors = (A, ctx.tensors[1])
        return output

    MatMul4Bit.forward = staticmethod(forward_0_43_0)
    try:
        real["0.43.0"] = _real_qlora_step(base)
    finally:
        MatMul4Bit.forward = staticmethod(forward)
    grown_real, grown_traced = real["0.43.0"] - real["now"], traced["0.43.0"] - traced["now"]
    assert grown_real > 0 and abs(grown_traced - grown_real) <= 0.01 * real["0.43.0"], (real, traced)

"""launcher/trace.py against independent references: torch's MemTracker on a real CPU step,
byte counts from the real model's parameters, FLOPs from the matmul shapes."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from launcher import checkpointing  # noqa: E402
from launcher import trace as tr  # noqa: E402
from launcher.steptrace import Kind, Role, extrapolate  # noqa: E402
from reference_step import train_one_step  # noqa: E402

VOCAB = 320


def llama(num_layers=2, **kw):
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB,
                                    num_hidden_layers=num_layers, **kw)


def bloom(num_layers=2):
    return transformers.BloomConfig(hidden_size=64, n_head=4, vocab_size=VOCAB, n_layer=num_layers)


def key(cfg, num_layers=2, micro_batch_size=2, seq_len=128, **kw):
    return tr.TraceKey(tr.canonical_config_json(cfg), num_layers, micro_batch_size, seq_len, **kw)


def real_step(k: tr.TraceKey):
    """The same step on real tensors under torch's MemTracker (entered before the model is built).
    Returns (peak bytes, the real model)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(**__import__("json").loads(k.hf_config_json))
    cfg.num_hidden_layers, cfg.use_cache = k.num_layers, False
    mt = MemTracker()
    with mt:
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=getattr(torch, k.param_dtype), attn_implementation=k.attn_implementation)
        model.train()
        if k.gradient_checkpointing:
            checkpointing.enable(model, k.checkpoint_policy)
        params = list(model.parameters())
        opt = {"adamw_foreach": lambda: torch.optim.AdamW(params, foreach=True),
               "adamw_single": lambda: torch.optim.AdamW(params, foreach=False),
               "adamw_fused": lambda: torch.optim.AdamW(params, fused=True),
               "sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True),
               "sgd_plain": lambda: torch.optim.SGD(params, lr=0.1, foreach=True),
               "none": lambda: None}[k.optimizer]()
        train_one_step(model, k, opt, VOCAB)
    return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"], model


PRECISIONS = {  # (param_dtype, autocast_dtype)
    "fp32": ("float32", None), "bf16-mixed": ("float32", "bfloat16"), "bf16-true": ("bfloat16", None)}
CASES = [("llama", "eager", p) for p in PRECISIONS] + [("llama", "sdpa", p) for p in PRECISIONS] \
    + [("bloom", "eager", "fp32"), ("bloom", "eager", "bf16-mixed")]


@pytest.mark.parametrize("checkpointing,optimizer",
                         [(False, "none"), (True, "none"), (False, "adamw_foreach")])
@pytest.mark.parametrize("model,attn,precision", CASES)
def test_peak_equals_memtracker_on_a_real_step(model, attn, precision, checkpointing, optimizer):
    """optimizer='none' puts the peak in forward/backward (activations), AdamW foreach in the step."""
    cfg = {"llama": llama, "bloom": bloom}[model]()
    pd, ad = PRECISIONS[precision]
    k = key(cfg, param_dtype=pd, autocast_dtype=ad, attn_implementation=attn,
            gradient_checkpointing=checkpointing, optimizer=optimizer)
    t = tr.trace_step(k)
    curve = t.live_curve()
    traced = max(t.phase_max(curve, ph) for ph in ("forward", "backward", "optimizer"))
    real, _ = real_step(k)
    # measured: equal to the byte on every case (transformers' packed-sequence check answered)
    assert abs(traced - real) <= 0.01 * real, (traced, real)
    assert traced == curve.max()  # the build phase is never the peak here


@pytest.mark.parametrize("attn,precision", [("sdpa", "fp32"), ("sdpa", "bf16-mixed"), ("eager", "bf16-true")])
def test_selective_op_checkpointing_peak_equals_memtracker(attn, precision):
    """torchtitan's per-op selective checkpointing (launcher/checkpointing.py): the traced step
    keeps what the real step keeps, and that lies between full checkpointing and none."""
    pd, ad = PRECISIONS[precision]
    peaks = {}
    for ckpt, policy in ((False, "full"), (True, "full"), (True, "selective_op")):
        k = key(llama(), param_dtype=pd, autocast_dtype=ad, attn_implementation=attn,
                gradient_checkpointing=ckpt, checkpoint_policy=policy, optimizer="none")
        peaks[ckpt, policy] = tr.trace_step(k).live_curve().max()
    real, _ = real_step(k)
    assert abs(peaks[True, "selective_op"] - real) <= 0.01 * real, (peaks, real)
    assert peaks[True, "full"] < peaks[True, "selective_op"] < peaks[False, "full"], peaks


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_reentrant_checkpointing_peak_equals_memtracker(precision):
    """training.checkpoint_policy=reentrant (transformers 4's default): the traced step keeps what
    the real step keeps. Its backward holds more than the non-reentrant checkpoint's: the nested
    backward of a recomputed layer runs while the gradient of that layer's output is alive."""
    pd, ad = PRECISIONS[precision]
    peaks = {}
    for policy in ("full", "reentrant"):
        k = key(llama(), param_dtype=pd, autocast_dtype=ad, attn_implementation="sdpa",
                gradient_checkpointing=True, checkpoint_policy=policy, optimizer="none")
        peaks[policy] = tr.trace_step(k).live_curve().max()
    real, _ = real_step(k)
    assert abs(peaks["reentrant"] - real) <= 0.01 * real, (peaks, real)
    assert peaks["reentrant"] > peaks["full"], peaks


@pytest.mark.parametrize("dtype,itemsize", [("float32", 4), ("bfloat16", 2)])
def test_fused_dropout_keeps_one_byte_per_element(dtype, itemsize):
    """A GPU plan traces dropout as CUDA runs it (TraceKey.fused_dropout, aten Dropout.cpp: the
    fused kernel's bool mask), a CPU plan as the CPU runs it (a noise tensor of the input's dtype).
    GPT-2 drops out its embeddings, and in each layer the attention probabilities and both
    residual branches: the forward keeps (itemsize - 1) bytes less per element of each."""
    b, s, h, heads, layers = 3, 48, 64, 4, 2
    cfg = transformers.GPT2Config(n_embd=h, n_head=heads, n_layer=layers, n_positions=64, vocab_size=512)
    assert cfg.resid_pdrop == cfg.embd_pdrop == cfg.attn_pdrop == 0.1
    k = key(cfg, micro_batch_size=b, seq_len=s, param_dtype=dtype, attn_implementation="eager", optimizer="none")
    cpu, gpu = tr.trace_step(k), tr.trace_step(dataclasses.replace(k, fused_dropout=True))
    elements = b * s * h + layers * (2 * b * s * h + b * heads * s * s)
    assert (k.micro_batch_size, k.seq_len) == (b, s)
    assert cpu.live_curve().max() - gpu.live_curve().max() == elements * (itemsize - 1)
    with tr._fused_dropout():  # the same step on real tensors, native_dropout run by the CPU kernel
        real, _ = real_step(k)
    assert abs(gpu.live_curve().max() - real) <= 0.01 * real, (gpu.live_curve().max(), real)


def test_fused_attention_dropout_keeps_nothing():
    """SDPA with dropout_p > 0: CUDA's fused attention kernels redraw the mask from their Philox
    state in backward and keep no probabilities, so a GPU plan's step holds what it holds without
    attention dropout; on the CPU, SDPA falls back to the math path and keeps the seq x seq
    probabilities (at least one such tensor per layer more)."""
    b, s, h, heads, layers = 2, 64, 64, 4, 2
    cfgs = {p: transformers.GPT2Config(n_embd=h, n_head=heads, n_layer=layers, n_positions=64, vocab_size=512,
                                       attn_pdrop=p) for p in (0.1, 0.0)}
    peaks = {(p, fused): tr.trace_step(key(cfg, micro_batch_size=b, seq_len=s, attn_implementation="sdpa",
                                           optimizer="none", fused_dropout=fused)).live_curve().max()
             for p, cfg in cfgs.items() for fused in (False, True)}
    assert peaks[0.1, True] == peaks[0.0, True]
    assert peaks[0.1, False] - peaks[0.1, True] >= layers * b * heads * s * s * 4


def test_cuda_autocast_policy_in_a_cpu_autocast_region():
    """Under `_cuda_autocast` a CPU autocast region follows CUDA's op reference (torch.amp docs,
    "CUDA Ops that can autocast to float32"; autocast_mode.h): pow, exp, rsqrt and layer_norm run
    in fp32, softmax and sum give fp32, cross_entropy's log_softmax gives fp32; linear stays in the
    autocast dtype. Outside the context the CPU's policy is back (pow and softmax stay bf16)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def dtypes():
        with FakeTensorMode():
            x = torch.empty(4, 8, requires_grad=True)
            w = torch.empty(8, 8, requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = torch.nn.functional.linear(x, w)
                return {"linear": y.dtype, "pow": torch.pow(y, 3.0).dtype, "exp": y.exp().dtype,
                        "rsqrt": y.rsqrt().dtype, "layer_norm": torch.nn.functional.layer_norm(y, (8,)).dtype,
                        "softmax": y.softmax(-1).dtype, "sum": y.sum().dtype,
                        "cross_entropy": torch.nn.functional.cross_entropy(y, torch.zeros(4, dtype=torch.long)).dtype}

    cpu = dtypes()
    with tr._cuda_autocast():
        cuda = dtypes()
    assert cuda == {"linear": torch.bfloat16, **{k: torch.float32 for k in cuda if k != "linear"}}
    assert cpu["pow"] == cpu["softmax"] == cpu["layer_norm"] == torch.bfloat16
    assert dtypes() == cpu


def test_cuda_autocast_changes_gpt2_not_llama():
    """GPT-2's tanh GELU cubes its input (NewGELUActivation: torch.pow), which CUDA's autocast runs
    in fp32, so its bf16-mixed step holds more on a GPU; a Llama step has no op whose dtype the two
    policies set differently (its RMSNorm upcasts by hand, its attention is SDPA), so it traces the
    same."""
    gpt2 = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2, n_positions=64, vocab_size=512)
    peaks = {}
    for name, cfg in (("gpt2", gpt2), ("llama", llama())):
        k = key(cfg, seq_len=64, param_dtype="float32", autocast_dtype="bfloat16", attn_implementation="sdpa",
                optimizer="none", fused_dropout=True)
        peaks[name] = [tr.trace_step(dataclasses.replace(k, cuda_autocast=c)).live_curve().max() for c in (False, True)]
    assert peaks["gpt2"][1] > peaks["gpt2"][0], peaks
    assert peaks["llama"][1] == peaks["llama"][0], peaks


def test_cuda_grouped_query_sdpa_in_fp32_runs_the_math_kernel():
    """A grouped-query model in fp32 under SDPA: transformers passes enable_gqa=True, which on CUDA
    only FlashAttention (fp16/bf16 only) and the math kernel take, so the GPU keeps each layer's
    seq x seq probabilities (at least one fp32 tensor of batch x heads x seq^2 per layer) where the
    CPU's flash kernel keeps none; the traced step matches the same step run on real tensors. In
    bf16 the context changes nothing (FlashAttention runs)."""
    b, s = 2, 128
    cfg = llama()
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    base = key(cfg, micro_batch_size=b, seq_len=s, attn_implementation="sdpa", optimizer="none")
    cpu, gpu = (tr.trace_step(dataclasses.replace(base, cuda_sdpa_math=m)).live_curve().max() for m in (False, True))
    assert gpu - cpu >= base.num_layers * b * cfg.num_attention_heads * s * s * 4, (cpu, gpu)
    with tr._cuda_sdpa(fused_dropout=False, gqa_math=True):
        real, _ = real_step(dataclasses.replace(base, cuda_sdpa_math=True))
    assert abs(gpu - real) <= 0.01 * real, (gpu, real)
    bf16 = dataclasses.replace(base, param_dtype="bfloat16")
    assert len({tr.trace_step(dataclasses.replace(bf16, cuda_sdpa_math=m)).live_curve().max() for m in (False, True)}) == 1


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_transformers_4_44_loss_peak_equals_memtracker(precision):
    """training.causal_lm_loss=fp32_shift_copy: the fp32 logits the model returns and their shifted
    copy, traced as transformers 4.44's forward computes them, against the real step; at this
    vocabulary the forward peak exceeds the installed transformers' loss path."""
    pd, ad = PRECISIONS[precision]
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=4096, num_hidden_layers=2)
    k = key(cfg, param_dtype=pd, autocast_dtype=ad, attn_implementation="sdpa",
            optimizer="none", loss="fp32_shift_copy")
    t = tr.trace_step(k)
    real, _ = real_step(k)
    assert abs(t.live_curve().max() - real) <= 0.01 * real, (t.live_curve().max(), real)
    installed = tr.trace_step(dataclasses.replace(k, loss="model"))
    assert t.phase_max(t.live_curve(), "forward") > installed.phase_max(installed.live_curve(), "forward")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_shift_copy_loss_peak_equals_memtracker(dtype):
    """training.causal_lm_loss=shift_copy: the cross-entropy on the lm_head's 16-bit logits and
    their shifted copy (Qwen (v1)'s remote code; transformers 4.2x's BLOOM and OPT), as a run
    without autocast computes it, against the real step. It holds less at the loss than the
    fp32_shift_copy path (no fp32 copy of the logits) and more than the installed path's
    16-bit logits alone (the shifted copy)."""
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=4096, num_hidden_layers=2)
    k = key(cfg, param_dtype=dtype, attn_implementation="sdpa", optimizer="none", loss="shift_copy")
    t = tr.trace_step(k)
    real, _ = real_step(k)
    assert abs(t.live_curve().max() - real) <= 0.01 * real, (t.live_curve().max(), real)
    fp32 = tr.trace_step(dataclasses.replace(k, loss="fp32_shift_copy"))
    forward = lambda x: x.phase_max(x.live_curve(), "forward")  # noqa: E731
    assert forward(t) < forward(fp32), (forward(t), forward(fp32))


@pytest.mark.parametrize("optimizer", ["adamw_single", "adamw_fused", "sgd", "sgd_plain"])
def test_peak_per_optimizer_equals_memtracker(optimizer):
    k = key(llama(), seq_len=32, optimizer=optimizer)
    traced, (real, _) = tr.trace_step(k).live_curve().max(), real_step(k)
    assert abs(traced - real) <= 0.01 * real, (traced, real)


@pytest.mark.parametrize("cfg,optimizer", [(llama(), "adamw_foreach"), (bloom(), "adamw_single"),
                                           (llama(), "sgd"), (llama(), "sgd_plain"),
                                           (llama(tie_word_embeddings=True), "adamw_fused")])
def test_category_bytes_after_the_optimizer_step(cfg, optimizer):
    """Live PARAM/GRAD/OPTIM bytes just before zero_grad, from the real model's parameters:
    grads = params; AdamW: exp_avg + exp_avg_sq of param size + a 4-byte fp32 `step` per parameter
    (torch/optim/adamw.py _init_group); SGD: one momentum buffer of param size; SGD without
    momentum: nothing (torch/optim/sgd.py)."""
    k = key(cfg, seq_len=16, optimizer=optimizer, attn_implementation="eager")
    t = tr.trace_step(k)
    _, model = real_step(k)
    params = list(model.parameters())  # tied weights appear once
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    optim_bytes = {"sgd": param_bytes, "sgd_plain": 0}.get(optimizer, 2 * param_bytes + 4 * len(params))
    at = t.phases["zero_grad"][0] - 1
    live = (t.alloc <= at) & (t.free > at)
    got = {kd: int(t.nbytes[live & (t.kind == kd)].sum()) for kd in (Kind.PARAM, Kind.GRAD, Kind.OPTIM)}
    assert got == {Kind.PARAM: param_bytes, Kind.GRAD: param_bytes, Kind.OPTIM: optim_bytes}
    assert not (t.kind == Kind.GRAD).any() or t.free[t.kind == Kind.GRAD].max() < t.num_events


def test_param_table_roles_layers_and_ties():
    t = tr.trace_step(key(bloom(3), num_layers=3, seq_len=16, attn_implementation="eager"))
    p = t.params
    role = dict(zip(p.names, p.role))
    assert role["transformer.word_embeddings.weight"] == Role.EMBEDDING
    assert role["transformer.word_embeddings_layernorm.bias"] == Role.EMBEDDING
    assert role["transformer.ln_f.weight"] == Role.HEAD and role["lm_head.weight"] == Role.HEAD
    assert p.tied_to[p.names.index("lm_head.weight")] == p.names.index("transformer.word_embeddings.weight")
    layer = dict(zip(p.names, p.layer))
    assert layer["transformer.h.2.mlp.dense_4h_to_h.bias"] == 2 and layer["transformer.ln_f.weight"] == -1
    assert set(p.role[p.layer >= 0]) == {Role.LAYER}
    # every trainable untied parameter has one GRAD row, ready during backward
    grads = t.kind == Kind.GRAD
    assert sorted(t.param[grads]) == [i for i in range(len(p.names)) if p.tied_to[i] < 0]
    a, b = t.phases["backward"]
    assert ((t.ready[grads] >= a) & (t.ready[grads] <= b)).all()
    assert (np.bincount(t.param[t.kind == Kind.OPTIM]) == 3).all()  # exp_avg, exp_avg_sq, step


def test_llama_roles():
    p = tr.trace_step(key(llama(), seq_len=16)).params
    role = dict(zip(p.names, p.role))
    assert role["model.embed_tokens.weight"] == Role.EMBEDDING and role["model.norm.weight"] == Role.HEAD
    assert role["lm_head.weight"] == Role.HEAD and (p.tied_to == -1).all()
    assert p.layer[p.names.index("model.layers.1.mlp.up_proj.weight")] == 1


EXTRAPOLATION_CASES = [(llama, "sdpa", False, None), (llama, "eager", True, None),
                       (llama, "sdpa", True, "bfloat16"),
                       (llama, "sdpa", False, "bfloat16"), (bloom, "eager", False, None),
                       (bloom, "eager", True, None), (bloom, "eager", True, "bfloat16")]


@pytest.mark.parametrize("make,attn,checkpointing,autocast", EXTRAPOLATION_CASES)
def test_phase_maxima_extrapolate_to_a_direct_deep_trace(make, attn, checkpointing, autocast,
                                                        tmp_path):
    k = key(make(), seq_len=64, attn_implementation=attn, gradient_checkpointing=checkpointing,
            autocast_dtype=autocast, optimizer="adamw_single")
    ts = tr.trace_set(k, num_layers=6, cache_dir=tmp_path)
    deep = tr.trace_step(dataclasses.replace(k, num_layers=6))
    for ph in ("forward", "backward", "optimizer", "zero_grad"):
        assert ts.phase_max(ph) == deep.phase_max(deep.live_curve(), ph), ph
    for f in ("forward", "backward"):
        assert ts.at_depth(lambda t: t.flops[f]) == deep.flops[f]


def test_backward_maximum_moves_from_the_head_to_the_layers_with_depth():
    """Why TraceSet.phase_max extrapolates per segment: with checkpointing and autocast the
    backward maximum sits in the LM-head backward at depth 2 and in the layers from depth 3 on,
    so the whole-phase maximum is not linear in depth; each segment's maximum is."""
    k = key(llama(), seq_len=128, attn_implementation="sdpa", gradient_checkpointing=True,
            autocast_dtype="bfloat16", optimizer="none")
    traces = {d: tr.trace_step(dataclasses.replace(k, num_layers=d)) for d in (2, 3, 6)}
    whole = {d: t.phase_max(t.live_curve(), "backward") for d, t in traces.items()}
    assert extrapolate(whole[2], whole[3], 6, 2, 3) < whole[6]
    ts = tr.TraceSet(traces[2], traces[3], 6)
    assert ts.phase_max("backward") == whole[6]


def test_depth_one_is_not_one_layer_short_of_depth_two():
    """Why trace_set uses depths 2 and 3: bloom under gradient checkpointing keeps the previous
    layer's attention probabilities alive until the next layer returns, which depth 1 lacks."""
    k = key(bloom(), seq_len=64, attn_implementation="eager", gradient_checkpointing=True)
    fwd = {d: (lambda t: t.phase_max(t.live_curve(), "forward"))(
        tr.trace_step(dataclasses.replace(k, num_layers=d))) for d in (1, 2, 3, 4)}
    assert fwd[4] - fwd[3] == fwd[3] - fwd[2] != fwd[2] - fwd[1]


def linear_weights(cfg, num_layers):
    """(weights of every nn.Linear, weights of the last nn.Linear of decoder layer 0), from a
    meta-device build (shapes only)."""
    cfg.num_hidden_layers = num_layers
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    last_in_layer = [m for n, m in linears if ".0." in n][-1]
    return sum(m.weight.numel() for _, m in linears), last_in_layer.weight.numel()


@pytest.mark.parametrize("make,attn", [(llama, "sdpa"), (llama, "eager"), (bloom, "eager")])
def test_flops_from_matmul_shapes(make, attn):
    """Forward: 2 FLOPs per multiply-add of every Linear (2*T*N_linear) plus QK^T and AV
    (2 * 2*b*s^2*hidden per layer); backward: twice the forward (grad of input and of weight)
    (PaLM, arXiv:2204.02311, app. B). Checkpointing recomputes each decoder layer's forward up to
    the last tensor backward needs (torch/utils/checkpoint.py non-reentrant early stop), i.e.
    without the layer's last Linear, whose output nothing saves. SDPA's backward (flash) also
    recomputes QK^T: 5 attention matmuls instead of eager's 4 (torch/utils/flop_counter.py
    sdpa_backward_flop_count)."""
    b, s, layers, hidden = 2, 64, 2, 64
    n_linear, n_last = linear_weights(make(), layers)
    attention = layers * 4 * b * s * s * hidden
    t = tr.trace_step(key(make(), layers, b, s, attn_implementation=attn))
    assert t.flops["forward"] == 2 * b * s * n_linear + attention
    attention_backward = attention * (2.5 if attn == "sdpa" else 2)
    assert t.flops["backward"] == 2 * (t.flops["forward"] - attention) + attention_backward
    assert 1.0 < sum(t.flops.values()) / (6 * n_linear * b * s) < 1.5
    gc = tr.trace_step(key(make(), layers, b, s, attn_implementation=attn, gradient_checkpointing=True))
    head = 2 * b * s * VOCAB * hidden
    recompute = t.flops["forward"] - head - layers * 2 * b * s * n_last
    assert gc.flops["forward"] == t.flops["forward"]
    assert gc.flops["backward"] == t.flops["backward"] + recompute


def test_micro_batch_scaling_equals_a_direct_trace():
    k = key(llama(), seq_len=64, gradient_checkpointing=True, autocast_dtype="bfloat16")
    t2, t3, t5 = (tr.trace_step(dataclasses.replace(k, micro_batch_size=m)) for m in (2, 3, 5))
    s5 = tr.at_micro_batch(t2, t3, 5)
    np.testing.assert_array_equal(s5.live_curve(), t5.live_curve())
    assert s5.flops == t5.flops
    t1 = tr.trace_step(dataclasses.replace(k, micro_batch_size=1))
    with pytest.raises(ValueError):  # micro-batch 1 takes other paths: not a basis
        tr.at_micro_batch(t1, t2, 5)


def test_trace_set_uses_the_batch_basis_and_caches(tmp_path, monkeypatch):
    k = key(llama(4), micro_batch_size=6, seq_len=32, optimizer="sgd")
    calls = []
    real_trace_step = tr.trace_step
    monkeypatch.setattr(tr, "trace_step", lambda key: calls.append(key) or real_trace_step(key))
    tr._MEMO.clear()
    ts = tr.trace_set(k, cache_dir=tmp_path)
    assert sorted((c.num_layers, c.micro_batch_size) for c in calls) == [(2, 2), (2, 3), (3, 2), (3, 3)]
    direct = real_trace_step(dataclasses.replace(k, num_layers=3))
    np.testing.assert_array_equal(ts.depth2.live_curve(), direct.live_curve())
    assert ts.num_layers == 4 and len(list(tmp_path.glob("*.npz"))) == 4
    tr._MEMO.clear()
    again = tr.trace_set(k, cache_dir=tmp_path)  # from disk: no new traces
    assert len(calls) == 4
    np.testing.assert_array_equal(again.depth1.live_curve(), ts.depth1.live_curve())
    assert again.depth1.phases == ts.depth1.phases and again.depth1.params.names == ts.depth1.params.names


def test_corrupt_cache_entry_is_traced_again(tmp_path):
    k = key(llama(), seq_len=16)
    tr._MEMO.clear()
    first = tr.cached_trace(k, tmp_path)
    (path,) = tmp_path.glob("*.npz")
    path.write_bytes(path.read_bytes()[:100])
    tr._MEMO.clear()
    again = tr.cached_trace(k, tmp_path)
    np.testing.assert_array_equal(again.nbytes, first.nbytes)
    assert tr.cached_trace(k, tmp_path) is again  # in-process memo
    assert tr._load(path).num_events == first.num_events  # rewritten whole


def test_foreach_adamw_temporaries_name_their_parameter():
    """torch/optim/adamw.py `_multi_tensor_adamw`: `torch._foreach_sqrt(exp_avg_sqs)` makes one
    tensor per parameter, of its size; the trace names the parameter each was computed for."""
    step = tr.trace_step(key(llama(3), num_layers=3, seq_len=64, autocast_dtype="bfloat16"))
    a, b = step.phases["optimizer"]
    temps = (step.alloc >= a) & (step.alloc < b) & (step.kind == Kind.ACT) & (step.owner >= 0)
    owners = step.owner[temps]
    trainable = np.nonzero(step.params.trainable)[0]
    assert set(owners.tolist()) == set(trainable.tolist())
    # each parameter has a temporary of its own size (fp32 parameters under bf16 autocast)
    same = {int(p) for p, nb in zip(owners, step.nbytes[temps]) if nb == step.params.numel[p] * 4}
    assert same == set(trainable.tolist())
    assert (step.owner[step.param >= 0] == -1).all()  # parameters, gradients, states keep `param`


def test_mixture_of_experts_flops_count_each_token_through_its_experts():
    """transformers' grouped-GEMM experts (aten._grouped_mm, absent from torch's FLOP registry)
    send every token through its top-k experts' three projections: forward 2 x tokens x top_k x 3
    x hidden x intermediate per layer beside the Linears and attention, backward twice that (the
    input gradient and the weight gradient, whose contraction the per-expert offsets split). They
    were counted as 0, so Mixtral's step was planned at a seventh of its FLOPs."""
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                     num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256)
    b, s, layers = 2, 64, 2
    n_linear, _ = linear_weights(transformers.MixtralConfig(**cfg.to_dict()), layers)  # attention, head
    n_linear += layers * cfg.num_local_experts * cfg.hidden_size  # the router's weight (not an nn.Linear)
    attention = layers * 4 * b * s * s * cfg.hidden_size
    experts = layers * 2 * b * s * 2 * 3 * cfg.hidden_size * cfg.intermediate_size
    t = tr.trace_step(key(cfg, layers, b, s, param_dtype="bfloat16"))
    assert t.flops["forward"] == 2 * b * s * n_linear + attention + experts
    assert t.flops["backward"] == pytest.approx(2 * (t.flops["forward"] - attention) + 2.5 * attention)


def test_plan_notes_name_the_checkpoint_policy():
    """A checkpointed plan says which checkpoint it assumes, since the reentrant one holds one
    hidden state more in backward than the non-reentrant one; a plan without checkpointing says
    nothing of it."""
    k = key(llama(), gradient_checkpointing=True)
    notes = {p: " ".join(tr.trace_notes(dataclasses.replace(k, checkpoint_policy=p)))
             for p in ("full", "reentrant", "selective_op")}
    assert "use_reentrant=True" in notes["reentrant"] and "use_reentrant" not in notes["full"]
    assert "selective" in notes["selective_op"] and "selective" not in notes["full"]
    assert "checkpoint" not in " ".join(tr.trace_notes(dataclasses.replace(k, gradient_checkpointing=False)))

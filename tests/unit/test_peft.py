"""launcher/peft.py: the LoraConfig both sides apply, the planner's training variants, and the
optimizer states the memory models use for 8-bit AdamW (bitsandbytes' own tensors) and Adafactor
(traced for real: a traced step against a real one)."""
from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from launcher import peft as lp  # noqa: E402
from launcher import trace as tr  # noqa: E402
from launcher.config import LauncherConfig, PeftMethod, StrategyName  # noqa: E402
from launcher.errors import ConfigError  # noqa: E402
from launcher.memory.common import modelled_state_bytes  # noqa: E402
from launcher.backends.registry import backend_of  # noqa: E402
from launcher.planner import variant_problem  # noqa: E402
from launcher.types import Strategy  # noqa: E402


def test_lora_config_uses_peft_s_defaults_and_explicit_targets():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping

    cfg = lp.lora_config(lp.LoraSettings(r=4, alpha=8, dropout=0.1), "bloom")
    assert set(cfg.target_modules) == set(mapping["bloom"]) and cfg.r == 4 and cfg.lora_alpha == 8
    cfg = lp.lora_config(lp.LoraSettings(target_modules=("gate_proj", "up_proj")), "llama")
    assert set(cfg.target_modules) == {"gate_proj", "up_proj"}
    with pytest.raises(ConfigError, match="peft.target_modules"):
        lp.default_target_modules("no-such-architecture")


def test_biogpt_lora_plans_with_opt_s_default_targets(tmp_path):
    """PEFT has no default LoRA targets for BioGPT (one of LLMem's models), so `peft=lora` was
    refused; it now adapts q_proj and v_proj, as PEFT does for OPT, whose attention BioGPT's is.
    The trainable count is BioGPT-Large's own arithmetic: 48 layers x 2 projections x r x (in + out)
    with in = out = hidden 1600, r = 8."""
    from launcher import planner
    from launcher.app import model_spec
    from launcher.cli import compose
    from launcher.hardware import cluster_from

    config = compose(["model=biogpt-large", "hardware=a100-80g", "gpus=1", "strategy=single", "peft=lora",
                      "training.seq_len=64", "training.micro_batch_size=1", f"cache_dir={tmp_path}"])
    plan = planner.plan(config, model_spec(config), cluster_from(config.hardware, config.gpus, config.nodes))
    chosen = plan.candidates[plan.chosen]
    assert chosen.trains == "adapters" and chosen.num_trainable_params == 48 * 2 * 8 * (1600 + 1600)


def test_settings_round_trip_through_run_json():
    s = lp.LoraSettings(r=16, alpha=32, dropout=0.0, target_modules=("q_proj",), quant_type="nf4")
    assert lp.LoraSettings.from_dict(s.to_dict()) == s and s.method == "qlora"


def _config(**training):
    c = LauncherConfig()
    for k, v in training.items():
        setattr(c.training, k, v)
    return c


def test_variants_only_what_was_asked_without_allow_peft():
    assert [v.label for v in lp.training_variants(_config(), "cuda")] == ["full"]
    c = _config()
    c.peft.method = PeftMethod["lora"]
    c.strategy = StrategyName["ddp"]
    assert [v.label for v in lp.training_variants(c, "cuda")] == ["lora r=8"]


def test_variants_with_allow_peft():
    labels = [v.label for v in lp.training_variants(_config(allow_peft=True), "cpu")]
    assert labels == ["full", "lora r=8", "full +ckpt", "lora r=8 +ckpt"]  # no QLoRA on CPU
    cuda = lp.training_variants(_config(allow_peft=True, gradient_checkpointing=True), "cuda")
    assert [v.label for v in cuda] == ["full +ckpt", "lora r=8 +ckpt", "qlora nf4 r=8 +ckpt"]
    assert [v.trains for v in cuda] == ["full", "adapters", "adapters"]


def test_variant_problems_name_the_reason():
    lora = lp.TrainingVariant("adapters", lp.LoraSettings(), False)
    qlora = lp.TrainingVariant("adapters", lp.LoraSettings(quant_type="nf4"), False)
    ddp, z2, z3 = Strategy("ddp", "ddp"), Strategy("zero2", "deepspeed", 2), Strategy("zero3", "deepspeed", 3)
    assert variant_problem(lora, ddp, "cpu") == variant_problem(lora, z2, "cpu") == ""
    assert variant_problem(lora, z3, "cuda") == ""  # LoRA on ZeRO-3 is modelled (frozen base partitioned)
    # QLoRA under ZeRO 0-3 runs (ZeRO-3: PEFT's bf16-stored 4-bit weights, partitioned), on CPU processes too
    for s in (z2, z3):
        assert variant_problem(qlora, s, "cuda") == variant_problem(qlora, s, "cpu") == ""
        assert "qlora" not in backend_of(s).rules(s).estimate_only
    offload = Strategy("zero2_offload", "deepspeed", 2, offload_optimizer=True)
    assert "without offload" in variant_problem(qlora, offload, "cuda")
    assert variant_problem(qlora, ddp, "cpu") == variant_problem(qlora, ddp, "cuda") == ""


def _lora_model():
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=320, num_hidden_layers=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    return lp.apply_lora(model, lp.LoraSettings(r=16, target_modules=("q_proj", "v_proj", "up_proj")))


@pytest.mark.parametrize("name", ["adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit"])
def test_8bit_state_bytes_of_a_lora_model_match_bitsandbytes(name):
    """The modelled state of the adapters equals the bytes of bitsandbytes' own state tensors after
    a real step (CPU; qmaps are shared by every parameter and counted once)."""
    from launcher.worker.optim import make_optimizer

    model = _lora_model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(name, params, 1e-3, 0.0)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    seen, total = set(), 0
    for state in opt.state.values():
        for t in state.values():
            if torch.is_tensor(t) and id(t.untyped_storage()) not in seen:
                seen.add(id(t.untyped_storage()))
                total += t.untyped_storage().nbytes()
    assert modelled_state_bytes(name, [tuple(p.shape) for p in params]) == total


def test_adafactor_is_traced_like_a_real_step():
    """transformers' Adafactor with the Trainer's settings runs under fake tensors: the traced
    peak equals a real step's (live storage bytes), and its factored states are traced."""
    from launcher.worker.storage_tracker import StorageTracker
    from transformers.optimization import Adafactor

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=320, num_hidden_layers=2)
    key = tr.TraceKey(tr.canonical_config_json(cfg), 2, 2, 64, optimizer="adafactor")
    traced = int(tr.trace_step(key).live_curve().max())
    tracker = StorageTracker()
    with tracker:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        model.train()
        opt = Adafactor(model.parameters(), lr=1e-3, scale_parameter=False, relative_step=False,
                        warmup_init=False)
        ids = torch.randint(0, 320, (2, 64))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert traced == tracker.peak_bytes
    states = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values()
                 if torch.is_tensor(t))
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert modelled_state_bytes("adafactor", shapes) == states


@pytest.mark.parametrize("autocast", [True, False])
def test_adapter_dtype_is_what_the_trace_is_told(autocast):
    """peft.autocast_adapter_dtype: the worker's adapters on a bf16 model are fp32 (peft's default)
    or bf16, and the trace key the planner builds says the same."""
    from types import SimpleNamespace

    from launcher.worker.model import apply_peft

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=320, num_hidden_layers=1)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    lora = lp.LoraSettings(r=4, alpha=8, dropout=0.0, target_modules=("q_proj",), autocast_adapter_dtype=autocast)
    model = apply_peft(model, SimpleNamespace(backend="ddp", device="cpu"), lora)
    dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert dtypes == {torch.float32 if autocast else torch.bfloat16}
    assert lp.trace_fields(lora, True, {})["adapter_autocast"] is autocast


def _qlora_model():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=320, num_hidden_layers=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    lora = lp.LoraSettings(r=4, alpha=8, dropout=0.0, quant_type="nf4", double_quant=True, compute_dtype="bfloat16",
                           upcast_non_quantized=False)
    return lp.apply_lora(lp.quantize_base_4bit(model, lora, "cpu"), lora)


def test_qlora_checkpoint_state_loads_back():
    """bitsandbytes saves a 4-bit weight's QuantState under extra state_dict keys that no strict
    load takes back: a QLoRA model cannot load its own state_dict. The checkpoint state leaves the
    frozen 4-bit weights out (the resumed run rebuilds them identically) and loads every other
    entry strictly."""
    from launcher.worker.layout import four_bit_weights, load_model_state, model_state

    trained = _qlora_model()
    with pytest.raises(RuntimeError, match="Unexpected key"):
        _qlora_model().load_state_dict(trained.state_dict())
    adapters = [n for n, p in trained.named_parameters() if p.requires_grad]
    with torch.no_grad():
        for n, p in trained.named_parameters():
            if p.requires_grad:
                p.add_(1.0)
    state = model_state(trained)
    frozen = four_bit_weights(trained)
    assert frozen and not any(k.startswith(tuple(frozen)) for k in state)
    resumed = _qlora_model()
    load_model_state(resumed, state)
    own = dict(resumed.named_parameters())
    assert all(torch.equal(own[n], dict(trained.named_parameters())[n]) for n in adapters)
    with pytest.raises(RuntimeError, match="missing"):
        load_model_state(_qlora_model(), {k: v for k, v in state.items() if k != adapters[0]})


def test_train_base_trains_every_parameter_in_the_worker_and_the_trace():
    """peft.train_base (DeepSpeed-Chat's LoRA without --only_optimize_lora): the worker's model has
    every base parameter trainable next to the adapters, and the traced step has the same
    trainable set; with QLoRA's 4-bit base it is refused in one line."""
    from launcher import trace as tr_
    from launcher.config import PeftConfig

    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=320, num_hidden_layers=1, max_position_embeddings=256)
    lora = lp.LoraSettings(r=4, alpha=8, dropout=0.0, target_modules=("q_proj", "v_proj"), train_base=True)
    model = lp.apply_lora(transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)), lora)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters()} and any("lora_A" in n for n in trainable)
    key = tr_.TraceKey(hf_config_json=tr_.canonical_config_json(cfg), num_layers=1, micro_batch_size=1, seq_len=8,
                       optimizer="none", **{k: v for k, v in lp.trace_fields(lora, True, {}).items()})
    t = tr_.trace_step(key)
    traced = {t.params.names[i] for i in range(len(t.params.names)) if t.params.trainable[i]}
    assert traced == trainable
    with pytest.raises(ConfigError, match="peft.train_base=true"):
        lp.settings_from_config(PeftConfig(method=PeftMethod["qlora"], train_base=True))


def test_bnb_keeps_input_is_bitsandbytes_qlora_only():
    """peft.bnb_keeps_input (bitsandbytes before 0.43.2) reaches the trace key of a bitsandbytes
    QLoRA candidate; on a LoRA or GPTQ candidate it is refused in one line naming the key."""
    from launcher.config import PeftConfig, QuantType

    s = lp.settings_from_config(PeftConfig(method=PeftMethod["qlora"], bnb_keeps_input=True))
    assert s.bnb_keeps_input and lp.trace_fields(s, True, {})["bnb_keeps_input"] is True
    assert lp.trace_fields(lp.LoraSettings(quant_type="nf4"), True, {})["bnb_keeps_input"] is False
    for bad in (PeftConfig(method=PeftMethod["none"], bnb_keeps_input=True),
                PeftConfig(method=PeftMethod["lora"], bnb_keeps_input=True),
                PeftConfig(method=PeftMethod["qlora"], quant_type=QuantType["gptq_int4"], bnb_keeps_input=True)):
        with pytest.raises(ConfigError, match="peft.bnb_keeps_input=true"):
            lp.settings_from_config(bad)

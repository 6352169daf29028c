"""GPTQ bases (launcher/gptq.py): the stand-in QuantLinear dequantizes packed weights to what the
GPTQ format means (checked on real tensors against an independent unpacking), and the trace holds
exactly the buffers whose bytes serving plans count."""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from launcher import gptq  # noqa: E402
from launcher import trace as tr  # noqa: E402
from launcher.steptrace import Kind  # noqa: E402


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned `bits`-bit integers along `dim` into int32 words, lowest bits first (GPTQ's
    layout: word w holds elements w*32/bits ... of that dimension)."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, 0)
    v = v.reshape(v.shape[0] // per, per, *v.shape[1:])
    shifts = (torch.arange(per) * bits).view(1, per, *([1] * (v.dim() - 2)))
    words = (v << shifts).sum(dim=1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(0, dim)


@pytest.mark.parametrize("bits", [4, 8])
def test_stand_in_forward_is_the_gptq_dequantized_matmul(bits):
    torch.manual_seed(0)
    n_in, n_out, group = 256, 64, 128
    q = torch.randint(0, 2**bits, (n_in, n_out))
    zeros = torch.randint(1, 2**bits, (n_in // group, n_out))  # stored as zero - 1
    scales = torch.rand(n_in // group, n_out, dtype=torch.float16) + 0.5
    lin = torch.nn.Linear(n_in, n_out, bias=False)
    gptq.gptq_stand_in([lin], bits, group)
    lin.qweight.copy_(pack(q, bits, 0))
    lin.qzeros.copy_(pack(zeros - 1, bits, 1))
    lin.scales.copy_(scales)
    x = torch.randn(3, n_in, dtype=torch.float16)
    g = torch.arange(n_in) // group
    w = scales[g].float() * (q - zeros[g]).float()
    expected = x.float() @ w
    assert (lin(x).float() - expected).abs().max() <= 2e-3 * expected.abs().max()  # fp16 rounding


def test_traced_gptq_buffers_are_the_counted_bytes():
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=320, num_hidden_layers=2)
    k = tr.TraceKey(tr.canonical_config_json(cfg), num_layers=2, micro_batch_size=2, seq_len=128,
                    trainable="lora", lora_r=8, lora_alpha=16, lora_dropout=0.0, optimizer="adamw_foreach",
                    param_dtype="float16", autocast_dtype="float16", quant_type="gptq_int4", gptq_group_size=128)
    t = tr.trace_step(k)
    plain = tr.trace_step(dataclasses.replace(k, quant_type=None, gptq_group_size=0))
    shapes = [(256, 256), (256, 128), (256, 128), (256, 256), (256, 512), (256, 512), (512, 256)]  # (in, out)
    expected = 2 * sum(gptq.gptq_weight_bytes(i, o, 4, 128) for i, o in shapes)
    buffers = lambda tt: int(tt.nbytes[tt.kind == Kind.BUFFER].sum())  # noqa: E731
    assert buffers(t) - buffers(plain) == expected  # the model's own buffers (rotary) are in both
    names = t.params.names
    assert not any(n.endswith("proj.weight") or n.endswith("base_layer.weight") for n in names)


def test_gptq_base_plans_under_deepspeed_as_its_recipes_run_it():
    """A GPTQ base is frozen QuantLinear buffers: DeepSpeed ZeRO-2 (Qwen's Q-LoRA script) plans
    it with its own buckets, estimate only; FSDP2 is refused in one line."""
    from launcher import app, cli, planner
    from launcher.errors import ConfigError
    from launcher.hardware import cluster_from

    args = ["model=qwen2.5-0.5b", "hardware=a100-80g", "gpus=1", "peft=qlora", "peft.quant_type=gptq_int4",
            "peft.compute_dtype=float16", "training.precision=16-mixed", "training.seq_len=64",
            "training.micro_batch_size=2", "mode=plan"]
    config = cli.compose([*args, "strategy=zero2", "deepspeed.reduce_bucket_size=1000000"])
    spec = app.model_spec(config)
    plan = planner.plan(config, spec, cluster_from(config.hardware, config.gpus, config.nodes))
    (cand,) = [c for c in plan.candidates if c.micro_batch_size == 2]
    assert cand.strategy.name == "zero2" and cand.peft["quant_type"] == "gptq_int4"
    assert "GPTQ base" in cand.reason and plan.chosen is None
    config = cli.compose([*args, "strategy=fsdp2"])
    with pytest.raises(ConfigError, match="gptq_int4 is modelled under torch DDP and DeepSpeed"):
        planner.plan(config, spec, cluster_from(config.hardware, config.gpus, config.nodes))

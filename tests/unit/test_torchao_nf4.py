"""torchao NF4 bases (launcher/torchao_nf4.py, launcher/memory/torchao_build.py): the ported quantization is a working NF4 codec
(checked on real tensors against an independent nearest-code search), the trace holds the NF4
inner tensors on exactly the adapted Linears, and the model build's allocator replay shows the
mechanism its sources describe: torchao 0.1's whole-tensor nearest-value search caches blocks of
64 bytes per element of the weight, the chunked search of torchao >= 0.2 does not."""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from launcher import torchao_nf4 as nf4  # noqa: E402
from launcher import trace as tr  # noqa: E402
from launcher.memory import torchao_build as build  # noqa: E402
from launcher.memory.allocator import replay  # noqa: E402
from launcher.steptrace import Kind  # noqa: E402


@pytest.mark.parametrize("chunk", [0, 1000])
def test_quantize_then_dequantize_is_the_nearest_nf4_code(chunk):
    torch.manual_seed(0)
    w = torch.randn(64, 512, dtype=torch.bfloat16)
    inner = nf4.quantize(w, chunk)
    back = nf4.original_weight(*inner, w.shape).float()
    # independently: each block of 64 scaled by its absmax, rounded to the nearest NF4 code
    blocks = w.float().view(-1, 64)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    code = torch.tensor(nf4.NF4_CODE)
    nearest = code[(blocks / absmax).unsqueeze(-1).sub(code).abs().argmin(dim=-1)] * absmax
    err = (back.view(-1, 64) - nearest).abs()
    # torchao searches in bf16, where near-ties may pick the neighbouring code (at most the widest
    # gap between codes, 0.3038 of the block's absmax); the scalers are int8 (double quantization)
    assert (err <= 0.31 * absmax + 0.02 * absmax).all()
    assert (err <= 0.02 * absmax).float().mean() > 0.97
    assert (back - w.float()).abs().mean() < 0.1 * w.float().abs().mean()


def test_recorded_quantization_keeps_the_counted_bytes():
    n = 64 * 256 * 8
    rows, kept = build.quantize_rows(n, 0, False)
    assert sum(rows[i][2] for i in kept) == nf4.storage_bytes(n)
    assert all(rows[i][1] < 0 for i in kept) and all(r[1] >= 0 for i, r in enumerate(rows) if i not in kept)


def test_whole_tensor_search_caches_what_the_chunked_search_does_not():
    n = 4096 * 4096  # one 4096 x 4096 projection, 16.8 M elements: 64 bytes each is 1 GiB
    common = dict(num_layers=2, other_layer_bytes=0, embedding_bytes=0, head_bytes=0)
    whole = replay(build.build_load_events([n, n], chunk=0, **common))
    chunked = replay(build.build_load_events([n, n], chunk=nf4.CHUNK_TORCHAO_0_2, **common))
    resident = 2 * 2 * nf4.storage_bytes(n)  # two layers of two NF4 weights, after the load
    assert whole.peak_reserved >= resident + 64 * n
    # chunked, the largest temporaries are get_original_weight's while a layer is cloned (its
    # locals, 14 bytes per element: test_get_original_weight_keeps_its_locals_until_the_stack):
    # well under the whole-tensor search's 64 bytes per element
    assert resident + 14 * n <= chunked.peak_reserved < resident + 32 * n


def test_traced_nf4_buffers_are_on_the_adapted_linears_only():
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=320, num_hidden_layers=2)
    k = tr.TraceKey(tr.canonical_config_json(cfg), num_layers=2, micro_batch_size=2, seq_len=64,
                    trainable="lora", lora_r=8, lora_alpha=16, lora_dropout=0.0, optimizer="adamw_foreach",
                    param_dtype="bfloat16", quant_type="torchao_nf4", adapter_autocast=False,
                    lora_target_modules=("q_proj", "v_proj", "down_proj"))
    t = tr.trace_step(k)
    plain = tr.trace_step(dataclasses.replace(k, quant_type=None))
    buffers = lambda tt: int(tt.nbytes[tt.kind == Kind.BUFFER].sum())  # noqa: E731
    adapted = [256 * 256, 256 * 128, 512 * 256]  # q_proj, v_proj, down_proj: out x in
    assert buffers(t) - buffers(plain) == 2 * sum(nf4.storage_bytes(n) for n in adapted)
    names = t.params.names
    assert not any(n.endswith(("q_proj.base_layer.weight", "v_proj.base_layer.weight",
                                "down_proj.base_layer.weight")) for n in names)
    assert sum(n.endswith(("k_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight"))
               for n in names) == 2 * 4  # not adapted: bf16 parameters as in torchtune
    shape = build.build_shape(t)
    assert shape["layer_numels"] == adapted


def test_get_original_weight_keeps_its_locals_until_the_stack():
    """torchao 0.1's get_original_weight binds both nibbles widened to int64 (4 bytes per element
    each), their looked-up and scaled bf16 halves (1 byte per element each) to locals, alive when
    the 2-byte-per-element result is stacked: 14 bytes per element at its peak."""
    n = 64 * 256 * 16
    rows, _ = build.dequantize_rows(n)
    events = sorted([(a, b) for a, _, b in rows] + [(f, -b) for _, f, b in rows if f >= 0])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    assert peak >= 14 * n


def test_the_build_makes_embedding_and_head_between_the_prototype_layer_and_its_copies():
    """torchtune @fef3ed10 lora_llama2: `layer`, then `tok_embeddings`, `output_proj` and the norm,
    then TransformerDecoder's deep copies of the layer."""
    n = 64 * 256
    events = build.build_load_events([n], num_layers=2, other_layer_bytes=7, embedding_bytes=11,
                                     head_bytes=13, chunk=0)
    sizes = [b for _, op, _, b in events if op > 0]
    layer_params = [i for i, b in enumerate(sizes) if b == 7]  # the prototype's, then each copy's
    assert layer_params[0] < sizes.index(11) < sizes.index(13) < layer_params[1]
    assert sizes.count(11) == sizes.count(13) == 1

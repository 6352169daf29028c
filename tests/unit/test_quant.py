"""Quantized storage formulas against the tensors bitsandbytes and transformers really allocate on CPU."""
import warnings

import pytest

from launcher import quant

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")


def _quant_state_bytes(qs) -> int:
    """Bytes of every tensor a bitsandbytes QuantState holds, including its nested state2."""
    total = sum(t.nbytes for t in (qs.absmax, qs.code, qs.offset) if isinstance(t, torch.Tensor))
    return total + (_quant_state_bytes(qs.state2) if qs.state2 is not None else 0)


def _unique_state_bytes(optimizer) -> int:
    """Bytes of all optimizer state tensors, each storage once (qmaps are shared between parameters)."""
    seen = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                seen[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("shape", [(64, 64), (100, 33), (7, 9), (1000, 1000)])
@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("quant_type,blocksize", [("nf4", 64), ("fp4", 64), ("nf4", 128)])
def test_four_bit_bytes_match_quantize_4bit(shape, double_quant, quant_type, blocksize):
    packed, qs = bnb.functional.quantize_4bit(torch.randn(*shape), blocksize=blocksize,
                                              compress_statistics=double_quant, quant_type=quant_type)
    numel = shape[0] * shape[1]
    got = quant.four_bit_weight_bytes(numel, blocksize=blocksize, double_quant=double_quant,
                                      quant_type=quant_type)
    assert got["packed_weight_bytes"] == packed.nbytes
    assert got["total_bytes"] == packed.nbytes + _quant_state_bytes(qs)
    expected_absmax = qs.absmax.nbytes
    assert got["absmax_bytes"] == expected_absmax
    if double_quant:
        assert got["nested_absmax_bytes"] == qs.state2.absmax.nbytes


def test_nf4_double_quant_saves_about_three_eighths_bit_per_parameter():
    # QLoRA sec. 3: blocksize 64 absmax costs 32/64 = 0.5 bit/param; double quantization 8/64 + 32/(64*256).
    numel = 64 * 256 * 1000
    plain = quant.nf4_weight_bytes(numel, double_quant=False)
    nested = quant.nf4_weight_bytes(numel, double_quant=True)
    assert plain["absmax_bytes"] * 8 / numel == pytest.approx(0.5)
    stats_bits = (nested["absmax_bytes"] + nested["nested_absmax_bytes"]) * 8 / numel
    assert stats_bits == pytest.approx(8 / 64 + 32 / (64 * 256))
    assert quant.fp4_weight_bytes(numel) == nested


def test_four_bit_rejects_unknown_options():
    with pytest.raises(ValueError):
        quant.four_bit_weight_bytes(64, blocksize=48)
    with pytest.raises(ValueError):
        quant.four_bit_weight_bytes(64, quant_type="int4")


@pytest.mark.parametrize("out_features,in_features", [(300, 200), (7, 64)])
def test_int8_bytes_match_vectorwise_quant(out_features, in_features):
    cb, scb, outliers = bnb.functional.int8_vectorwise_quant(
        torch.randn(out_features, in_features, dtype=torch.float16))
    assert outliers is None
    got = quant.int8_weight_bytes(out_features, in_features)
    assert got["total_bytes"] == cb.nbytes + scb.nbytes
    assert cb.dtype == torch.int8 and scb.dtype == torch.float32


def _model_with_numels():
    # Sizes straddle min_8bit_size=4096 and 256-element blocks: 4095 (fp32), 4096, 99,900 (partial block),
    # 100,000 (paged on GPU), biases (fp32).
    return torch.nn.ModuleDict({
        "a": torch.nn.Linear(4095, 1, bias=True),
        "b": torch.nn.Linear(64, 64, bias=False),
        "c": torch.nn.Linear(333, 300, bias=True),
        "d": torch.nn.Linear(1000, 100, bias=False),
    })


def _one_step(model, optimizer):
    loss = sum(layer(torch.randn(2, layer.in_features, dtype=layer.weight.dtype)).sum() for layer in model.values())
    loss.backward()
    optimizer.step()


@pytest.mark.parametrize("cls_name,num_states,paged", [("AdamW8bit", 2, False), ("PagedAdamW8bit", 2, True),
                                                        ("Lion8bit", 1, False)])
def test_8bit_optimizer_state_bytes_match_bitsandbytes(cls_name, num_states, paged):
    torch.manual_seed(0)
    model = _model_with_numels()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged optimizers warn that CPU falls back to ordinary memory
        optimizer = getattr(bnb.optim, cls_name)(model.parameters(), lr=1e-3)
        _one_step(model, optimizer)
    numels = [p.numel() for p in model.parameters()]
    got = quant.adamw_8bit_state_bytes(numels, num_states=num_states, paged=paged)
    assert got["total_bytes"] == _unique_state_bytes(optimizer)
    assert got["qmap_bytes"] == num_states * 256 * 4
    # Only parameter d (100,000 elements) reaches the 1e5 paging threshold (optim/optimizer.py get_state_buffer).
    assert got["paged_bytes"] == (num_states * 100_000 if paged else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_32bit_paged_optimizer_state_bytes_match_bitsandbytes(dtype):
    """PagedAdamW32bit keeps two fp32 states per parameter whatever the parameter's dtype; the states
    of parameters of 1e5 elements or more are the paged ones."""
    torch.manual_seed(0)
    model = _model_with_numels().to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = bnb.optim.PagedAdamW32bit(model.parameters(), lr=1e-3)
        _one_step(model, optimizer)
    numels = [p.numel() for p in model.parameters()]
    got = quant.adamw_32bit_state_bytes(numels, paged=True)
    assert got["total_bytes"] == _unique_state_bytes(optimizer) == 2 * 4 * sum(numels)
    assert got["paged_bytes"] == 2 * 4 * 100_000


def test_8bit_optimizer_small_params_only_have_fp32_state_and_no_qmap():
    got = quant.adamw_8bit_state_bytes([10, 4095])
    assert got == {"fp32_state_bytes": 2 * 4 * 4105, "uint8_state_bytes": 0, "absmax_bytes": 0,
                   "qmap_bytes": 0, "paged_bytes": 0, "total_bytes": 2 * 4 * 4105}


@pytest.mark.parametrize("beta1", [None, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adafactor_state_bytes_match_transformers(beta1, dtype):
    from transformers.optimization import Adafactor

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape, dtype=dtype)) for shape in [(37,), (48, 20), (3, 5, 7)]]
    optimizer = Adafactor(params, beta1=beta1, lr=None, relative_step=True, scale_parameter=True)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    got = quant.adafactor_state_bytes([p.shape for p in params], beta1=beta1)
    assert got["total_bytes"] == _unique_state_bytes(optimizer)
    # Factored second moment of a [48, 20] matrix: 48 + 20 fp32 values, not 960.
    assert quant.adafactor_state_bytes([(48, 20)])["second_moment_bytes"] == (48 + 20) * 4

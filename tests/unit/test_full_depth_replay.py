"""The allocator replay at the real depth (launcher/memory/replay.py `full_depth_items`): a step
rebuilt from the traces at 2 and 3 layers must replay like the step traced at the real depth,
block for block, for every framework layout whose storages repeat per layer."""
from __future__ import annotations

import collections
import dataclasses

import pytest

transformers = pytest.importorskip("transformers")

from launcher import trace as tr  # noqa: E402
from launcher.backends.registry import knobs  # noqa: E402
from launcher.config import DDPConfig, DeepSpeedConfig  # noqa: E402
from launcher.memory.allocator import replay  # noqa: E402
from launcher.memory.estimate import layout_set, trace_request  # noqa: E402
from launcher.memory.replay import _items, allocation_events, full_depth_items, layer_blocks  # noqa: E402
from launcher.steptrace import TraceSet  # noqa: E402
from launcher.types import Strategy, Workload  # noqa: E402

DEPTH = 6
STRATEGIES = {"single": Strategy("single", "ddp"), "ddp": Strategy("ddp", "ddp"),
              "zero2": Strategy("zero2", "deepspeed", 2), "zero3": Strategy("zero3", "deepspeed", 3),
              "fsdp2": Strategy("fsdp2", "fsdp2"), "fsdp1": Strategy("fsdp1", "fsdp1")}


def _traces(strategy: Strategy, checkpointing: bool) -> dict:
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=320, num_hidden_layers=2)
    wl = Workload(2, 1, "bf16-mixed", "adamw_torch", checkpointing, "sdpa")
    base = tr.TraceKey(tr.canonical_config_json(cfg), 2, 2, 64, gradient_checkpointing=checkpointing,
                       **trace_request(strategy, wl))
    return wl, {d: tr.trace_step(dataclasses.replace(base, num_layers=d)) for d in (2, 3, DEPTH - 1, DEPTH)}


def _layouts(t: dict, a: int, b: int, strategy: Strategy, wl: Workload):
    # ZeRO-2/3 with buckets larger than the model's gradients: one flush after backward at any
    # depth; ZeRO-3 gathers every parameter (none persistent) and keeps them to their backward
    ds = DeepSpeedConfig(reduce_bucket_size=10**8, allgather_bucket_size=10**8, stage3_param_persistence_threshold=0)
    return layout_set(TraceSet(t[a], t[b], DEPTH), strategy, wl, knobs(deepspeed=ds), 2, "cuda").groups[0][1]


@pytest.mark.parametrize("name,checkpointing,built_on_device", [
    ("single", False, False), ("single", True, False), ("ddp", True, False), ("zero2", False, False),
    ("zero3", False, False), ("fsdp2", False, False), ("fsdp2", False, True), ("fsdp1", False, False),
    ("fsdp1", False, True)])
def test_a_step_rebuilt_at_depth_replays_like_the_step_traced_there(name, checkpointing, built_on_device):
    strategy = STRATEGIES[name]
    wl, t = _traces(strategy, checkpointing)
    wl = dataclasses.replace(wl, built_on_device=built_on_device)  # the model on the device before wrapping
    shallow, deep = _layouts(t, 2, 3, strategy, wl)
    real = _layouts(t, DEPTH - 1, DEPTH, strategy, wl)[1]
    rebuilt_items, num_events = full_depth_items(shallow, deep, DEPTH)
    items = rebuilt_items.tuples()
    # the same storages: sizes and streams, and the same number of them (FSDP2 and FSDP1: a
    # block's backward prefetch of the middle block is issued before that block, so the rebuilt
    # step lacks the inserted blocks' backward all-gather buffers, and holds one more copy of an
    # activation instead; replay.py `full_depth_items`)
    sizes = collections.Counter((i[3], i[4]) for i in items) - collections.Counter((i[3], i[4]) for i in _items(real).tuples())
    assert not sizes if not name.startswith("fsdp") else set(sizes) <= {(16384, 0), (32768, 0)}
    # the forward and backward blocks of one layer are what a layer adds to the trace (FSDP2's
    # layout inserts its own events at each block's boundaries)
    fl, bl = layer_blocks(shallow, deep)
    per_layer = {ph: (t[3].layer_bounds[ph][1] - t[3].layer_bounds[ph][0])
                 - (t[2].layer_bounds[ph][1] - t[2].layer_bounds[ph][0]) for ph in ("forward", "backward")}
    if not name.startswith("fsdp"):
        assert (fl, bl) == (per_layer["forward"], per_layer["backward"])
    if name == "single" and not checkpointing:  # forward and backward event by event, from the start of forward
        def steps(its, lay, shift):
            a, b = lay.phases["forward"][0], lay.phases["backward"][1] + shift
            return collections.Counter((i[0] - a, i[1] - a, i[3]) for i in its if a <= i[0] and i[1] <= b)
        assert steps(items, deep, (DEPTH - 3) * (fl + bl)) == steps(_items(real).tuples(), real, 0)
    # FSDP's initialization on the device (`Layout.init`) is replayed first, at the real depth
    rebuilt = replay(allocation_events(deep, 80, rebuilt_items, num_events, DEPTH))
    traced = replay(allocation_events(real, 80))
    assert (rebuilt.peak_reserved, rebuilt.peak_needed) == (traced.peak_reserved, traced.peak_needed)
    # ZeRO-3's 16-bit model: a tensor of the second-to-last layer that the last layer frees when
    # its forward ends is freed, in the rebuilt layers, there too instead of one layer later
    assert rebuilt.peak_allocated == pytest.approx(traced.peak_allocated, rel=1e-3 if name == "zero3" else 0)


def test_a_step_no_deeper_than_its_trace_is_not_rebuilt():
    strategy = STRATEGIES["single"]
    wl, t = _traces(strategy, False)
    shallow, deep = _layouts(t, 2, 3, strategy, wl)
    assert full_depth_items(shallow, deep, 3) is None
    assert layer_blocks(deep, shallow) is None  # not one layer deeper


def test_buckets_that_grow_in_number_with_depth_keep_their_total():
    """A DDP reducer with buckets smaller than a layer's gradients has more buckets at a greater
    depth, each its own storage alive through the step: the rebuilt step holds their total at the
    real depth (replay.py `_persistent_growth`), and neither loses nor doubles one bucket by
    matching buckets of one index across depths (the embedding's bucket is the last index at 2
    layers, a layer's at 3)."""
    strategy = STRATEGIES["ddp"]
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=320, num_hidden_layers=2)
    wl = Workload(2, 1, "bf16-mixed", "adamw_torch", False, "sdpa")
    base = tr.TraceKey(tr.canonical_config_json(cfg), 2, 1, 16, **trace_request(strategy, wl))
    t = {d: tr.trace_step(dataclasses.replace(base, num_layers=d)) for d in (2, 3, DEPTH - 1, DEPTH)}
    small = knobs(ddp=DDPConfig(bucket_cap_mb=0.5))  # after torch's 1 MiB first bucket, 2.4 MB of gradients a layer

    def lays(a, b):
        return layout_set(TraceSet(t[a], t[b], DEPTH), strategy, wl, small, 2, "cuda").groups[0][1]

    shallow, deep = lays(2, 3)
    real = lays(DEPTH - 1, DEPTH)[1]
    assert len(real.terms) > len(deep.terms) > len(shallow.terms)  # more buckets at every depth
    items, n = full_depth_items(shallow, deep, DEPTH)
    items = items.tuples()
    whole = sum(i[3] for i in items if i[0] == 0 and i[1] >= n and i[2][0] in ("term", "grown"))
    assert whole == sum(term.nbytes for term in real.terms if term.start == 0 and term.end >= real.num_events)
    assert all(i[3] > 0 for i in items)


def test_a_gptq_base_is_rebuilt_with_every_layer_s_packed_weights():
    """A GPTQ base keeps its packed weights in module buffers (qweight, qzeros, scales, g_idx), not
    parameters: the rebuilt step repeats the middle layer's (`StepTrace.buffer_layer`), and the
    16-bit weights the stand-in drops while the model is built are not replayed on the device
    (replay.py `_items`): the rebuilt step replays as the step traced at the real depth."""
    strategy = STRATEGIES["single"]
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=320, num_hidden_layers=2)
    wl = Workload(16, 1, "16-mixed", "adamw_torch", True, "sdpa")
    request = {**trace_request(strategy, wl), "param_dtype": "float16"}  # GPTQ computes in fp16
    base = tr.TraceKey(tr.canonical_config_json(cfg), 2, 1, 16, gradient_checkpointing=True, trainable="lora",
                       lora_r=8, lora_alpha=16, quant_type="gptq_int4", gptq_group_size=128, **request)
    t = {d: tr.trace_step(dataclasses.replace(base, num_layers=d)) for d in (2, 3, DEPTH - 1, DEPTH)}
    assert (t[3].buffer_layer >= 0).sum() > (t[2].buffer_layer >= 0).sum() > 0
    shallow, deep = _layouts(t, 2, 3, strategy, wl)
    real = _layouts(t, DEPTH - 1, DEPTH, strategy, wl)[1]
    items, num_events = full_depth_items(shallow, deep, DEPTH)
    rebuilt = replay(allocation_events(deep, 80, items, num_events))
    traced = replay(allocation_events(real, 80))
    assert rebuilt.peak_reserved == traced.peak_reserved
    # seven 32-byte storages a layer that belong to no parameter or buffer are not repeated
    assert rebuilt.peak_allocated == pytest.approx(traced.peak_allocated, rel=1e-3)

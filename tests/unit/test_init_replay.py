"""A framework's initialization of the model on the device, replayed through the allocator before
the step (launcher/memory/replay.py `init_events`, `Layout.init`): FSDP1's per-unit parameter
copies, flatten and shard (torch/distributed/fsdp/_init_utils.py, _flat_param.py) and FSDP2's
per-parameter shards (_fully_shard/_fsdp_init.py, _fsdp_param.py), against cases worked by hand
from the allocator's rules (allocator.py)."""
import numpy as np

from launcher.memory.allocator import replay, replay_arrays
from launcher.memory.common import Init, InitUnit
from launcher.memory.replay import init_events

MiB = 2**20


def _replayed(init: Init, depth: int, num_layers: int):
    op, key, nbytes, stream = init_events(init, depth, num_layers)
    python = replay(zip(np.zeros(len(op), np.int64).tolist(), op.tolist(), key.tolist(), nbytes.tolist()))
    assert replay_arrays(op, key, nbytes, stream)[:5] == (python.peak_reserved, python.peak_allocated,
                                                          python.peak_needed, python.reserved, python.allocated)
    return python


# three units of two 40 MiB parameters, flattened into 80 MiB and kept whole (one rank)
UNITS = tuple(InitUnit(layer, (40 * MiB, 40 * MiB), (80 * MiB,), flat=80 * MiB) for layer in range(3))


def test_units_moved_one_at_a_time_reuse_the_previous_units_blocks():
    # unit 0: parameters in segments A, B (40 each), flat C (80), A and B freed, the shard fits
    # neither: segment D (80), C freed. Units 1 and 2: parameters back in A and B, flat in C, the
    # shard again in a new segment (E, F). Held: A, B, C = 160 MiB; kept: the three shards.
    a = _replayed(Init(UNITS, built_on_device=False, kept="sharded_params"), 3, 3)
    assert (a.reserved, a.allocated) == (400 * MiB, 240 * MiB)


def test_a_model_built_on_the_device_leaves_every_parameter_segment_cached():
    # all six parameters first (240 MiB in six segments), then per unit: flat G (80; C for the later
    # units), two parameters freed, the shard in a new segment (no free block of 80 MiB: the freed
    # parameters' are 40 each), the flat freed. Held: the six parameter segments and G = 320 MiB
    a = _replayed(Init(UNITS, built_on_device=True, kept="sharded_params"), 3, 3)
    assert (a.reserved, a.allocated) == (560 * MiB, 240 * MiB)
    # the peaks restart at the end (op 0): the step's peaks start from what the initialization leaves
    assert (a.peak_reserved, a.peak_allocated) == (560 * MiB, 240 * MiB)


def test_fsdp2_shards_each_parameter_while_the_unit_is_on_the_device():
    # three units of two 40 MiB parameters, two ranks: each parameter's 20 MiB padded shard is
    # allocated while the unit's copies are alive (fully_shard holds them until it returns).
    # Unit 0: A, B (40 each), shards C, D (20 each), A and B freed. Units 1 and 2: copies back in A
    # and B, their shards in new 20 MiB segments. Held: A and B; kept: six shards.
    units = tuple(InitUnit(layer, (40 * MiB, 40 * MiB), (20 * MiB, 20 * MiB)) for layer in range(3))
    a = _replayed(Init(units, built_on_device=False, kept="sharded_params"), 3, 3)
    assert (a.reserved, a.allocated) == (200 * MiB, 120 * MiB)
    # built on the device: the six copies (240 MiB), unit 0's shards in two new segments, then a
    # freed 40 MiB copy holds two shards, split: unit 1's go into unit 0's first copy, unit 2's
    # into its second; the other four copies stay cached
    b = _replayed(Init(units, built_on_device=True, kept="sharded_params"), 3, 3)
    assert (b.reserved, b.allocated) == (280 * MiB, 120 * MiB)


def test_the_second_to_last_traced_unit_repeats_for_the_inserted_layers():
    units = (InitUnit(0, (MiB,), (MiB,), flat=MiB), InitUnit(1, (2 * MiB,), (MiB,), flat=2 * MiB),
             InitUnit(2, (3 * MiB,), (MiB,), flat=3 * MiB), InitUnit(-1, (5 * MiB,), (MiB,), flat=5 * MiB))
    op, key, nbytes, _ = init_events(Init(units, built_on_device=False, kept="sharded_params"), 3, 6)
    # per unit: parameter, flat, parameter freed, shard, flat freed; then the restart
    flats = nbytes[1:-1:5].tolist()
    assert flats == [1 * MiB, 2 * MiB, 2 * MiB, 2 * MiB, 2 * MiB, 3 * MiB, 5 * MiB]
    assert op.tolist() == [1, 1, -1, 1, -1] * 7 + [0]
    shards = key[3:-1:5]
    assert len(set(shards.tolist())) == 7 and not np.isin(shards, key[op < 0]).any()  # kept, never freed


def test_fsdp1_layouts_carry_their_units_initialization():
    import dataclasses

    import pytest
    pytest.importorskip("transformers")
    from tests.unit.test_full_depth_replay import STRATEGIES, _layouts, _traces

    wl, t = _traces(STRATEGIES["fsdp1"], False)
    for built in (False, True):
        lay = _layouts(t, 2, 3, STRATEGIES["fsdp1"], dataclasses.replace(wl, built_on_device=built))[1]
        init = lay.init
        assert init.built_on_device is built and [u.layer for u in init.units] == [0, 1, 2, -1]
        # the kept shards are the persistent sharded parameters (2 ranks: half of each flat parameter)
        (kept,) = [term for term in lay.terms if term.name == init.kept]
        assert sum(sum(u.shards) for u in init.units) == kept.nbytes
        assert all(len(u.shards) == 1 and 2 * u.shards[0] == u.flat for u in init.units)
        # every parameter once, in the model's dtype (fp32 under bf16-mixed)
        assert sum(sum(u.params) for u in init.units) == 4 * int(t[3].params.numel[t[3].params.tied_to < 0].sum())


def test_fsdp2_layouts_carry_each_parameters_shard_and_none_under_offload():
    import dataclasses

    import pytest
    pytest.importorskip("transformers")
    from launcher.types import Strategy
    from tests.unit.test_full_depth_replay import STRATEGIES, _layouts, _traces

    wl, t = _traces(STRATEGIES["fsdp2"], False)
    lay = _layouts(t, 2, 3, STRATEGIES["fsdp2"], dataclasses.replace(wl, built_on_device=True))[1]
    init = lay.init
    assert init.built_on_device and [u.layer for u in init.units] == [0, 1, 2, -1]
    (kept,) = [term for term in lay.terms if term.name == init.kept]
    assert sum(sum(u.shards) for u in init.units) == kept.nbytes
    # no flat parameter; every parameter once, fp32 under bf16-mixed, and its shard half of it
    # (2 ranks; the tiny Llama's dimensions divide)
    assert all(not u.flat and len(u.shards) == len(u.params) for u in init.units)
    assert sum(sum(u.params) for u in init.units) == 4 * int(t[3].params.numel[t[3].params.tied_to < 0].sum())
    assert all(2 * s == p for u in init.units for s, p in zip(u.shards, u.params))
    offload = Strategy("fsdp2_offload", "fsdp2", offload_params=True)
    assert _layouts(t, 2, 3, offload, wl)[1].init is None  # shards made on the host: not replayed

"""FSDP1's flat parameters as _flat_param.py lays them out, on a hand-made parameter table: each
parameter starts at a multiple of 16 bytes of the compute dtype, the total is padded to a multiple
of the world size, every rank keeps an equal chunk, and a rank's optimizer states cover the
trainable numel inside its chunk. And FSDP1 is planned by name only."""
from types import SimpleNamespace

import numpy as np

from launcher.backends.fsdp1.layout import units
from launcher.config import LauncherConfig, StrategyName
from launcher.planner import strategies_for


def table(numels, layer, trainable):
    n = len(numels)
    return SimpleNamespace(params=SimpleNamespace(names=tuple(f"p{i}" for i in range(n)), numel=np.array(numels),
                                                  layer=np.array(layer), trainable=np.array(trainable),
                                                  tied_to=np.full(n, -1)))


def test_flat_parameter_alignment_world_padding_and_chunks():
    # one unit of three fp32 parameters (4 elements per 16 bytes): 5 -> [0, 5), padding 3,
    # 6 -> [8, 14), padding 2, 3 -> [16, 19); 19 padded to 21 for 3 ranks: chunks of 7
    t = table([5, 6, 3], [0, 0, 0], [True, False, True])
    u = units(t, world=3, compute_bytes=4)[0]
    assert u.spans == [(0, 5), (8, 6), (16, 3)] and u.numel == 21 and u.shard == 7
    # rank 0 [0, 7): 5 of p0; rank 1 [7, 14): none of p0 or p2 (p1 is frozen); rank 2 [14, 21): 3 of p2
    assert [u.local(r, t.params.trainable) for r in range(3)] == [[5, 0], [0, 0], [0, 3]]
    # bf16 aligns to 8 elements: 5 -> [0, 5), 6 -> [8, 14), 3 -> [16, 19); 19 padded to 20 for 2 ranks
    u = units(t, world=2, compute_bytes=2)[0]
    assert u.spans == [(0, 5), (8, 6), (16, 3)] and u.numel == 20 and u.shard == 10
    assert [u.local(r, t.params.trainable) for r in range(2)] == [[5, 0], [0, 3]]


def test_units_follow_the_layers_and_skip_tied_copies():
    t = table([4, 8, 8, 4], [-1, 0, 1, -1], [True] * 4)
    t.params.tied_to[3] = 0  # an LM head tied to the embedding: one copy in the root's flat parameter
    us = units(t, world=2, compute_bytes=4)
    assert sorted(us) == [-1, 0, 1] and us[-1].params == [0] and us[-1].numel == 4


def test_fsdp1_is_planned_by_name_only():
    auto = {s.name for s in strategies_for(LauncherConfig())}
    assert "fsdp2" in auto and not auto & {"fsdp1", "fsdp1_grad_op"}
    by_name = LauncherConfig()
    by_name.strategy = StrategyName["fsdp1"]
    assert [s.name for s in strategies_for(by_name)] == ["fsdp1"]

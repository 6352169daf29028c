"""Batches of varying length (launcher/lengths.py): the length profiles, the allocator replay over a
run of such batches (launcher/memory/replay.py `varlen_replay`), and what a plan makes of them."""
from __future__ import annotations

import dataclasses
import json

import pytest

from launcher import lengths, planner
from launcher.app import model_spec
from launcher.cli import compose
from launcher.errors import ConfigError
from launcher.hardware import cluster_from
from launcher.memory.allocator import CachingAllocator
from launcher.memory.replay import Items, varlen_replay
from launcher.types import Workload

MIB = 2**20


def test_batches_are_their_longest_example_cut_at_the_cap(tmp_path):
    counts = tmp_path / "counts.txt"
    counts.write_text("\n".join(str(n) for n in (100, 200, 300, 400)) + "\n")
    p = lengths.load(str(counts))
    assert p.longest == 400
    one = p.batch_lengths(cap=1000, micro_batch_size=1, count=2000, seed=0)
    assert 100 <= min(one) and max(one) <= 400
    four = p.batch_lengths(cap=1000, micro_batch_size=4, count=2000, seed=0)
    assert sum(four) / len(four) > sum(one) / len(one) + 50  # the longest of four examples
    capped = p.batch_lengths(cap=250, micro_batch_size=1, count=2000, seed=0)
    assert max(capped) == 250 and min(capped) >= 100
    assert p.batch_lengths(1000, 2, 50, seed=3) == p.batch_lengths(1000, 2, 50, seed=3)
    assert p.batch_lengths(1000, 2, 50, seed=3) != p.batch_lengths(1000, 2, 50, seed=4)
    assert p.peak_length(1000) == 400 and p.peak_length(256) == 256
    sixteens = p.batch_lengths(cap=250, micro_batch_size=1, count=2000, seed=0, multiple=16)
    assert {n % 16 for n in sixteens if n < 250} == {0} and 250 in sixteens and min(sixteens) == 112
    assert p.peak_length(1000, multiple=16) == 400 and p.peak_length(1000, multiple=64) == 448


def test_the_shipped_alpaca_profile_is_a_distribution_with_its_source():
    p = lengths.load("alpaca")
    assert "alpaca" in lengths.names()
    assert "lengths.ipynb" in p.source
    assert p.fractions[0] == 0.0 and p.fractions[-1] == 1.0
    assert all(b > a for a, b in zip(p.fractions, p.fractions[1:]))
    assert all(b >= a for a, b in zip(p.tokens, p.tokens[1:]))
    batches = p.batch_lengths(cap=512, micro_batch_size=2, count=1000, seed=0)
    assert 0 < min(batches) < sorted(batches)[500] < max(batches) <= 512


@pytest.mark.parametrize("text,why", [
    ('{"cdf": [[300, 0.5], [100, 1.0]]}', "increasing"),
    ('{"cdf": [[100, 0.7], [300, 0.2]]}', "increasing"),
    ('{"points": []}', "unreadable"),
    ("12 abc 40", "unreadable"),
])
def test_a_bad_profile_names_the_key_and_the_format(tmp_path, text, why):
    path = tmp_path / ("p.json" if text.startswith("{") else "p.txt")
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        lengths.load(str(path))
    assert str(err.value).startswith(f"training.length_profile={path}:") and why in str(err.value)
    with pytest.raises(ConfigError, match="training.length_profile=nope: no such profile; use one of alpaca"):
        lengths.load("nope")


# One step, on a timeline of 5 events: a persistent 64 MiB storage, an activation X of 128 MiB at
# 512 tokens (64 MiB at 256) alive over events 1-2 and a 30 MiB buffer Y alive over 2-3.
STEP_512 = Items.of([(0, 5, "P", 64 * MIB, 0), (1, 3, "X", 128 * MIB, 0), (2, 4, "Y", 30 * MIB, 0)])
STEP_256 = Items.of([(0, 5, "P", 64 * MIB, 0), (1, 3, "X", 64 * MIB, 0), (2, 4, "Y", 30 * MIB, 0)])


def held(batches, capacity=None):
    return varlen_replay(STEP_512, STEP_256, 5, 512, 256, batches, sm_arch=80, capacity=capacity)[0]


def test_a_longer_batch_after_a_shorter_one_strands_the_shorter_ones_segment():
    """Batch 256 then 512: X's 64 MiB segment cannot serve X at 128 MiB, which gets its own
    segment, and the 64 MiB one stays cached (segments are returned only when memory runs out)."""
    fixed = held([512, 512])
    assert held([256, 512]) - fixed == 64 * MIB
    # the other order reuses the 128 MiB segment for the 64 MiB request (best fit, split)
    assert held([512, 256]) == fixed
    # sizes between the two traced lengths are interpolated: X at 384 tokens is 96 MiB
    assert held([384, 512]) - fixed == 96 * MIB


def test_a_full_device_returns_its_free_segments_before_growing():
    """With the device's capacity below what the stranded segment needs, the allocator frees its
    wholly free cached segments (release_cached_blocks) and reserved stays at one step's."""
    fixed = held([512, 512])
    # P, cuBLAS' two 8.125 MiB workspaces in one 20 MiB segment, X and Y at 512 tokens, and 63 MiB
    # more: not room for the stranded 64 MiB segment
    assert held([256, 512], capacity=(64 + 20 + 128 + 30 + 63) * MIB) == fixed
    assert held([256, 512], capacity=(64 + 20 + 128 + 30 + 64) * MIB) - fixed == 64 * MIB


def test_a_batch_is_replayed_again_only_when_the_cache_has_changed(monkeypatch):
    """A batch that repeats a length from the same cached segments makes the same requests and
    reaches the same peaks, so it is not replayed; one whose cache the previous batch grew is."""
    mallocs = []

    class Counting(CachingAllocator):
        def malloc(self, nbytes, stream=0):
            mallocs.append(nbytes)
            return super().malloc(nbytes, stream)

    # the Python replay, whose requests can be counted (the compiled one has the same rules:
    # tests/unit/test_native_replay.py)
    monkeypatch.setattr("launcher.memory.allocator.CachingAllocator", Counting)
    monkeypatch.setattr("launcher.memory.allocator._NATIVE", [None])
    # the first 256 maps X's and Y's segments, the second meets them cached, the rest repeat it;
    # 512 maps X's 128 MiB segment: P and cuBLAS' two workspaces, then 2 requests per batch replayed
    repeated = held([256] * 10 + [512])
    assert len(mallocs) == 3 + 2 * 3
    assert repeated == held([256, 512]) == 64 * MIB + held([512, 512])
    mallocs.clear()
    held([256, 512, 512, 256, 256, 256])  # after 512's growth, 256 is replayed once more
    assert len(mallocs) == 3 + 2 * 4


def test_release_keeps_segments_that_hold_live_blocks():
    a = CachingAllocator()
    live = a.malloc(40 * MIB)
    rest = a.malloc(30 * MIB)
    a.free(rest)  # a whole segment, cached
    first = a.malloc(60 * MIB)
    a.free(first)  # its segment, cached
    part = a.malloc(20 * MIB)  # splits the 30 MiB segment (best fit): part of it is live
    assert a.reserved == 130 * MIB
    a.release_cached_blocks()
    assert a.reserved == 70 * MIB  # the 60 MiB segment is returned; live's and part's stay
    a.free(part), a.free(live)
    assert a.reserved == 70 * MIB and a.allocated == 0


def _plan(tmp_path, *overrides):
    config = compose(["model=tiny-llama", "hardware=a100-80g", "gpus=1", "strategy=single",
                      "training.micro_batch_size=2", f"cache_dir={tmp_path}", *overrides])
    spec = model_spec(config)
    return planner.plan(config, spec, cluster_from(config.hardware, config.gpus, config.nodes))


def test_a_plan_over_alpaca_batches_replays_them_and_says_so(tmp_path):
    fixed = _plan(tmp_path, "training.seq_len=512").candidates[0]
    plan = _plan(tmp_path, "training.seq_len=512", "training.length_profile=alpaca")
    varlen = plan.candidates[0]
    # the run's longest batch is at the cap; its mean one is shorter, and so are the mean step's FLOPs
    assert varlen.memory.peak_allocated_bytes == fixed.memory.peak_allocated_bytes
    assert varlen.memory.peak_reserved_bytes >= fixed.memory.peak_reserved_bytes
    assert varlen.speed.breakdown["flops"] < 0.5 * fixed.speed.breakdown["flops"]
    note = next(n for n in varlen.memory.notes if n.startswith("variable-length batches"))
    assert "301 micro-batches" in note and "training.length_profile=alpaca" in note
    assert any("speed is estimated at their mean" in n for n in plan.notes)


def test_the_mean_step_of_varying_batches():
    """Attention FLOPs grow with the square of the length, the rest linearly between the two traced
    lengths: batches of 256 and 512 tokens average 384 tokens and 5/8 of the 512-token attention."""
    long = {"forward": 100.0, "attention_forward": 40.0, "backward": 200.0, "attention_backward": 80.0}
    short = {"forward": 40.0, "attention_forward": 10.0, "backward": 80.0, "attention_backward": 20.0}
    wl = Workload(512, 2, "bf16-true", "adamw_torch", True, "sdpa")
    run = lengths.VarlenRun(None, dataclasses.replace(wl, seq_len=256), (256, 512), "test")
    flops, at = planner.mean_length_flops(long, short, wl, run)
    assert flops == {"forward": 45.0 + 25.0, "attention_forward": 25.0, "backward": 90.0 + 50.0,
                     "attention_backward": 50.0}
    assert at.seq_len == 384


def test_a_cap_above_the_longest_example_plans_the_longest(tmp_path):
    counts = tmp_path / "short.txt"
    counts.write_text("30\n60\n90\n")
    at_90 = _plan(tmp_path, "training.seq_len=90").candidates[0].memory
    plan = _plan(tmp_path, "training.seq_len=512", f"training.length_profile={counts}")
    assert plan.candidates[0].memory.peak_allocated_bytes == at_90.peak_allocated_bytes
    assert any("the longest 90 tokens (the longest example)" in n for n in plan.notes)


def test_profile_content_is_part_of_the_candidate_memo_key(tmp_path):
    counts = tmp_path / "p.txt"
    counts.write_text("30\n60\n90\n")
    first = _plan(tmp_path, "training.seq_len=512", f"training.length_profile={counts}").candidates[0].memory
    counts.write_text("30\n60\n200\n")
    lengths.load.cache_clear()
    second = _plan(tmp_path, "training.seq_len=512", f"training.length_profile={counts}").candidates[0].memory
    assert second.peak_allocated_bytes > first.peak_allocated_bytes


def test_json_profile_written_by_hand(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"cdf": [[40, 0.1], [100, 0.5], [400, 1.0]]}))
    p = lengths.load(str(path))
    assert p.longest == 400 and p.tokens[0] == 40 and p.fractions[0] == 0.0

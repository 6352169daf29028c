"""Candidates kept on disk (launcher/candidate_memo.py): a plan made again from them equals the
plan estimated afresh, and every input of an estimate is in the key of its file."""
import dataclasses

from launcher import candidate_memo, planner
from launcher.app import model_spec
from launcher.cli import compose
from launcher.hardware import cluster_from


def _inputs(tmp_path, *overrides):
    config = compose(["model=tiny-llama", "hardware=a100-80g", "training.seq_len=128", f"cache_dir={tmp_path}",
                      "gpus=2", *overrides])
    spec = model_spec(config)
    return config, spec, cluster_from(config.hardware, config.gpus, config.nodes)


def test_plan_from_kept_candidates_equals_a_fresh_plan(tmp_path, monkeypatch):
    config, spec, cluster = _inputs(tmp_path)
    fresh = planner.plan(config, spec, cluster)
    files = list((tmp_path / "candidates").glob("*.json"))
    assert len(files) == 1
    calls = []
    monkeypatch.setattr(planner, "evaluate", lambda *a, **k: calls.append(a))
    again = planner.plan(config, spec, cluster)
    assert calls == [] and again == fresh


def test_every_input_is_in_the_key(tmp_path):
    config, spec, cluster = _inputs(tmp_path)
    key = candidate_memo.context_key(config, spec, cluster)
    assert candidate_memo.context_key(dataclasses.replace(config, run_dir="elsewhere"), spec, cluster) == key
    other, _, _ = _inputs(tmp_path, "deepspeed.reduce_bucket_size=1000")
    assert candidate_memo.context_key(other, spec, cluster) != key
    assert candidate_memo.context_key(config, dataclasses.replace(spec, num_layers=3), cluster) != key
    assert candidate_memo.context_key(config, spec, dataclasses.replace(cluster, memory_bytes=1)) != key


def test_values_round_trip_with_their_types(tmp_path):
    config, spec, cluster = _inputs(tmp_path)
    plan = planner.plan(config, spec, cluster)
    for c in plan.candidates:
        assert candidate_memo._decode(candidate_memo._encode(c)) == c
    memo = candidate_memo.CandidateMemo(config, spec, cluster)
    memo.path.write_text("{torn")
    assert memo.get(plan.candidates[0].strategy, 1, None) is None

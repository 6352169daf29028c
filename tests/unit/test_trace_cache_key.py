"""The trace cache key covers what a trace depends on; the live-bytes curve sums storages exactly."""
import dataclasses

import numpy as np
import pytest

from launcher import environment
from launcher import trace as tr
from launcher.steptrace import event_curve

CONFIG = tr.canonical_config_json({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                   "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256})
KEY = tr.TraceKey(CONFIG, 2, 1, 32)
LORA = dataclasses.replace(KEY, trainable="lora", lora_r=8, lora_alpha=16)


@pytest.fixture
def versions(monkeypatch):
    """Installed versions as the key sees them, replaceable by the test."""
    fake = {"torch": "2.13.0", "transformers": "5.23.0", "peft": "0.21.2"}
    monkeypatch.setattr(environment, "_VERSIONS", fake)
    monkeypatch.setattr(tr, "_KEY_HASHES", {})
    return fake


@pytest.mark.parametrize("dist", ["torch", "transformers"])
def test_key_changes_with_the_library_versions(versions, dist):
    before = tr.cache_key(KEY)
    versions[dist] = "99.0"
    tr._KEY_HASHES.clear()
    assert tr.cache_key(KEY) != before


def test_peft_version_keys_lora_traces_only(versions):
    full, lora = tr.cache_key(KEY), tr.cache_key(LORA)
    versions["peft"] = "99.0"
    tr._KEY_HASHES.clear()
    assert tr.cache_key(KEY) == full
    assert tr.cache_key(LORA) != lora


def test_key_changes_with_the_tracer_version(versions, monkeypatch):
    before = tr.cache_key(KEY)
    monkeypatch.setattr(tr, "_FORMAT_VERSION", tr._FORMAT_VERSION + 1)
    tr._KEY_HASHES.clear()
    assert tr.cache_key(KEY) != before


@pytest.mark.parametrize("field,value", [("seq_len", 64), ("micro_batch_size", 2), ("param_dtype", "bfloat16"),
                                         ("optimizer", "adamw_fused"), ("gradient_checkpointing", True),
                                         ("tp_size", 2), ("zero3_linear", True)])
def test_key_changes_with_the_workload(versions, field, value):
    assert tr.cache_key(dataclasses.replace(KEY, **{field: value})) != tr.cache_key(KEY)


def test_default_cache_dir_follows_xdg(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", "from launcher.environment import DEFAULT_CACHE_DIR; print(DEFAULT_CACHE_DIR)"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(out) == tmp_path / "launcher" / "traces"


def test_event_curve_by_hand():
    # storage 0: 10 B from event 0 to 2; storage 1: 5 B from event 1, alive at the end
    curve = event_curve(np.array([0, 1]), np.array([2, 4]), np.array([10, 5]), 4)
    assert curve.tolist() == [10, 15, 5, 5]


def test_event_curve_exact_for_huge_totals():
    big = 2**60  # beyond float64's exact integers: summed as integers
    curve = event_curve(np.array([0, 1]), np.array([2, 2]), np.array([big, 1]), 3)
    assert curve.tolist() == [big, big + 1, 0]

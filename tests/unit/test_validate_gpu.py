"""scripts/validate_gpu: every published row is either planned or waits for a named feature, and a
planned row's published value is read in the unit and scope its source uses."""
from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import validate_gpu  # noqa: E402


def test_every_published_row_is_accounted_for_once():
    ids = [r["id"] for r in csv.DictReader(validate_gpu.CSV.open())]
    assert len(ids) == 121 == len(set(ids))
    mapping = yaml.safe_load(validate_gpu.ROWS.read_text())
    planned = {spec.get("row", key) for key, spec in mapping["rows"].items()}
    waiting = [i for ids_ in mapping["waits_for"].values() for i in ids_]
    assert len(waiting) == len(set(waiting)) and not planned & set(waiting)
    assert planned | set(waiting) == set(ids)
    for key, spec in mapping["rows"].items():
        assert spec.get("view") in validate_gpu.VIEWS or spec.get("capacity") in ("fits", "oom"), key
        assert "capacity" in spec or spec["unit"] in validate_gpu.UNIT_BYTES, key


def test_published_values_in_bytes_per_gpu():
    row = {"memory_value": "12.6 + 10.9", "gpu_count": "2"}
    assert validate_gpu.published_bytes(row, {"unit": "GB"}) == 12.6e9  # the worse GPU
    row = {"memory_value": "139.2", "gpu_count": "2"}
    assert validate_gpu.published_bytes(row, {"unit": "GB", "scope": "total"}) == 69.6e9
    row = {"memory_value": "7.4", "gpu_count": "1"}
    assert validate_gpu.published_bytes(row, {"unit": "GiB"}) == 7.4 * 2**30


def test_a_serving_row_is_planned_and_compared():
    """A Qwen serving row through the real planner: weights alone are 1.84e9 x 2 bytes."""
    rows = {r["id"]: r for r in csv.DictReader(validate_gpu.CSV.open())}
    spec = yaml.safe_load(validate_gpu.ROWS.read_text())["rows"]["QWEN-INF-1.8B-BF16"]
    res = validate_gpu.evaluate("QWEN-INF-1.8B-BF16", spec, rows["QWEN-INF-1.8B-BF16"])
    assert not res.error
    assert res.published_bytes == pytest.approx(4.23 * 2**30)  # profile.py divides by 1024**3
    assert 2 * 1.83e9 < res.estimate_bytes < res.published_bytes * 1.2

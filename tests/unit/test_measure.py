"""mode=measure's arithmetic (launcher/measure.py): per-rank errors and the median step time."""
import json

import pytest

from launcher import measure


def test_memory_rows_per_rank_errors_and_cuda_fields():
    summary = {"measured_peak_allocated_bytes": [1000, 990], "measured_peak_phase": ["backward", "optimizer"],
               "measured_peak_breakdown": [{}, {"nvml_used": 5000}], "measured_peak_reserved_bytes": [None, 1200]}
    estimate = {"peak_allocated_bytes": 1010, "peak_reserved_bytes": 1100, "device_total_bytes": 4800}
    rows = measure.memory_rows(summary, estimate)
    assert [r["error_percent"] for r in rows] == pytest.approx([1.0, 100 * 20 / 990])
    assert "measured_reserved_bytes" not in rows[0]
    assert rows[1]["reserved_error_percent"] == pytest.approx(100 * (1100 - 1200) / 1200)
    assert rows[1]["device_total_error_percent"] == pytest.approx(100 * (4800 - 5000) / 5000)
    assert rows[1]["measured_peak_phase"] == "optimizer"


def test_median_step_time_leaves_out_warm_up(tmp_path):
    path = tmp_path / "metrics.jsonl"
    steps = [9.0, 5.0, 0.3, 0.1, 0.2, 0.4]
    path.write_text("".join(json.dumps({"step": i + 1, "step_s": s}) + "\n" for i, s in enumerate(steps)))
    med, all_steps = measure.median_step_s(path, warmup_steps=2)
    assert med == pytest.approx(0.25) and all_steps == steps


def test_error_percent_sign_and_unmeasured():
    assert measure.error_percent(110, 100) == pytest.approx(10.0)
    assert measure.error_percent(90, 100) == pytest.approx(-10.0)
    assert measure.error_percent(90, 0) is None

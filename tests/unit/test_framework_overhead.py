"""Measured framework overhead: the calibration fit (launcher/calibrate_frameworks.py) and the term
it adds to the step time (launcher/speed.py `framework_overhead_s`)."""
from dataclasses import replace

import pytest
import yaml

from launcher.calibrate_frameworks import add_to_profile, fit, residual
from launcher.speed import estimate_speed

from test_host_time import COUNTS, CPU, DDP, WL, Z

N = 1_000_000
FLOPS = {"forward": 1e9, "backward": 2e9}


def test_fit_recovers_a_line_through_the_points():
    # residual = 0.004 s per step + 0.0002 s per parameter tensor
    points = [(x, 0.004 + 0.0002 * x) for x in (13, 40, 67)]
    assert fit(points) == pytest.approx([0.004, 0.0002])


def test_fit_never_goes_negative():
    # a falling residual is noise: no per-tensor cost, the mean residual per step
    assert fit([(10, 0.006), (40, 0.004)]) == pytest.approx([0.005, 0.0])
    # a line through zero would need a negative intercept: through the origin instead
    got = fit([(10, 0.001), (40, 0.007)])
    assert got[0] == 0.0 and got[1] == pytest.approx((10 * 0.001 + 40 * 0.007) / (10 ** 2 + 40 ** 2))


def test_residual_is_measured_minus_modelled():
    measure = {"time": {"measured_step_s": 0.02, "estimated_step_s": 0.015,
                        "estimated_breakdown": {"num_param_tensors": 22.0}}}
    assert residual(measure) == pytest.approx((22.0, 0.005))


def test_profile_keeps_its_header_and_gains_the_overhead(tmp_path):
    path = tmp_path / "cpu-calibrated.yaml"
    path.write_text("# measured here\nname: cpu-calibrated\nop_overhead_s: 1.0e-05\n")
    add_to_profile(path, {"zero2": [0.008, 1e-5]})
    text = path.read_text()
    assert text.startswith("# measured here\n")
    assert yaml.safe_load(text) == {"name": "cpu-calibrated", "op_overhead_s": 1e-5,
                                    "framework_overhead_s": {"zero2": [0.008, 1e-5]}}


def test_step_time_adds_per_step_and_per_tensor_per_micro_batch_overhead():
    counts = replace(COUNTS, num_param_tensors=30)
    calibrated = replace(CPU, framework_overhead_s={"zero2": [0.01, 0.001]})
    for accum in (1, 3):
        base = estimate_speed(FLOPS, Z[2], WL, CPU, num_params=N, grad_accum_steps=accum, dp_size=2, counts=counts)
        got = estimate_speed(FLOPS, Z[2], WL, calibrated, num_params=N, grad_accum_steps=accum, dp_size=2,
                             counts=counts)
        assert got.step_s - base.step_s == pytest.approx(0.01 + 0.001 * 30 * accum)
        assert got.breakdown["framework_overhead_s"] == pytest.approx(0.01 + 0.001 * 30 * accum)
    # a strategy the profile has no number for gets none
    ddp = estimate_speed(FLOPS, DDP, WL, calibrated, num_params=N, grad_accum_steps=1, dp_size=2, counts=counts)
    assert ddp.breakdown["framework_overhead_s"] == 0.0

"""mode=calibrate: the profile it writes is a valid hardware profile that `hardware=<file>` loads,
and its measurements follow their definitions."""
import json

import pytest
import yaml

from launcher import calibrate
from launcher.cli import compose, translate_hardware

CONF_CPU = calibrate.Path(__file__).resolve().parents[2] / "conf" / "hardware" / "cpu.yaml"


def _results(ranks=2):
    return [{"peak_tflops": {"fp32": 0.05 + r, "bf16": 0.1, "fp16": 0.001}, "op_overhead_s": 1e-5 * (r + 1),
             "memory_bandwidth_gbps": 8.0 + r, "elementwise_gbps": 1.0 + r,
             "collectives": {"all_reduce_gbps": {1.0: 2.5, 16.0: 1.5 + r}, "all_gather_gbps": {1.0: 0.9, 64.0: 0.4},
                             "latency_s": 5e-5 * (r + 1)}} for r in range(ranks)]


def test_profile_takes_the_slowest_rank_and_keeps_the_base():
    base = yaml.safe_load(CONF_CPU.read_text())
    prof = calibrate.profile_from(base, _results(), "cpu", 2)
    assert prof["name"] == "cpu-calibrated"
    assert prof["peak_tflops"] == {"fp32": 0.05, "bf16": 0.1, "fp16": 0.001, "tf32": 0.05}
    assert prof["op_overhead_s"] == 2e-5 and prof["collective_latency_s"] == 1e-4
    assert prof["intra_node_bandwidth_gbps"] == 1.5  # largest size (16 MiB) of the slower rank
    assert prof["all_gather_bandwidth_gbps"] == 0.4
    assert prof["memory_bandwidth_gbps"] == 8.0 == prof["host_link_bandwidth_gbps"]
    assert prof["memory_bytes"] == base["memory_bytes"] and prof["device"] == "cpu"


def test_written_profile_is_usable_as_hardware_path(tmp_path):
    prof = calibrate.profile_from(yaml.safe_load(CONF_CPU.read_text()), _results(), "cpu", 2)
    path = tmp_path / "hardware" / f"{prof['name']}.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(prof))
    argv = translate_hardware(["model=tiny-llama", f"hardware={path}", "gpus=2"])
    assert f"hydra.searchpath=[file://{tmp_path}]" in argv and "hardware=cpu-calibrated" in argv
    config = compose(argv)
    assert config.hardware.name == "cpu-calibrated"
    assert config.hardware.op_overhead_s == pytest.approx(2e-5)
    assert config.hardware.peak_tflops["fp32"] == pytest.approx(0.05)


def test_profile_outside_a_hardware_dir_or_shadowing_a_name_is_copied(tmp_path):
    path = tmp_path / "cpu.yaml"  # same stem as the catalogue's cpu profile
    prof = yaml.safe_load(CONF_CPU.read_text())
    prof["memory_bytes"] = 12345678
    path.write_text(yaml.safe_dump(prof))
    argv = translate_hardware(["model=tiny-llama", f"hardware={path}"])
    assert "hardware=cpu-file" in argv
    assert compose(argv).hardware.memory_bytes == 12345678


def test_missing_profile_file_is_a_one_line_error(tmp_path):
    from launcher.errors import ConfigError

    with pytest.raises(ConfigError, match="no such file"):
        translate_hardware([f"hardware={tmp_path / 'nope.yaml'}"])


def test_timed_s_is_a_median_of_repeats():
    calls = []
    t = calibrate.timed_s(lambda: calls.append(1), 5)
    assert len(calls) == 6 and t >= 0  # one warm-up + 5 timed


def test_rates_follow_their_definitions(monkeypatch):
    """With every timing fixed at 1 ms: matmul 2 n^3 FLOPs; copy 2 x bytes; op overhead per
    forward + backward op; bus bandwidth with nccl-tests' factors (all-reduce 2(n-1)/n,
    all-gather (n-1)/n of the gathered size); collectives measured on a 1-rank gloo group."""
    import os

    import torch.distributed as dist

    monkeypatch.setattr(calibrate, "timed_s", lambda fn, repeats, sync=None: 1e-3)
    tflops = calibrate.matmul_tflops("cpu", [64, 128], 1, lambda: None)
    assert tflops["fp32"] == pytest.approx(2 * 128**3 / 1e-3 / 1e12)
    assert calibrate.memory_bandwidth_gbps("cpu", 1, None, num_bytes=4 * 2**20) == pytest.approx(8 * 2**20 / 1e-3 / 1e9)
    assert calibrate.op_overhead_s("cpu", 1, None, num_ops=10) == pytest.approx(1e-3 / 20)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        out = calibrate.collectives("cpu", [1.0], 1, lambda: None)
    finally:
        dist.destroy_process_group()
    assert out["all_reduce_gbps"][1.0] == 0.0 and out["all_gather_gbps"][1.0] == 0.0  # n = 1: nothing moves
    assert out["latency_s"] == 1e-3


@pytest.mark.integration
def test_calibrate_cli_writes_a_profile_that_plans(cli):
    r = cli("mode=calibrate", "hardware=cpu", "gpus=2", "calibrate.matmul_sizes=[128]",
            "calibrate.collective_mib=[0.25]", "calibrate.repeats=2", timeout=300)
    assert r.returncode == 0, r.stderr
    path = next(cli.cwd.glob("runs/*/*/hardware/cpu-calibrated.yaml"))
    raw = json.loads((path.parent.parent / "calibration.json").read_text())
    assert len(raw["ranks"]) == 2
    prof = yaml.safe_load(path.read_text())
    assert prof["op_overhead_s"] > 0 and prof["intra_node_bandwidth_gbps"] > 0
    assert all(prof["peak_tflops"][k] > 0 for k in ("fp32", "bf16", "fp16"))
    r = cli("model=tiny-llama", f"hardware={path}", "gpus=2", "mode=plan", "report=json",
            "strategy=ddp", "training.micro_batch_size=1", "training.seq_len=32")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout[r.stdout.index("{"):])["hardware"] == "cpu-calibrated"

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
             "attention_tflops": {"fp32": 0.02 + r, "bf16": 0.01 + r},
             "memory_bandwidth_gbps": 8.0 + r, "elementwise_gelems_per_s": 0.25 + r,

             "collectives": {"collective_gbps": {"all_reduce_fp32": {1.0: 2.5, 16.0: 1.5 + r},
                                                 "all_gather_fp32": {1.0: 0.9, 16.0: 0.4},
                                                 "all_reduce_bf16": {1.0: 1.0 + r, 16.0: 0.8},
                                                 "all_gather_bf16": {1.0: 0.3, 16.0: 0.2 + r}},
                             "latency_s": 5e-5 * (r + 1)}} for r in range(ranks)]


def test_profile_takes_the_slowest_rank_and_keeps_the_base():
    base = yaml.safe_load(CONF_CPU.read_text())
    prof = calibrate.profile_from(base, _results(), "cpu", 2)
    assert prof["name"] == "cpu-calibrated"
    assert prof["peak_tflops"] == {"fp32": 0.05, "bf16": 0.1, "fp16": 0.001, "tf32": 0.05}
    assert prof["op_overhead_s"] == 2e-5 and prof["collective_latency_s"] == 1e-4
    assert prof["attention_tflops"] == {"fp32": 0.02, "bf16": 0.01}
    assert prof["intra_node_bandwidth_gbps"] == 1.5  # largest size (16 MiB) of the slower rank
    assert prof["all_gather_bandwidth_gbps"] == 0.4
    # the whole table, per collective, dtype and size, of the slower rank
    assert prof["collective_gbps"] == {"all_reduce_fp32": {1.0: 2.5, 16.0: 1.5}, "all_gather_fp32": {1.0: 0.9, 16.0: 0.4},
                                       "all_reduce_bf16": {1.0: 1.0, 16.0: 0.8}, "all_gather_bf16": {1.0: 0.3, 16.0: 0.2}}
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
    # causal sdpa forward 4 b h s^2 d FLOPs, backward 2.5x that (torch.utils.flop_counter), in 1 ms
    b, h, s, d = 1, 2, 32, 8
    assert calibrate.attention_tflops("cpu", 1, None, shape=(b, h, s, d)) == pytest.approx(
        {"fp32": 3.5 * 4 * b * h * s * s * d / 1e-3 / 1e12, "bf16": 3.5 * 4 * b * h * s * s * d / 1e-3 / 1e12})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        out = calibrate.collectives("cpu", [1.0], 1, lambda: None)
    finally:
        dist.destroy_process_group()
    assert set(out["collective_gbps"]) == {f"{c}_{d}" for c in ("all_reduce", "all_gather", "reduce_scatter") for d in ("fp32", "bf16")}
    assert all(by_size == {1.0: 0.0} for by_size in out["collective_gbps"].values())  # n = 1: nothing moves
    assert out["latency_s"] == pytest.approx(1e-3 / calibrate.BATCH)  # a timed batch of BATCH calls took 1 ms


def test_collective_timings_are_the_mean_call_over_cold_tensors(monkeypatch):
    """A timing runs a batch of calls and divides by their number; the calls cycle through
    distinct tensors that together exceed the caches, as a step's gradient buckets do."""
    import torch

    calls = []
    monkeypatch.setattr(calibrate, "timed_s", lambda fn, repeats, sync=None: (fn(), 0.8)[1])
    assert calibrate.batched_s(lambda: calls.append(1), 4, 3) == pytest.approx(0.2)
    assert len(calls) == 4
    tensors = calibrate._cold_tensors(2**18, torch.float32, "cpu")  # 1 MiB each
    assert len(tensors) == calibrate.COLD_BYTES // 2**20 and len({t.data_ptr() for t in tensors}) == len(tensors)
    assert len(calibrate._cold_tensors(2**24, torch.float32, "cpu")) == 2  # 64 MiB: at least two


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


def test_collective_bandwidth_leaves_out_the_per_call_latency():
    assert calibrate.alpha_beta_gbps(1e9, 1.1, 0.1) == pytest.approx(1.0)
    assert calibrate.alpha_beta_gbps(1e6, 1e-4, 2e-4) == pytest.approx(1e6 / 1e-6 / 1e9)  # within the noise


def test_a_cpu_profile_from_another_cpu_model_is_noted():
    from launcher.config import HardwareConfig

    here = calibrate.cpu_model()
    other = HardwareConfig(name="cpu", memory_bytes=1, device="cpu", calibrated_on="Some Other CPU")
    note = calibrate.other_machine_note(other)
    assert "Some Other CPU" in note and here in note and "mode=calibrate" in note
    assert calibrate.other_machine_note(HardwareConfig(name="cpu", memory_bytes=1, device="cpu",
                                                       calibrated_on=here)) is None
    assert calibrate.other_machine_note(HardwareConfig(name="a100", memory_bytes=1, calibrated_on="x")) is None
    # a profile written by mode=calibrate names this machine
    prof = calibrate.profile_from(yaml.safe_load(CONF_CPU.read_text()), _results(), "cpu", 2)
    assert prof["calibrated_on"] == here


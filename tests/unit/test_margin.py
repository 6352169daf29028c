"""The planner's memory margin on GPUs comes from the estimate's errors on published measurements."""
from __future__ import annotations

import json

import pytest

from launcher import margin


def test_nearest_rank_quantile():
    values = tuple(i / 10 for i in range(10))  # 0.0 .. 0.9
    assert margin.quantile(values, 0.9) == 0.8  # 9 of the 10 values are at or below 0.8
    assert margin.quantile(values, 1.0) == 0.9
    assert margin.quantile((0.3,), 0.9) == 0.3


def test_margin_by_device_and_user_choice():
    assert margin.resolve(0.12, "cuda") == 0.12
    assert margin.resolve(0.0, "cuda") == 0.0
    assert margin.resolve(None, "cpu") == margin.CPU_MARGIN
    rows = json.loads(margin.ERRORS_FILE.read_text())["rows"]
    under = sorted(max(0.0, -r["error_percent"] / 100) for r in rows)
    assert len(under) >= 10
    gpu = margin.resolve(None, "cuda")
    assert sum(u <= gpu for u in under) >= 0.9 * len(under)  # covers 9 in 10 published rows
    assert sum(u < gpu for u in under) < 0.9 * len(under) + 1  # and is no larger than needed


def test_confidence_note_counts_rows_the_headroom_covers():
    under = margin.underestimates()
    note = margin.confidence_note(needed=50, capacity=100)  # 50% headroom
    assert f"{sum(u < 0.5 for u in under)} of {len(under)} published measurements" in note
    assert note.startswith("headroom 50% of the GPU")


def test_gpu_plan_states_how_sure_fits_is(cli):
    r = cli("model=tiny-llama", "gpus=1", "hardware=a100-80g", "strategy=single", "training.seq_len=128",
            "training.micro_batch_size=1", "mode=plan")
    assert r.returncode == 0, r.stderr
    (run_dir,) = (cli.cwd / "runs").glob("*/*")
    notes = json.loads((run_dir / "plan.json").read_text())["notes"]
    assert any("published measurements (docs/accuracy.md) were underestimated by less" in n for n in notes)


@pytest.mark.parametrize("value", ["1.5", "-0.1"])
def test_margin_out_of_range_is_one_line(cli, value):
    r = cli("model=tiny-llama", "gpus=1", f"planner.safety_margin={value}")
    assert r.returncode == 2 and "planner.safety_margin" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("conf,on", [(None, False), ("", False), ("expandable_segments:True", True),
                                     ("max_split_size_mb:128,expandable_segments:True", True),
                                     ("expandable_segments:True,expandable_segments:False", False),
                                     ("expandable_segments:true", False)])
def test_expandable_segments_read_as_torch_parses_the_allocator_config(conf, on):
    from launcher.hardware import expandable_segments

    assert expandable_segments(conf) is on


def test_plan_models_the_environment_s_expandable_segments(cli, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    r = cli("model=tiny-llama", "gpus=1", "hardware=a100-80g", "strategy=single", "training.seq_len=128",
            "training.micro_batch_size=1", "mode=plan")
    assert r.returncode == 0, r.stderr
    (run_dir,) = (cli.cwd / "runs").glob("*/*")
    chosen = json.loads((run_dir / "plan.json").read_text())["candidates"][0]["memory"]
    assert any("expandable_segments:True" in n for n in chosen["notes"])


def test_plan_models_the_environment_s_nccl_settings(cli, monkeypatch):
    """The job inherits the planner's NCCL_* variables: the plan's NCCL buffers follow them and its
    notes say so (runtime.py nccl_env)."""
    def nccl_note(**env):
        for key in ("NCCL_MAX_NCHANNELS", "NCCL_CUMEM_ENABLE"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        r = cli("model=tiny-llama", "gpus=2", "hardware=a100-80g", "strategy=ddp", "training.seq_len=128",
                "training.micro_batch_size=1", "mode=plan", "hardware.nccl_version=2.18.1")
        assert r.returncode == 0, r.stderr
        run_dir = max((cli.cwd / "runs").glob("*/*"), key=lambda p: p.stat().st_mtime_ns)
        notes = json.loads((run_dir / "plan.json").read_text())["candidates"][0]["memory"]["notes"]
        return next(n for n in notes if n.startswith("NCCL:"))

    assert "544 MiB outside the allocator (NCCL 2.18.1, 24 channels over nvlink" in nccl_note()
    note = nccl_note(NCCL_MAX_NCHANNELS="8")
    assert "160 MiB outside the allocator" in note and "NCCL_MAX_NCHANNELS (8)" in note

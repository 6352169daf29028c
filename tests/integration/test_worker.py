"""Real 2-process CPU training runs of the worker (torchrun + gloo) on a tiny Llama."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.runspec import RunSpec
from launcher.worker import checkpoint

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=320, max_position_embeddings=512)
NUM_STEPS = 20
MICRO_BATCH = 2
WORLD = 2


def ds_config(stage: int, bf16: bool = False, grad_accum: int = 1) -> dict:
    """Small buckets: DeepSpeed's defaults (5e8 elements) would allocate ~2 GiB per rank."""
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": MICRO_BATCH * grad_accum * WORLD,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16},
        "zero_optimization": {
            "stage": stage, "reduce_bucket_size": 500_000, "allgather_bucket_size": 500_000,
            "stage3_prefetch_bucket_size": 500_000, "stage3_param_persistence_threshold": 1_000,
            "stage3_max_live_parameters": 1_000_000, "stage3_max_reuse_distance": 1_000_000,
        },
    }


def write_spec(run_dir: Path, backend: str = "ddp", **overrides) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    values = dict(run_dir=str(run_dir), backend=backend, strategy=backend, model_name="tiny-llama",
                  hf_config=dict(TINY_LLAMA), seq_len=64, micro_batch_size=MICRO_BATCH,
                  max_steps=NUM_STEPS, learning_rate=3e-3, seed=1234)
    values.update(overrides)
    path = run_dir / "run.json"
    RunSpec(**values).save(path)
    return path


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    return env


def torchrun(spec_path: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
            "-m", "launcher.worker", str(spec_path)]
    return subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout_s)


def single_process(spec_path: Path) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "launcher.worker", str(spec_path)]
    return subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tiny_param_bytes_fp32() -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(TINY_LLAMA)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))
    return sum(p.numel() * 4 for p in model.parameters())


def assert_trained(run_dir: Path, result: subprocess.CompletedProcess, num_steps: int = NUM_STEPS) -> list[dict]:
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, num_steps + 1))
    losses = [r["loss"] for r in records]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, losses  # byte-level loss starts near ln(320) = 5.77
    param_bytes = tiny_param_bytes_fp32()
    for r in records:
        assert len(r["peak_allocated_bytes"]) == WORLD
        # every rank holds at least a full fp32 copy of the weights at some point of the step
        # (ZeRO-3 gathers them for the forward), plus activations
        assert all(b > param_bytes for b in r["peak_allocated_bytes"]), (r, param_bytes)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == num_steps and len(summary["measured_peak_allocated_bytes"]) == WORLD
    final = run_dir / "checkpoints" / f"step-{num_steps}"
    assert checkpoint.verify(final) is None
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    return records


# fp32 runs of every strategy go through the launcher in test_launch_runs.py; these cover the
# worker's mixed-precision paths directly.
CASES = {
    "ddp-bf16-mixed": dict(backend="ddp", precision="bf16-mixed"),
    "zero2-bf16": dict(backend="deepspeed", precision="bf16-mixed", framework_config=ds_config(2, bf16=True)),
}
_LOSSES: dict[str, list[float]] = {}


@pytest.mark.parametrize("case", list(CASES))
def test_trains_and_reports(case: str, tmp_path: Path) -> None:
    result = torchrun(write_spec(tmp_path, **CASES[case]))
    records = assert_trained(tmp_path, result)
    _LOSSES[case] = [r["loss"] for r in records]
    peaks = records[-1]["peak_allocated_bytes"]
    print(f"{case}: peak_allocated_bytes per rank {peaks}")


def test_grad_accumulation_matches_larger_micro_batch(tmp_path: Path) -> None:
    """2 micro-batches of 1 per step read the same samples as 1 micro-batch of 2, and the mean of
    per-micro-batch mean losses over equal-length sequences equals the mean over the batch."""
    accum = torchrun(write_spec(tmp_path / "accum", micro_batch_size=1, grad_accum_steps=2, max_steps=6))
    whole = torchrun(write_spec(tmp_path / "whole", micro_batch_size=2, max_steps=6))
    assert accum.returncode == 0 and whole.returncode == 0, accum.stderr[-2000:] + whole.stderr[-2000:]
    a, w = read_metrics(tmp_path / "accum"), read_metrics(tmp_path / "whole")
    assert [sorted(sum(r["block_ids"], [])) for r in a] == [sorted(sum(r["block_ids"], [])) for r in w]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in w], abs=1e-3)


@pytest.mark.long  # the default suite resumes DDP in test_resume_backends.py (identical losses, corrupt latest)
def test_resume_continues_exactly(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    assert torchrun(write_spec(straight, max_steps=15)).returncode == 0
    run = tmp_path / "run"
    first = torchrun(write_spec(run, max_steps=10, checkpoint_every=5, checkpoint_keep=2))
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-10", "step-5"]
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)

    resumed = torchrun(write_spec(run, max_steps=15, checkpoint_every=5, resume=True))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records, reference = read_metrics(run), read_metrics(straight)
    assert [r["step"] for r in records] == list(range(1, 16))
    for r in records:  # each step reads the next 4 sample positions: none skipped or repeated
        assert r["data_positions"] == [(r["step"] - 1) * 4, r["step"] * 4]
    assert [r["block_ids"] for r in records] == [r["block_ids"] for r in reference]
    # model, optimizer, scheduler and RNG restored: the same losses as the uninterrupted run
    assert [r["loss"] for r in records[10:]] == pytest.approx([r["loss"] for r in reference[10:]], abs=1e-5)

    model_file = broken / "checkpoints" / "step-10" / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:1000])  # truncated
    fallback = torchrun(write_spec(broken, max_steps=15, resume=True))
    assert fallback.returncode == 0, fallback.stderr[-3000:]
    assert "warning: skipping corrupt checkpoint" in fallback.stderr and "step-10" in fallback.stderr
    steps = [r["step"] for r in read_metrics(broken)]
    assert steps == list(range(1, 11)) + list(range(6, 16))
    assert [r["loss"] for r in read_metrics(broken)[10:]] == pytest.approx(
        [r["loss"] for r in reference[5:]], abs=1e-5)


@pytest.mark.long  # ZeRO-3's resume is also killed_while_saving_resumes_identically[zero3]
def test_deepspeed_resume(tmp_path: Path) -> None:
    spec = dict(backend="deepspeed", framework_config=ds_config(3), checkpoint_every=4)
    straight = tmp_path / "straight"
    assert torchrun(write_spec(straight, max_steps=8, **spec)).returncode == 0
    run = tmp_path / "run"
    assert torchrun(write_spec(run, max_steps=4, **spec)).returncode == 0
    resumed = torchrun(write_spec(run, max_steps=8, resume=True, **spec))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in read_metrics(straight)], abs=1e-5)


ERRORS = {
    "missing-dataset": (dict(data_path="/nonexistent/corpus.txt"), "dataset /nonexistent/corpus.txt does not exist"),
    "seq-len-over-positions": (dict(seq_len=1024), "seq_len=1024 is larger than the model's maximum of 512"),
    "tokenizer-mismatch": (dict(hf_config=dict(TINY_LLAMA, vocab_size=200)),
                           "tokenizer vocabulary (259 ids) is larger than the model's vocab_size=200"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_is_one_line(case: str, tmp_path: Path) -> None:
    overrides, message = ERRORS[case]
    result = single_process(write_spec(tmp_path, **overrides))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_bad_input_under_torchrun_reported_once(tmp_path: Path) -> None:
    result = torchrun(write_spec(tmp_path, data_path=str(tmp_path / "missing.txt")))
    assert result.returncode != 0
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and "missing.txt does not exist" in error_lines[0]
    assert "exitcode  : 2" in result.stderr

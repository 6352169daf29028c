"""Kill-and-resume on every backend that runs on CPU, on real 2-process runs (torchrun + gloo):
the last rank is SIGKILLed in the middle of writing a checkpoint, torchrun restarts the ranks,
and they continue from the previous complete checkpoint. The steps done again after the
restart must repeat the first run's steps exactly: same batches, same losses. Also: a full disk
while saving, a corrupt latest checkpoint, and a checkpoint moved between layouts
(DDP -> ZeRO-3 -> ColossalAI tensor parallel), as the out-of-memory fallback does."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from launcher.environment import SHARDFORMER, detect
from launcher.launch import worker_python
from launcher.runspec import RunSpec
from launcher.worker import checkpoint

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=320, max_position_embeddings=512)
ZERO = {"reduce_bucket_size": 200_000, "allgather_bucket_size": 200_000, "stage3_prefetch_bucket_size": 200_000,
        "stage3_param_persistence_threshold": 1_000}
LOW_LEVEL_ZERO = {"precision": "fp32", "overlap_communication": False}
FRAMEWORK = {
    "ddp": ("ddp", {}),
    "zero1": ("deepspeed", {"zero_optimization": {"stage": 1, **ZERO}}),
    "zero2": ("deepspeed", {"zero_optimization": {"stage": 2, **ZERO}}),
    "zero3": ("deepspeed", {"zero_optimization": {"stage": 3, **ZERO}}),
    "cai_ddp": ("colossalai", {"plugin": "TorchDDPPlugin", "kwargs": {}}),
    "cai_zero1": ("colossalai", {"plugin": "LowLevelZeroPlugin", "kwargs": {"stage": 1, **LOW_LEVEL_ZERO}}),
    "cai_zero2": ("colossalai", {"plugin": "LowLevelZeroPlugin", "kwargs": {"stage": 2, **LOW_LEVEL_ZERO}}),
    "cai_tp": ("colossalai", {"plugin": "HybridParallelPlugin",
                              "kwargs": {"tp_size": 2, "pp_size": 1, "precision": "fp32",
                                         "make_vocab_size_divisible_by": 32}}),
}
NO_COLOSSALAI = importlib.util.find_spec("colossalai") is None
NO_SHARDFORMER = SHARDFORMER not in detect().installed  # cai_tp runs in the ColossalAI environment
STEPS, EVERY, KILL_AT = 5, 2, 4


def write_spec(run_dir: Path, strategy: str, **overrides) -> Path:
    backend, framework = FRAMEWORK[strategy]
    run_dir.mkdir(parents=True, exist_ok=True)
    values = dict(run_dir=str(run_dir), backend=backend, strategy=strategy, model_name="tiny-llama",
                  hf_config=dict(TINY_LLAMA), seq_len=32, micro_batch_size=2, max_steps=STEPS,
                  learning_rate=3e-3, seed=1234, framework_config=framework, checkpoint_every=EVERY)
    values.update(overrides)
    path = run_dir / "run.json"
    RunSpec(**values).save(path)
    return path


def torchrun(run_json: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
    spec = RunSpec.load(run_json)
    argv = [worker_python(spec.backend, spec.strategy), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *extra,
            "-m", "launcher.worker", str(run_json)]
    return subprocess.run(argv, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=300)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_redone_steps_repeat(recs: list[dict], resumed_at: int) -> list[dict]:
    """Records after the restart start at `resumed_at + 1`; those of steps logged before the
    restart too must equal them (an uninterrupted run's steps, step for step)."""
    restart = next(i for i in range(1, len(recs)) if recs[i]["step"] <= recs[i - 1]["step"])
    first, second = recs[:restart], recs[restart:]
    assert second[0]["step"] == resumed_at + 1, [r["step"] for r in recs]
    assert [r["step"] for r in second] == list(range(resumed_at + 1, STEPS + 1))
    before = {r["step"]: r for r in first}
    redone = [r for r in second if r["step"] in before]
    assert len(redone) >= 1
    for r in redone:
        old = before[r["step"]]
        assert (r["data_positions"], r["block_ids"]) == (old["data_positions"], old["block_ids"])
        assert r["loss"] == pytest.approx(old["loss"], abs=1e-6), (r["step"], r["loss"], old["loss"])
    return redone


# the default suite resumes one layout per checkpoint path (torch, DeepSpeed ZeRO-3, ColossalAI's
# LowLevelZero and HybridParallel); the other stages and plugins run under `-m long`
LONG_RESUMES = ("zero1", "zero2", "cai_ddp", "cai_zero1")


@pytest.mark.parametrize("strategy", [pytest.param(s, marks=pytest.mark.long) if s in LONG_RESUMES else s
                                      for s in FRAMEWORK])
def test_killed_while_saving_resumes_identically(tmp_path: Path, strategy: str) -> None:
    if strategy.startswith("cai_") and NO_COLOSSALAI:
        pytest.skip("ColossalAI is not installed (optional: scripts/setup installs it unless LAUNCHER_SKIP_COLOSSALAI=1)")
    if strategy == "cai_tp" and NO_SHARDFORMER:
        pytest.skip("no ColossalAI environment (.venv-colossalai; scripts/setup builds it)")
    run_json = write_spec(tmp_path / "run", strategy)
    result = torchrun(run_json, "--max-restarts=1", env={checkpoint.KILL_IN_SAVE_ENV: str(KILL_AT)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exitcode  : -9" in result.stderr or "exitcode: -9" in result.stderr  # the SIGKILL did happen
    run_dir = tmp_path / "run"
    previous = run_dir / "checkpoints" / f"step-{KILL_AT - EVERY}"
    assert f"resumed from {previous} at step {KILL_AT - EVERY}" in result.stdout
    redone = assert_redone_steps_repeat(records(run_dir), KILL_AT - EVERY)
    assert [r["step"] for r in redone] == list(range(KILL_AT - EVERY + 1, KILL_AT + 1))
    ckpts = run_dir / "checkpoints"
    assert not list(ckpts.glob(".tmp-*")) and not list(ckpts.glob(".old-*"))
    assert checkpoint.verify(ckpts / f"step-{STEPS}") is None
    assert json.loads((ckpts / f"step-{STEPS}" / checkpoint.LAYOUT_FILE).read_text())["strategy"] == strategy


def test_corrupt_latest_is_skipped_and_a_full_disk_keeps_the_previous(tmp_path: Path) -> None:
    """A corrupt latest checkpoint (one byte flipped, same size) is skipped for the one before;
    then a full disk while saving is one error line and the previous checkpoint stays intact."""
    run = tmp_path / "run"
    assert torchrun(write_spec(run, "ddp", max_steps=KILL_AT, checkpoint_keep=0)).returncode == 0
    latest = run / "checkpoints" / f"step-{KILL_AT}" / "optimizer.pt"
    data = bytearray(latest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    latest.write_bytes(bytes(data))

    last = KILL_AT + EVERY
    full = torchrun(write_spec(run, "ddp", max_steps=last, resume=True, checkpoint_keep=0),
                    env={checkpoint.DISK_FULL_ENV: str(last)})
    assert full.returncode != 0
    assert f"skipping corrupt checkpoint {latest.parent}: optimizer.pt does not match its CRC-32" in full.stderr
    assert f"resumed from {run / 'checkpoints' / f'step-{KILL_AT - EVERY}'} at step {KILL_AT - EVERY}" in full.stdout
    recs = records(run)
    restart = next(i for i in range(1, len(recs)) if recs[i]["step"] <= recs[i - 1]["step"])
    assert [r["step"] for r in recs[restart:]] == list(range(KILL_AT - EVERY + 1, last + 1))
    before = {r["step"]: r for r in recs[:restart]}
    for r in recs[restart:]:
        if r["step"] in before:  # the steps done again repeat the first run's exactly
            assert r["block_ids"] == before[r["step"]]["block_ids"]
            assert r["loss"] == pytest.approx(before[r["step"]]["loss"], abs=1e-6)
    errors = [ln for ln in full.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, full.stderr[-3000:]
    assert f"writing checkpoint step-{last}" in errors[0] and f"step-{KILL_AT} is intact" in errors[0]
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step-{KILL_AT - EVERY}", f"step-{KILL_AT}"]
    assert all(checkpoint.verify(p) is None for p in ckpts.iterdir())  # the corrupt one was replaced


@pytest.mark.skipif(NO_COLOSSALAI or NO_SHARDFORMER, reason="ColossalAI or its environment is not installed")
def test_checkpoint_moves_between_layouts(tmp_path: Path) -> None:
    """DDP steps 1-2, ZeRO-3 steps 3-4 from DDP's checkpoint, ColossalAI tensor parallel step 5
    from ZeRO-3's (converted with DeepSpeed's zero_to_fp32 and universal checkpoint): the
    losses follow an uninterrupted DDP run (exactly while the arithmetic is the same, DDP and
    ZeRO-3 in fp32; tensor parallelism sums in another order)."""
    from launcher import fallback_resume

    first = tmp_path / "ddp"  # uninterrupted, its checkpoint of step 2 starts the chain
    assert torchrun(write_spec(first, "ddp", checkpoint_keep=0)).returncode == 0
    expected = [r["loss"] for r in records(first)]
    second_json = write_spec(tmp_path / "zero3", "zero3", max_steps=4)
    info = fallback_resume.continue_from(second_json, first / "checkpoints" / "step-2", world_size=2)
    assert info["read_from"] == str(first / "checkpoints" / "step-2")  # DDP's files are the neutral form
    assert torchrun(second_json).returncode == 0
    third_json = write_spec(tmp_path / "cai_tp", "cai_tp")
    info = fallback_resume.continue_from(third_json, tmp_path / "zero3" / "checkpoints" / "step-4", world_size=2)
    assert info["read_from"].endswith("resume-from-step-4")
    result = torchrun(third_json)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(layout zero3 -> cai_tp)" in result.stdout

    losses = [r["loss"] for r in records(first)[:2] + records(tmp_path / "zero3") + records(tmp_path / "cai_tp")]
    assert [r["step"] for r in records(tmp_path / "zero3")] == [3, 4]
    assert losses[:4] == pytest.approx(expected[:4], abs=1e-6)
    assert losses[4] == pytest.approx(expected[4], abs=0.05)


@pytest.mark.long
def test_lora_checkpoint_moves_from_zero3_to_ddp(tmp_path: Path) -> None:
    """A LoRA run's ZeRO-3 checkpoint (frozen base partitioned, adapters trained) continued by DDP,
    as the out-of-memory fallback does: steps 3-5 repeat an uninterrupted DDP LoRA run's losses
    (fp32 on both sides: the same arithmetic), so the trained adapters and their optimizer state
    came back from DeepSpeed's partitions and universal checkpoint. (The frozen base is rebuilt
    the same from the seed either way; this does not tell a loaded base from a rebuilt one.)"""
    from launcher import fallback_resume
    from launcher.peft import LoraSettings

    peft = LoraSettings(r=8, alpha=16, dropout=0.0).to_dict()
    whole = tmp_path / "ddp"
    assert torchrun(write_spec(whole, "ddp", peft=peft, checkpoint_keep=0)).returncode == 0
    zero3 = tmp_path / "zero3"
    assert torchrun(write_spec(zero3, "zero3", peft=peft, max_steps=2)).returncode == 0
    ddp_json = write_spec(tmp_path / "ddp-after", "ddp", peft=peft)
    info = fallback_resume.continue_from(ddp_json, zero3 / "checkpoints" / "step-2", world_size=2)
    assert info["layout"] == "zero3" and info["optimizer_state"] == "restored"
    result = torchrun(ddp_json)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(layout zero3 -> ddp)" in result.stdout
    after = records(tmp_path / "ddp-after")
    assert [r["step"] for r in after] == [3, 4, 5]
    assert [r["loss"] for r in records(zero3) + after] == pytest.approx([r["loss"] for r in records(whole)], abs=1e-6)

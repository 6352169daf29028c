"""FSDP1 kill-and-resume on a real 2-process CPU run (torchrun + gloo), as
test_fsdp2_resume.py does for FSDP2: the last rank is SIGKILLed while writing the sharded
torch.distributed.checkpoint of step 4, torchrun restarts both ranks, they resume from step 2 and
the steps done again repeat the first run's batches and losses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.backends.fsdp1.emit import plan_config
from launcher.backends.fsdp1.rules import STRATEGIES
from launcher.runspec import RunSpec
from launcher.worker import checkpoint
from tests.integration.test_resume_backends import (EVERY, KILL_AT, STEPS, TINY_LLAMA, assert_redone_steps_repeat,
                                                    records, torchrun)

pytestmark = pytest.mark.integration


def test_fsdp1_killed_while_saving_resumes_identically(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    RunSpec(run_dir=str(run_dir), backend="fsdp1", strategy="fsdp1", model_name="tiny-llama",
            hf_config=dict(TINY_LLAMA), seq_len=32, micro_batch_size=2, max_steps=STEPS, learning_rate=3e-3,
            seed=1234, precision="bf16-mixed", checkpoint_every=EVERY,
            framework_config=plan_config(STRATEGIES["fsdp1"], "bf16-mixed", 2)).save(run_dir / "run.json")
    result = torchrun(run_dir / "run.json", "--max-restarts=1", env={checkpoint.KILL_IN_SAVE_ENV: str(KILL_AT)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exitcode  : -9" in result.stderr or "exitcode: -9" in result.stderr
    previous = run_dir / "checkpoints" / f"step-{KILL_AT - EVERY}"
    assert f"resumed from {previous} at step {KILL_AT - EVERY}" in result.stdout
    redone = assert_redone_steps_repeat(records(run_dir), KILL_AT - EVERY)
    assert [r["step"] for r in redone] == list(range(KILL_AT - EVERY + 1, KILL_AT + 1))
    final = run_dir / "checkpoints" / f"step-{STEPS}"
    assert checkpoint.verify(final) is None
    assert sorted(p.name for p in (final / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert json.loads((final / checkpoint.LAYOUT_FILE).read_text())["strategy"] == "fsdp1"

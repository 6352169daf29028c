"""Out-of-memory fallback choice, `resume=<run dir>` validation and the safety of generated
commands, without training (fabricated run directories)."""
from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from launcher import cli, fallback
from launcher.errors import ConfigError
from launcher.types import Candidate, MemoryEstimate, Plan, SpeedEstimate, Strategy
from launcher.worker import checkpoint

OVERRIDES = ["model=tiny-llama", "hardware=cpu", "gpus=2", "training.seq_len=64", "training.max_steps=6",
             "strategy=ddp", "training.micro_batch_size=2"]


def candidate(name: str, total_bytes: int, fits: bool = True) -> Candidate:
    mem = MemoryEstimate(total_bytes, total_bytes, total_bytes, 0, {}, "backward")
    return Candidate(Strategy(name, "ddp"), 1, 1, mem, SpeedEstimate(1.0, 0.0, 1.0, 1.0), fits, "")


def test_next_candidate_is_next_ranked_fitting_with_less_memory():
    plan = Plan({}, "cpu", 2, 1, (candidate("a", 100), candidate("b", 120), candidate("c", 90, fits=False),
                                  candidate("d", 80), candidate("e", 50)), chosen=0)
    assert fallback.next_candidate(plan, 0, {0}) == 3  # b needs more, c does not fit
    assert fallback.next_candidate(plan, 3, {0, 3}) == 4
    assert fallback.next_candidate(plan, 4, {0, 3, 4}) is None


def fake_run(run_dir: Path, checkpoint_step: int = 3) -> Path:
    """A run directory as the launcher leaves it: overrides, run.json, one complete checkpoint."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in OVERRIDES))
    (run_dir / "run.json").write_text("{}")
    (run_dir / "plan.json").write_text("{}")
    ckpt = run_dir / "checkpoints" / f"step-{checkpoint_step}"
    ckpt.mkdir(parents=True)
    (ckpt / "model.pt").write_bytes(b"x" * 2000)
    (ckpt / "trainer.json").write_text(json.dumps({"step": checkpoint_step, "data_position": 12, "world_size": 2}))
    checkpoint.write_marker(ckpt, checkpoint_step)
    return run_dir


def test_resume_reuses_the_runs_overrides_and_writes_under_new_names(tmp_path):
    run = fake_run(tmp_path / "a run")
    argv = cli.prepare_argv([f"resume={run}", "training.max_steps=9"])
    assert argv[:len(OVERRIDES) - 1] == [o for o in OVERRIDES if not o.startswith("training.max_steps")]
    assert "training.max_steps=9" in argv and "hydra.output_subdir=.hydra-resume-1" in argv
    assert f"hydra.run.dir='{run}'" in argv  # quoted for Hydra: the path has a space


@pytest.mark.parametrize("extra,fragment", [
    (["training.seq_len=128"], "training.seq_len was 64 in that run"),
    (["training.max_steps=3"], "already training.max_steps=3"),
    (["strategy=zero2"], "strategy was 'ddp' in that run, not 'zero2'"),  # the values, not the enums' reprs
])
def test_resume_refuses_a_changed_plan_or_a_finished_run(tmp_path, extra, fragment):
    run = fake_run(tmp_path / "run")
    with pytest.raises(ConfigError, match=fragment):
        cli.prepare_argv([f"resume={run}", *extra])


def test_resume_from_truncated_checkpoint_is_refused(tmp_path):
    run = fake_run(tmp_path / "run")
    (run / "checkpoints" / "step-3" / "model.pt").write_bytes(b"x" * 10)
    with pytest.raises(ConfigError, match=r"no complete checkpoint .*model.pt has 10 bytes, expected 2000"):
        cli.prepare_argv([f"resume={run}"])


def test_resume_of_a_directory_that_is_no_run(tmp_path):
    with pytest.raises(ConfigError, match="is not the run directory of a previous run"):
        cli.prepare_argv([f"resume={tmp_path}"])


def test_an_existing_run_directory_is_never_reused(tmp_path):
    run = fake_run(tmp_path / "run")
    with pytest.raises(ConfigError, match="already holds a run"):
        cli.prepare_argv([*OVERRIDES, f"hydra.run.dir={run}"])


def test_launch_command_quotes_every_argument(tmp_path):
    """A run directory with spaces, quotes and shell syntax survives launch_command.sh unchanged
    and executes nothing."""
    from launcher import app, launch

    config = cli.compose(OVERRIDES)
    spec = app.model_spec(config)
    run_dir = tmp_path / "a b" / "$(touch pwned); `touch pwned2` 'q\""
    run_dir.mkdir(parents=True)
    plan = Plan({}, "cpu", 2, 1, (candidate("ddp", 100),), chosen=0)
    job = launch.prepare(plan, config, spec, run_dir)
    script = (run_dir / "launch_command.sh").read_text()
    assert shlex.split(script.strip().splitlines()[-1]) == list(job.argv)
    assert str(run_dir / "run.json") in job.argv
    check = subprocess.run(["bash", "-n", str(run_dir / "launch_command.sh")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    echo = subprocess.run(["bash", "-c", "set -- " + script.strip().splitlines()[-1] + '; printf "%s\\n" "$@"'],
                          capture_output=True, text=True, cwd=tmp_path)
    assert echo.stdout.splitlines() == list(job.argv)
    assert not list(tmp_path.rglob("pwned*"))


def test_dataset_blank_lines_skipped_long_documents_split_empty_dataset_refused(tmp_path):
    from launcher.worker.data import pack_blocks, read_documents

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "abc"}\n\n   \n{"text": ""}\n{"other": "x"}\n{"text": "' + "y" * 50 + '"}\n')
    docs = read_documents(str(data), "text")
    assert docs == ["abc", "y" * 50]
    blocks = pack_blocks([[1] * 3, [2] * 50], eos_token_id=0, seq_len=16)
    assert blocks.shape == (3, 16) and blocks.flatten().tolist() == ([1] * 3 + [0] + [2] * 50 + [0])[:48]
    empty = tmp_path / "e.txt"
    empty.write_text("\n  \n\n")
    with pytest.raises(ConfigError, match="contains no usable text"):
        read_documents(str(empty), "text")

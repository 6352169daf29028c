"""launch=sbatch_script: the standalone sbatch script against a golden file, and run by bash with
stub `srun`/`scontrol` to check that every argument reaches torchrun exactly (quoting)."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import cli, launch, slurm
from launcher.errors import ConfigError

GOLDEN = Path(__file__).parents[1] / "golden" / "sbatch_script.sh"
PYTHON = "/opt/venv/bin/python"
NASTY_DIR = Path("/runs/it's a $HOME `dir`")  # quote, spaces, $ and backticks must stay literal
SETTINGS = ["model=llama-2-70b", "hardware=a100-80g", "gpus=16", "nodes=2", "launch=sbatch_script",
            "launch.partition=gpu", "launch.account=proj-1", "launch.cpus_per_task=64", "launch.mem_gb=900",
            "launch.time_min=240"]


def _script(config, run_dir: Path) -> tuple[str, list[str]]:
    argv = [PYTHON, *launch.torchrun_argv(config, run_dir / "run.json")[1:]]
    env = {**slurm.task_env(config, launch.job_env(config)), "PYTHONPATH": "/opt/launcher"}
    text = slurm.render_sbatch_script(config, argv, env, run_dir,
                                      "Fine-tune llama-2-70b with zero3 on 2 node(s) x 8 a100-80g GPU(s).")
    return text, argv


def test_matches_golden_file():
    text, _ = _script(cli.compose(SETTINGS), Path("/scratch/runs/2026-01-01/12-00-00_llama-2-70b"))
    assert text == GOLDEN.read_text()


def test_every_argument_reaches_srun_exactly(tmp_path):
    """bash runs the script with stub srun/scontrol: srun must receive the torchrun argv with only
    ${MASTER_ADDR} and ${RUN_ID} replaced (first host of the allocation, the job id)."""
    config = cli.compose(SETTINGS)
    text, argv = _script(config, NASTY_DIR)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\n[ \"$1 $2 $3\" = 'show hostnames gpu[07-08]' ] && printf 'gpu07\\ngpu08\\n'\n")
    (bin_dir / "srun").write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    for p in bin_dir.iterdir():
        p.chmod(0o755)
    script = tmp_path / "sbatch.sh"
    script.write_text(text)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242",
           "HOME": "/nonexistent"}
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30, check=True).stdout
    received = json.loads(out)
    assert received[:2] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    expected = [a.replace("${MASTER_ADDR}", "gpu07").replace("${RUN_ID}", "4242") for a in argv]
    assert received[2:] == expected
    assert f"{NASTY_DIR}/run.json" in received and "--rdzv-endpoint=gpu07:29517" in received


def test_sbatch_options_follow_the_plan_and_defaults():
    config = cli.compose(["model=tiny-llama", "hardware=cpu", "gpus=2", "launch=slurm"])
    opts = slurm.sbatch_options(config, Path("/r"))
    assert "--nodes=1" in opts and "--ntasks-per-node=1" in opts
    assert not any(o.startswith(("--gpus-per-node", "--partition", "--account", "--mem=")) for o in opts)
    gpu = cli.compose(["model=tiny-llama", "hardware=a100-80g", "gpus=8", "nodes=2", "launch=slurm"])
    assert "--gpus-per-node=4" in slurm.sbatch_options(gpu, Path("/r"))


def test_run_dir_that_sbatch_cannot_hold_is_not_written_into_a_directive():
    config = cli.compose(["model=tiny-llama", "hardware=cpu", "gpus=2", "launch=sbatch_script"])
    text, _ = _script(config, Path("/runs/a b"))
    assert not any(ln.startswith("#SBATCH --output") for ln in text.splitlines())
    assert f"--output={shlex.quote('/runs/a b/slurm-%j.out')}" in text


@pytest.mark.parametrize("arg,bad", [("launch.partition='gpu --wrap=x'", "launch.partition"),
                                     ("launch.account=a b", "launch.account"),
                                     ("launch.time_min=0", "launch.time_min"),
                                     ("launch.mem_gb=0", "launch.mem_gb")])
def test_bad_launch_values_are_one_line_errors(arg, bad):
    with pytest.raises(ConfigError, match=bad):
        cli.compose(["model=tiny-llama", "hardware=cpu", "launch=slurm", arg])


def test_measure_needs_a_local_launch():
    with pytest.raises(ConfigError, match="mode=measure runs on this machine"):
        cli.compose(["model=tiny-llama", "hardware=cpu", "launch=slurm", "mode=measure"])


def test_launch_max_restarts_still_works_with_the_group():
    config = cli.compose(["model=tiny-llama", "hardware=cpu", "launch.max_restarts=2"])
    assert config.launch.kind.name == "torchrun" and config.launch.max_restarts == 2
    assert "--max-restarts=2" in launch.torchrun_argv(config, Path("/r/run.json"))


def test_a_job_sbatch_refuses_is_one_error_line_and_the_run_directory_stays(cli, tmp_path):
    """sbatch refusing the job (here a stand-in `sbatch` first on PATH that answers as Slurm does
    for an unknown partition) raised submitit's FailedJobError as a traceback."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text('#!/bin/sh\necho "sbatch: error: Batch job submission failed: '
                                 'Invalid partition name specified" >&2\nexit 1\n')
    (fake / "sbatch").chmod(0o755)
    r = cli("model=tiny-llama", "gpus=2", "hardware=cpu", "training.seq_len=64", "training.max_steps=2",
            "launch.kind=slurm", "launch.partition=nope", "mode=run",
            env={"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"})
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(errors) == 1 and "Invalid partition name specified" in errors[0] and "launch.partition" in errors[0]
    (plan,) = (cli.cwd / "runs").glob("*/*/plan.json")
    assert str(plan.parent) in errors[0]

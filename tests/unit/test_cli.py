"""The command surface as a user meets it: one clear line, exit code 2, nothing written."""
import json

import pytest

BAD = [
    (["gpus=4"], "model is required", "model="),
    (["model=bloom-1b2", "gpus=4"], "model=bloom-1b2: no such model", "bloom-1b1"),
    (["model=tiny-llama", "gpus=0"], "gpus=0", "at least 1"),
    (["model=tiny-llama", "training.seqlen=5"], "training.seqlen: unknown key", "training.seq_len"),
    (["model=tiny-llama", "training.seq_len=abc"], "training.seq_len", "Integer"),
    (["model=tiny-llama", "training.seq_len=-3"], "training.seq_len=-3", "at least 1"),
    (["model=tiny-llama", "training.precision=fp64"], "training.precision", "bf16-mixed"),
    (["model=tiny-llama", "strategy=zero5"], "strategy", "zero3"),
    (["model=tiny-llama", "hardware=b200"], "hardware=b200: no such hardware", "a100-80g"),
    (["model=tiny-llama", "training.seq_len=100000"], "training.seq_len=100000", "maximum positions"),
    (["model=tiny-llama", "gpus=4", "nodes=3"], "nodes=3", "divisible"),
    (["model=tiny-llama", "gpus=4", "training.micro_batch_size=2", "training.global_batch_size=6",
      "strategy=ddp"], "global_batch_size=6", "divisible"),
    (["model=custom", "model.config_path=/nonexistent/config.json"], "model.config_path", "no such file"),
    (["model=tiny-llama", "gpus=2", "strategy=single", "training.seq_len=128"], "strategy=single", "ddp"),
    (["-m", "model=tiny-llama,tiny-blom", "gpus=2"], "model=tiny-blom: no such model", "tiny-bloom"),
    (["model=tiny-llama", "training.length_profile=shakespeare"], "training.length_profile=shakespeare", "alpaca"),
    (["model=tiny-llama", "training.length_replay_batches=0"], "training.length_replay_batches=0", "at least 1"),
    (["model=tiny-llama", "training.sgd_momentum=-1"], "training.sgd_momentum=-1.0", "zero or more"),
    (["model=tiny-llama", "hardware=cpu", "gpus=2", "training.seq_len=64", "training.length_profile=alpaca"],
     "training.length_profile=alpaca", "mode=plan"),
    (["model=tiny-llama", "init.from=/x"], "init: takes one of [random, pretrained]", "init=random"),
    (["model=tiny-llama", "fallback.on=1"], "fallback: takes one bool value, not sub-keys", "fallback=true"),
    (["model=tiny-llama", "gpus.count=2"], "gpus: takes one int value, not sub-keys", "gpus=1"),
    (["model=tiny-llama", "training.liger_kernels=rope"], "training.liger_kernels: takes a list",
     "training.liger_kernels=[rope]"),
    (["model=tiny-llama", "data.path=/etc"], "data.path=/etc: a directory but not a datasets.save_to_disk", ".jsonl"),
    (["model=tiny-llama", "data.path=/dev/null"], "data.path=/dev/null: unsupported file type", ".txt"),
    (["model=tiny-llama", "mode=measure", "measure.timing_steps=-1"], "measure.timing_steps=-1", "zero or more"),
    (["model=tiny-llama", "mode=measure", "measure.memory_steps=0"], "measure.memory_steps=0", "at least 1"),
    (["model=tiny-llama", "training.seq_len=64", "peft=lora", "peft.alpha=0"], "peft.alpha=0", "peft.alpha=16"),
    (["model=tiny-llama", "training.seq_len=64", "peft=lora", "peft.r=0"], "peft.r=0", "peft.r=8"),
    (["model=tiny-llama", "hardware=v100-16g", "training.attn_implementation=flash_attention_2"],
     "training.attn_implementation=flash_attention_2: FlashAttention-2 needs an Ampere", "attn_implementation=sdpa"),
    # found by the planner, after Hydra made the run directory, which goes again
    (["model=tiny-llama", "gpus=3", "strategy=fsdp2_tp", "training.seq_len=64"],
     "strategy=fsdp2_tp: no tensor-parallel size fits 3 GPU(s) per node", "tp sizes valid for this model: [2]"),
    (["model=tiny-llama", "hydra.run.dir=/dev/null/run"], "hydra.run.dir=/dev/null/run", "is a file"),
    (["model=tiny-llama", "hardware=h100-80g", "hardware.nccl_version=2.20"], "hardware.nccl_version=2.2", "2.20.5"),
    (["model=tiny-llama", "hardware.nccl_version=two"], "hardware.nccl_version=two", "2.27.5"),
    (["model=tiny-llama", "hardware=a100-80g", "hardware.nccl_transport=ib"], "hardware.nccl_transport=ib", "nvlink, pcie, shm"),
    (["model=tiny-llama", "hardware=a100-80g", "hardware.nccl_channels=0"], "hardware.nccl_channels=0", "1-64"),
    (["model=tiny-llama", "gpus=2", "strategy=fsdp1", "peft=qlora", "training.seq_len=64"],
     "strategy=fsdp1 does not run peft=qlora", "use strategy=fsdp2"),
]


@pytest.mark.parametrize("args,key,fix", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_input_is_one_line_exit_2_nothing_written(cli, args, key, fix):
    r = cli(*args)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stderr
    assert key in lines[0] and fix in lines[0], lines[0]
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert not (cli.cwd / "runs").exists()


@pytest.mark.parametrize("sweep", [[], ["-m"]], ids=["run", "sweep"])
def test_a_cache_dir_that_cannot_be_a_directory_is_one_line_error(tmp_path, sweep):
    """cache_dir under a file: the first cache write raised a traceback (FileNotFoundError or
    NotADirectoryError from mkdir), in a single run and in each job of a sweep."""
    from conftest import run_cli

    r = run_cli(*sweep, "model=tiny-llama,tiny-bloom" if sweep else "model=tiny-llama", "gpus=2", "hardware=cpu",
                "training.seq_len=64", "mode=plan", "cache_dir=/dev/null/cache", cwd=tmp_path)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: cache_dir=/dev/null/cache: ") and "writable" in lines[0]
    assert not list(tmp_path.glob("runs/*/*/plan.json"))


@pytest.mark.parametrize("mode,sweep", [("run", []), ("measure", []), ("run", ["-m"])], ids=["run", "measure", "sweep"])
def test_a_gpu_run_on_a_machine_without_a_gpu_is_one_line_error(cli, mode, sweep):
    """torchrun started the ranks, each died in CUDA initialization, and torch elastic's failure
    report ended the run; now nothing is launched (in a sweep, by its first job)."""
    from launcher.hardware import local_gpu_names

    if local_gpu_names():
        pytest.skip("this machine has a GPU")
    r = cli(*sweep, "model=tiny-llama,tiny-bloom" if sweep else "model=tiny-llama", "gpus=2", "hardware=a100-80g",
            "training.seq_len=64", "training.max_steps=2", f"mode={mode}")
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: mode={mode}: hardware=a100-80g") and "hardware=cpu" in lines[0]
    assert not list(cli.cwd.glob("**/run.json"))


def test_config_json_that_is_not_a_decoder(cli, tmp_path):
    bert = tmp_path / "bert.json"
    bert.write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64,
                                "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128}))
    r = cli("model=custom", f"model.config_path={bert}")
    assert r.returncode == 2
    assert "not a decoder-only causal LM" in r.stderr and "Traceback" not in r.stderr



def test_a_sweep_over_models_plans_each(cli):
    """`-m model=a,b` (Hydra's sweep syntax, and its glob) is checked value by value and plans every
    model in one process."""
    r = cli("-m", "model=tiny-llama,tiny-bloom", "gpus=2", "hardware=cpu", "training.seq_len=64", "mode=plan",
            "strategy=ddp")
    assert r.returncode == 0, r.stderr[-2000:]
    plans = sorted((cli.cwd / "runs").glob("*/*_sweep/*/plan.json"))
    assert [json.loads(p.read_text())["model"]["name"] for p in plans] == ["tiny-llama", "tiny-bloom"]
    from launcher.cli import sweep_values

    options = ["tiny-bloom", "tiny-llama", "gpt2"]
    assert sweep_values("model=glob(tiny-*)", options) == ["tiny-bloom", "tiny-llama"]
    assert sweep_values("model=choice(gpt2,tiny-llama)", options) == ["gpt2", "tiny-llama"]
    assert sweep_values("model=gpt2", options) == ["gpt2"]


def test_a_sweep_goes_on_past_a_job_with_bad_input(cli):
    """A job that only the planner can refuse (600 tokens are more than tiny-llama's 512 positions,
    not GPT-2's 1024) stopped the whole sweep, so the models after it were never planned. It is now
    one line naming the job and its fix; the other jobs plan, and the sweep exits 2 at its end."""
    r = cli("-m", "model=tiny-llama,gpt2", "gpus=1", "peft=lora", "hardware=cpu", "training.seq_len=600",
            "mode=plan", "strategy=single")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("error: job 0 (model=tiny-llama")]
    assert "training.seq_len" in line
    assert "error: 1 sweep job(s) stopped by bad input: job 0" in r.stderr
    plans = sorted((cli.cwd / "runs").glob("*/*_sweep/*/plan.json"))
    assert [json.loads(p.read_text())["model"]["name"] for p in plans] == ["gpt2"]
    assert [p.name for p in plans[0].parent.parent.iterdir() if p.is_dir()] == ["1"]  # job 0 left nothing


def test_only_a_sweep_asks_hydra_for_its_mode():
    from launcher.__main__ import single_run

    assert single_run(["model=gpt2", "gpus=2", "hydra.run.dir=x"])
    for sweep in (["-m", "gpus=2,4"], ["--multirun"], ["hydra.mode=MULTIRUN"], ["++hydra.mode=MULTIRUN"]):
        assert not single_run(["model=gpt2", *sweep])


def test_a_plan_shows_no_library_notices(cli):
    """Planning LoRA and QLoRA with checkpointing imports peft, bitsandbytes and transformers: their
    notices about optional CPU kernels and deprecated attributes (launcher/__init__.py) say nothing
    about the plan and stay out of the user's terminal; so does transformers' note that GPT-2's
    class names no loss type and it uses the default causal-LM loss."""
    r = cli("model=tiny-llama", "gpus=1", "hardware=a100-80g", "peft=qlora", "training.seq_len=64",
            "training.gradient_checkpointing=true", "training.micro_batch_size=1", "mode=plan")
    gpt2 = cli("model=gpt2", "gpus=1", "hardware=a100-80g", "strategy=single", "training.seq_len=32",
               "training.micro_batch_size=1", "peft=lora", "mode=plan")  # peft's fan_in_fan_out note on Conv1D
    gemma = cli("model=gemma-2b", "gpus=1", "hardware=a100-80g", "mode=infer_plan")  # config.json's legacy gelu
    for run in (r, gpt2, gemma):
        assert run.returncode == 0, run.stderr[-2000:]
        noise = [ln for ln in (run.stderr + run.stdout).splitlines()
                 if "Warning" in ln or "kernels-community" in ln or "warnings.warn" in ln or "loss_type" in ln
                 or "hidden_act" in ln]
        assert noise == [], noise


def test_a_step_the_fake_tensors_refuse_is_one_line_without_torchs_log(cli):
    """Mixtral's grouped-GEMM experts refuse fp32 weights (DDP keeps fp32 weights under autocast):
    the planner names the failure in one line; FakeTensorMode's own log of the op, with its
    traceback, stays out of the output."""
    r = cli("model=mixtral-8x7b", "gpus=2", "hardware=a100-80g", "strategy=ddp", "training.seq_len=64")
    assert r.returncode == 2, r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == [
        next(ln for ln in r.stderr.splitlines() if ln.startswith("error: strategy=ddp: the traced step fails"))]
    assert "Traceback" not in r.stderr and "fake_tensor.py" not in r.stderr

"""Exports for DeepSpeed, HF Trainer and Accelerate: golden files, and each tool's own loader."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher.config import DeepSpeedConfig, Optimizer, Precision, TrainingConfig
from launcher.emit.accelerate import accelerate_config, command_lines
from launcher.backends.deepspeed.emit import deepspeed_config
from launcher.backends.deepspeed.standalone import hf_trainer_config, standalone_config, unsupported_optimizer
from launcher.types import Strategy
from tests.conftest import run_cli

GOLDEN = Path(__file__).parents[1] / "golden"
ZERO2 = Strategy("zero2", "deepspeed", zero_stage=2)
ZERO3 = Strategy("zero3", "deepspeed", zero_stage=3)
TRAINING = TrainingConfig(precision=Precision["bf16-mixed"], learning_rate=1e-4, weight_decay=0.01,
                          warmup_steps=10, max_grad_norm=1.0)


def golden_json(name: str) -> dict:
    return json.loads((GOLDEN / name).read_text())


def test_standalone_golden():
    base = deepspeed_config(ZERO2, TRAINING, DeepSpeedConfig(), 2, 4, 2)
    assert standalone_config(base, TRAINING) == golden_json("ds_zero2_standalone_bf16.json")


def test_hf_trainer_golden():
    base = deepspeed_config(ZERO3, TRAINING, DeepSpeedConfig(), 2, 4, 2)
    assert hf_trainer_config(base, TRAINING) == golden_json("ds_zero3_hf_trainer_bf16.json")


@pytest.mark.parametrize("name,strategy,precision,n,device,run_dir", [
    ("accelerate_zero3_bf16.yaml", ZERO3, "bf16-mixed", 4, "cuda", "RUN_DIR"),
    ("accelerate_ddp_cpu.yaml", Strategy("ddp", "ddp"), "32-true", 2, "cpu", None),
])
def test_accelerate_golden(name, strategy, precision, n, device, run_dir):
    got = accelerate_config(strategy, precision, n, 1, device, run_dir)
    assert got == yaml.safe_load((GOLDEN / name).read_text())


def test_accelerate_single_process_is_not_distributed():
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    got = accelerate_config(Strategy("single", "ddp"), "bf16-mixed", 1, 1, "cuda")
    assert ClusterConfig(**ClusterConfig.process_config(got)).distributed_type == DistributedType.NO


def test_accelerate_deepspeed_needs_the_run_directory_of_its_stand_alone_config():
    with pytest.raises(ValueError, match="reads the stand-alone DeepSpeed config"):
        accelerate_config(ZERO3, "bf16-mixed", 2, 1, "cuda")


def test_accelerate_refuses_colossalai():
    with pytest.raises(ValueError, match="cai_gemini: Accelerate's config is written for torch DDP and DeepSpeed"):
        accelerate_config(Strategy("cai_gemini", "colossalai"), "bf16-mixed", 2, 1, "cuda")


def test_optimizer_without_deepspeed_block_is_named():
    reason = unsupported_optimizer(TrainingConfig(optimizer=Optimizer["adafactor"]))
    assert reason and "training.optimizer=adafactor" in reason
    assert unsupported_optimizer(TrainingConfig(optimizer=Optimizer["sgd"])) is None


def test_command_lines_two_nodes():
    cmds = command_lines(num_processes=8, num_machines=2, run_json="/r/run.json", master_port=29517,
                         accelerate_file="/r/acc.yaml", strategy=ZERO3)
    assert cmds["torchrun"] == ["torchrun", "--nproc-per-node=4", "--nnodes=2", "--rdzv-backend=c10d",
                                "--rdzv-endpoint=${MASTER_ADDR}:29517", "--rdzv-id=${RUN_ID}",
                                "-m", "launcher.worker", "/r/run.json"]
    assert cmds["deepspeed"] == ["deepspeed", "--num_gpus=4", "--num_nodes=2", "--hostfile=hostfile",
                                 "--master_port=29517", "--no_local_rank", "--module", "launcher.worker",
                                 "/r/run.json"]
    assert cmds["accelerate"] == ["accelerate", "launch", "--config_file=/r/acc.yaml", "-m", "launcher.worker",
                                  "/r/run.json"]


TINY_ZERO3 = ("model=tiny-llama", "gpus=2", "hardware=cpu", "strategy=zero3", "training.seq_len=32",
              "training.precision=bf16-mixed", "training.micro_batch_size=2", "training.global_batch_size=8",
              "training.warmup_steps=3", "training.learning_rate=1e-3")
"""A plan on 2 CPU processes: zero3, bf16-mixed, micro 2 x accum 2, 3 warm-up steps."""


def trace_cache(tmp_path_factory) -> Path:
    """One trace cache for the test session's CLI runs of the same model."""
    return tmp_path_factory.getbasetemp() / "launcher-trace-cache"


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("exports")
    r = run_cli(*TINY_ZERO3, "mode=plan", "hydra.run.dir=run", f"cache_dir={trace_cache(tmp_path_factory)}",
                cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    return root / "run"


def test_run_directory_holds_every_export(zero3_run):
    names = {p.name for p in zero3_run.iterdir()}
    assert {"ds_config.json", "ds_config.standalone.json", "ds_config.hf_trainer.json",
            "accelerate_config.yaml", "launch_commands.sh"} <= names
    text = (zero3_run / "launch_commands.sh").read_text()
    for tool in ("torchrun --nproc-per-node=2", "deepspeed --num_gpus=2", "accelerate launch --config_file="):
        assert tool in text


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def test_hf_trainer_fills_every_auto(zero3_run):
    """transformers' own loader resolves every "auto" from TrainingArguments."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    args = TrainingArguments(output_dir=str(zero3_run / "hf"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=1e-3, warmup_steps=3,
                             max_grad_norm=1.0, bf16=True, use_cpu=True, report_to=[])
    hf = HfTrainerDeepSpeedConfig(str(zero3_run / "ds_config.hf_trainer.json"))
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, tiny_llama(), num_training_steps=30)
    cfg = hf.config
    assert "auto" not in json.dumps(cfg)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (2, 2)
    assert cfg["optimizer"]["params"]["lr"] == 1e-3 and cfg["bf16"]["enabled"] is True
    assert cfg["scheduler"]["params"]["warmup_max_lr"] == 1e-3
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == 3
    assert hf.is_zero3()


TRAINING_ARGS = r"""
import json, sys, deepspeed
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
from transformers import TrainingArguments
args = TrainingArguments(output_dir="out", deepspeed=sys.argv[1], per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, learning_rate=1e-3, warmup_steps=3, bf16=True,
                         use_cpu=True, report_to=[])
cfg = args.hf_deepspeed_config.config
print("RESULT " + json.dumps({"zero3": args.hf_deepspeed_config.is_zero3(), "config": cfg}))
"""


@pytest.mark.integration
def test_training_arguments_take_the_file(zero3_run, tmp_path):
    """TrainingArguments(deepspeed=path), as Trainer users hand it over, on one CPU rank."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29733", "DS_BUILD_OPS": "0"}
    proc = subprocess.run([sys.executable, "-c", TRAINING_ARGS, str(zero3_run / "ds_config.hf_trainer.json")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[0].removeprefix("RESULT "))
    assert got["zero3"] and got["config"]["train_micro_batch_size_per_gpu"] == 2
    assert got["config"]["optimizer"]["params"]["lr"] == 1e-3 and got["config"]["bf16"]["enabled"] is True


def test_accelerate_loads_config(zero3_run):
    """Accelerate's loader accepts the file (it rejects unknown keys) and its launch validation
    finds the DeepSpeed config it names."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    cfg = load_config_from_file(str(zero3_run / "accelerate_config.yaml"))
    assert cfg.distributed_type == DistributedType.DEEPSPEED and cfg.num_processes == 2 and cfg.use_cpu
    assert Path(cfg.deepspeed_config["deepspeed_config_file"]) == zero3_run / "ds_config.standalone.json"
    assert cfg.deepspeed_config["zero3_init_flag"] is True


DS_INIT = r"""
import json, sys, torch, deepspeed
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
deepspeed.init_distributed(dist_backend="gloo")
from transformers import LlamaConfig, LlamaForCausalLM
out = []
for path in sys.argv[1:]:
    cfg = json.load(open(path))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config=path)
    lrs = []
    for _ in range(2):
        for _ in range(cfg["gradient_accumulation_steps"]):
            ids = torch.randint(0, 64, (cfg["train_micro_batch_size_per_gpu"], 16))
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        lrs.append(scheduler.get_last_lr()[0])
    inner = getattr(optimizer, "optimizer", optimizer)
    out.append({"optimizer": type(inner).__module__ + "." + type(inner).__name__, "lrs": lrs,
                "steps": engine.global_steps})
if torch.distributed.get_rank() == 0:
    print("RESULT " + json.dumps(out), flush=True)
del engine, optimizer, scheduler, model  # gloo's threads idle before the group goes (no abort at exit)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


@pytest.mark.integration
def test_standalone_config_initializes_on_two_cpu_processes(zero3_run, tmp_path):
    """deepspeed.initialize with no client optimizer builds torch's AdamW and the WarmupLR from the
    file on 2 gloo ranks, for the planned zero3 export and the zero2 golden file."""
    script = tmp_path / "ds_init.py"
    script.write_text(DS_INIT)
    env = {**os.environ, "DS_BUILD_OPS": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
                           str(script), str(zero3_run / "ds_config.standalone.json"),
                           str(GOLDEN / "ds_zero2_standalone_bf16.json")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    zero3, zero2 = json.loads(lines[0].removeprefix("RESULT "))
    assert zero3["optimizer"] == zero2["optimizer"] == "torch.optim.adamw.AdamW"
    assert zero3["steps"] == zero2["steps"] == 2
    # WarmupLR after n optimizer steps: min + (max - min) * (n - 1) / warmup_num_steps, with
    # min = lr / (warmup_steps + 1): 3 warm-up steps to 1e-3 (zero3), 10 to 1e-4 (zero2 golden)
    assert zero3["lrs"] == pytest.approx([1e-3 / 4, 1e-3 / 4 + (1e-3 * 3 / 4) / 3])
    assert zero2["lrs"] == pytest.approx([1e-4 / 11, 1e-4 / 11 + (1e-4 * 10 / 11) / 10])

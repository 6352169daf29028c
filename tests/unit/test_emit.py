"""Emitted framework configs: hand-written golden files, and acceptance by DeepSpeed and torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config import DDPConfig, DeepSpeedConfig, Precision, TrainingConfig
from launcher.emit import EMITTERS, emit
from launcher.backends.ddp.emit import ddp_settings
from launcher.backends.deepspeed.emit import FP16_DYNAMIC_LOSS_SCALE, deepspeed_config
from launcher.errors import ConfigError
from launcher.backends.deepspeed.comm import overlap_comm as deepspeed_overlap_comm
from launcher.types import Strategy

GOLDEN = Path(__file__).parents[1] / "golden"
ZERO = {stage: Strategy(f"zero{stage}", "deepspeed", zero_stage=stage) for stage in range(4)}
ZERO2_OFFLOAD = Strategy("zero2_offload", "deepspeed", zero_stage=2, offload_optimizer=True)
ZERO3_OFFLOAD = Strategy("zero3_offload", "deepspeed", zero_stage=3, offload_optimizer=True,
                         offload_params=True)
SMALL_BUCKETS = DeepSpeedConfig(reduce_bucket_size=20_000_000, allgather_bucket_size=30_000_000,
                                overlap_comm=True, contiguous_gradients=False)

# golden file -> (strategy, precision, max_grad_norm, DeepSpeedConfig); micro 2, accum 4, dp 2
DS_CASES = {
    "ds_zero0_fp32": (ZERO[0], "32-true", 1.0, DeepSpeedConfig()),
    "ds_zero1_bf16": (ZERO[1], "bf16-mixed", 1.0, DeepSpeedConfig()),
    "ds_zero2_fp16_small_buckets": (ZERO[2], "16-mixed", 0.5, SMALL_BUCKETS),
    "ds_zero3_bf16": (ZERO[3], "bf16-mixed", 1.0, DeepSpeedConfig()),
    "ds_zero3_offload_bf16": (ZERO3_OFFLOAD, "bf16-mixed", 1.0, DeepSpeedConfig()),
}


def ds_case(name: str, dp: int = 2) -> tuple[dict, Strategy, DeepSpeedConfig]:
    strategy, precision, clip, ds = DS_CASES[name]
    training = TrainingConfig(precision=Precision[precision], max_grad_norm=clip)
    return deepspeed_config(strategy, training, ds, 2, 4, dp), strategy, ds


class FakeMpu:
    """What DeepSpeedConfig asks of a model-parallel unit: the data-parallel world size."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


@pytest.fixture
def parse_ds(monkeypatch):
    """DeepSpeed's own parser and validators (deepspeed/runtime/config.py DeepSpeedConfig).
    Without an initialised process group its `dist.get_rank()` raises and it falls back to world
    size 1 before reading the mpu; rank 0 is given so the mpu's dp size is used."""
    from deepspeed.runtime import config as ds_config_module

    monkeypatch.setattr(ds_config_module.dist, "get_rank", lambda *args, **kwargs: 0)
    return lambda cfg, dp: ds_config_module.DeepSpeedConfig(cfg, mpu=FakeMpu(dp))


@pytest.mark.parametrize("name", sorted(DS_CASES))
def test_deepspeed_golden(name):
    cfg, strategy, _ = ds_case(name)
    assert cfg == json.loads((GOLDEN / f"{name}.json").read_text())
    assert emit(strategy, training=TrainingConfig(precision=Precision[DS_CASES[name][1]],
                                                  max_grad_norm=DS_CASES[name][2]),
                knobs={"deepspeed": DS_CASES[name][3]}, micro_batch_size=2,
                grad_accum_steps=4, dp_size=2) == ("ds_config.json", cfg)


def test_ddp_golden():
    """The golden file holds torch 2.13's name for the buffer flag (the pinned CPU torch)."""
    assert ddp_settings(DDPConfig()) == json.loads((GOLDEN / "ddp_config.json").read_text())
    file_name, cfg = emit(Strategy("ddp", "ddp"), training=TrainingConfig(), micro_batch_size=2,
                          grad_accum_steps=4, dp_size=2)
    assert (file_name, cfg) == ("ddp_config.json", ddp_settings(DDPConfig()))


def test_registry_covers_every_backend_with_a_distinct_file():
    assert {"deepspeed", "ddp", "colossalai"} <= set(EMITTERS)
    assert len(set(EMITTERS.values())) == len(EMITTERS)
    with pytest.raises(ConfigError, match="backend='unknown-backend' is not registered"):
        emit(Strategy("other", "unknown-backend"), training=TrainingConfig(), micro_batch_size=1,
             grad_accum_steps=1, dp_size=1)


@pytest.mark.parametrize("name", sorted(DS_CASES))
def test_deepspeed_accepts_config(name, parse_ds):
    cfg, strategy, ds = ds_case(name, dp=4)
    parsed = parse_ds(cfg, 4)
    assert parsed.world_size == 4 and parsed.train_batch_size == 2 * 4 * 4
    assert parsed.gradient_accumulation_steps == 4 and parsed.train_micro_batch_size_per_gpu == 2
    assert parsed.gradient_clipping == DS_CASES[name][2]
    assert parsed.zero_allow_untested_optimizer is True
    zero = parsed.zero_config
    assert zero.stage == strategy.zero_stage
    assert zero.overlap_comm == deepspeed_overlap_comm(strategy, ds)  # what the estimator assumes
    if strategy.zero_stage > 0:
        assert (zero.reduce_bucket_size, zero.allgather_bucket_size) == (
            ds.reduce_bucket_size, ds.allgather_bucket_size)
        assert zero.contiguous_gradients == ds.contiguous_gradients
    if strategy.zero_stage == 3:
        assert (zero.prefetch_bucket_size, zero.max_live_parameters, zero.max_reuse_distance,
                zero.param_persistence_threshold, zero.sub_group_size) == (
            ds.stage3_prefetch_bucket_size, ds.stage3_max_live_parameters,
            ds.stage3_max_reuse_distance, ds.stage3_param_persistence_threshold, ds.sub_group_size)
    assert (zero.offload_optimizer is not None) == strategy.offload_optimizer
    assert (zero.offload_param is not None) == strategy.offload_params
    if strategy.offload_optimizer:
        assert zero.offload_optimizer.device == "cpu"
        assert zero.offload_optimizer.pin_memory == ds.offload_pin_memory
        assert parsed.zero_force_ds_cpu_optimizer is False
    precision = DS_CASES[name][1]
    assert parsed.bfloat16_config.enabled == precision.startswith("bf16")
    assert parsed.float16_config.enabled == precision.startswith("16")


def test_deepspeed_rejects_wrong_world_size(parse_ds):
    cfg, _, _ = ds_case("ds_zero2_fp16_small_buckets", dp=2)
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        parse_ds(cfg, 3)


def test_fp16_loss_scaling_is_deepspeeds_default():
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    defaults = DeepSpeedFP16Config().model_dump()
    assert {k: defaults[k] for k in FP16_DYNAMIC_LOSS_SCALE} == FP16_DYNAMIC_LOSS_SCALE
    assert defaults["loss_scale"] == 0  # 0 = dynamic


def test_bf16_true(parse_ds):
    training = TrainingConfig(precision=Precision["bf16-true"])
    zero0 = deepspeed_config(ZERO[0], training, DeepSpeedConfig(), 1, 1, 2)
    assert "bf16" not in zero0 and zero0["communication_data_type"] == "bf16"
    import torch

    assert parse_ds(zero0, 2).communication_data_type == torch.bfloat16
    for stage in (1, 2, 3):
        cfg = deepspeed_config(ZERO[stage], training, DeepSpeedConfig(), 1, 1, 2)
        bf16 = parse_ds(cfg, 2).bfloat16_config  # DeepSpeed asserts these need stage 1-3
        assert bf16.enabled and bf16.bf16_master_weights_and_grads and bf16.bf16_optimizer_states
    for strategy in (ZERO2_OFFLOAD, ZERO3_OFFLOAD):
        with pytest.raises(ConfigError, match="bf16-mixed"):
            deepspeed_config(strategy, training, DeepSpeedConfig(), 1, 1, 2)


def test_16_true_is_refused_at_every_stage():
    """ZeRO 1-3 need DeepSpeedCPUAdam for fp16 master weights; ZeRO-0 would train fp16 without
    loss scaling, which the worker does not do (launcher/worker/model.py PRECISIONS)."""
    training = TrainingConfig(precision=Precision["16-true"])
    for stage in (0, 2):
        with pytest.raises(ConfigError, match="16-mixed"):
            deepspeed_config(ZERO[stage], training, DeepSpeedConfig(), 1, 1, 1)


def test_ddp_kwargs_accepted_by_torch(tmp_path):
    import torch
    import torch.distributed as dist

    settings = ddp_settings(DDPConfig(bucket_cap_mb=4.0, gradient_as_bucket_view=True, static_graph=True))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    model = None
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4), **settings)
        model(torch.randn(3, 4)).sum().backward()
        seen = (model.bucket_bytes_cap, model.gradient_as_bucket_view, model.static_graph,
                model.find_unused_parameters, model.broadcast_buffers)  # properties on 2.13
    finally:
        # the DDP reducer goes before the process group: a reducer holding the group's last
        # reference destroys it inside its own dealloc, whose join of gloo's threads can hang
        del model
        dist.destroy_process_group()
    assert seen == (4 * 2**20, True, True, False, False)


ENGINE_SCRIPT = r"""
import json, os, sys
import torch, deepspeed
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
deepspeed.init_distributed(dist_backend="gloo")
cfg = json.loads(sys.argv[1])
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
dtype = next(engine.module.parameters()).dtype
for _ in range(2 * cfg["gradient_accumulation_steps"]):
    loss = engine(torch.randn(cfg["train_micro_batch_size_per_gpu"], 8, dtype=dtype)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
print("TRAINED", type(engine.optimizer).__name__)
"""


@pytest.mark.integration
@pytest.mark.parametrize("name", ["ds_zero0_fp32", "ds_zero1_bf16", "ds_zero3_bf16", "ds_zero3_offload_bf16"])
def test_deepspeed_engine_trains_with_config(name, tmp_path):
    """deepspeed.initialize + steps on one gloo rank with a torch AdamW client optimizer (fp16 is
    not available on DeepSpeed's CPU accelerator, so the fp16 case is only parsed above)."""
    cfg, _, _ = ds_case(name, dp=1)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29700 + sorted(DS_CASES).index(name)), DS_BUILD_OPS="0")
    out = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, json.dumps(cfg)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert "TRAINED" in out.stdout, out.stderr[-3000:]


BACKEND_SCRIPT = r"""
import json, sys
from types import SimpleNamespace
import torch, deepspeed, transformers
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
deepspeed.init_distributed(dist_backend="gloo")
from launcher.backends.deepspeed.worker import DeepSpeedBackend
from launcher.worker.backends import moves_model
from launcher.worker.train import RankEnv

cfg = json.loads(sys.argv[1])
config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=320, use_cache=False)
model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
# a weight its class keeps in fp32 (transformers' _keep_in_fp32_modules), as the engine would cast it
model.model.norm.weight.data = model.model.norm.weight.data.float()
moved, to = [], torch.nn.Module.to
def spy(self, *args, **kwargs):  # a move of the whole model, by anyone
    if self is model:
        moved.append(args)
    return to(self, *args, **kwargs)
torch.nn.Module.to = spy
spec = SimpleNamespace(framework_config=cfg, micro_batch_size=2, grad_accum_steps=1, precision="bf16-mixed",
                       max_grad_norm=1.0, optimizer="adamw_torch", learning_rate=1e-3, weight_decay=0.0,
                       sgd_momentum=0.0, warmup_steps=0, peft=None, strategy="zero3", device="cpu")
backend = DeepSpeedBackend(model, spec, RankEnv(rank=0, world_size=1, local_rank=0, device="cpu"), None,
                           SimpleNamespace(phase=lambda name: __import__("contextlib").nullcontext()))
params = list(backend.engine.module.parameters())
loss = backend.micro_step(torch.randint(0, 320, (2, 16)), last=True)
backend.optimizer_step()
print("RESULT", json.dumps({"moves_model": moves_model(SimpleNamespace(backend="deepspeed", **vars(spec))),
                            "moved": len(moved), "partitioned": all(hasattr(p, "ds_id") for p in params),
                            "dtypes": sorted({str(p.ds_tensor.dtype) for p in params}),
                            "loss": float(loss)}))
"""


@pytest.mark.integration
def test_zero3_partitions_the_host_built_model_without_moving_it_whole(tmp_path):
    """ZeRO-3 takes the model as built on the host and partitions it a parameter at a time: the
    worker does not move it to the device and DeepSpeed's engine, which moves a module not built
    under zero.Init whole (engine.py `_configure_distributed_model`), finds it partitioned."""
    cfg, _, _ = ds_case("ds_zero3_bf16", dp=1)
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1, train_batch_size=2)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29711", DS_BUILD_OPS="0")
    out = subprocess.run([sys.executable, "-c", BACKEND_SCRIPT, json.dumps(cfg)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out.stderr[-3000:]
    result = json.loads(line[len("RESULT "):])
    assert result["moves_model"] and result["partitioned"] and result["moved"] == 0
    assert result["dtypes"] == ["torch.bfloat16"]  # the fp32 weight too, as the engine casts it
    assert 0 < result["loss"] < 100

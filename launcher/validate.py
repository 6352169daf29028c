"""The composed config, checked once at the edge: every problem with the values at once, each
naming the key and the fix (`problems`), then converted to the typed `LauncherConfig` (`to_config`)."""
from __future__ import annotations

import math
import sys

from omegaconf import DictConfig, OmegaConf

from launcher import lengths, margin
from launcher.backends.base import in_backward_problem
from launcher.backends.registry import STRATEGIES, backend_of
from launcher.config import LauncherConfig
from launcher.data_path import data_path_problem
from launcher.errors import ConfigError, collect
from launcher.memory import runtime
from launcher.slurm import launch_problems


def to_config(cfg: DictConfig, argv: list[str] | None = None) -> LauncherConfig:
    """The last place that knows about OmegaConf; validates every value at once. `argv`: the
    command-line overrides (default sys.argv[1:]), the only place trust_remote_code may come from."""
    config: LauncherConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    collect(problems(config, argv))
    config.planner.safety_margin = margin.resolve(config.planner.safety_margin, config.hardware.device)
    return config


def set_true_on_command_line(key: str, argv: list[str]) -> bool:
    """Whether the last override of `key` in argv (Hydra syntax, optional +/++ prefix) is a value
    OmegaConf reads as true (its BooleanNode accepts true/yes/on/y/1, any case)."""
    values = [a.partition("=")[2] for a in argv if a.partition("=")[0].lstrip("+~") == key]
    return bool(values) and values[-1].strip().strip("'\"").lower() in ("true", "yes", "on", "y", "1")


def run_problems(c: LauncherConfig) -> list[str]:
    """Limits of the run-time keys: dataset, resume, fallback, checkpoints, restarts, numbers."""
    out: list[str] = []
    t = c.training
    data_why = data_path_problem(c.data.path)
    out += [data_why] if data_why else []
    if not isinstance(c.resume, (bool, str)):
        out.append(f"resume={c.resume}: must be false or the directory of a previous run (resume=runs/<date>/<time>_<model>)")
    for key, value in (("training.warmup_steps", t.warmup_steps), ("training.weight_decay", t.weight_decay),
                       ("training.sgd_momentum", t.sgd_momentum),
                       ("training.max_grad_norm", t.max_grad_norm), ("checkpoint.every_steps", c.checkpoint.every_steps),
                       ("checkpoint.keep", c.checkpoint.keep), ("launch.max_restarts", c.launch.max_restarts),
                       ("max_fallbacks", c.max_fallbacks), ("measure.timing_steps", c.measure.timing_steps),
                       ("measure.warmup_steps", c.measure.warmup_steps)):
        if not value >= 0 or (isinstance(value, float) and not math.isfinite(value)):
            out.append(f"{key}={value}: must be zero or more")
    if c.measure.memory_steps < 1:
        out.append(f"measure.memory_steps={c.measure.memory_steps}: must be at least 1 (the memory pass runs at least 2)")
    if not math.isfinite(t.learning_rate):
        out.append(f"training.learning_rate={t.learning_rate}: must be a finite number, e.g. 2e-4")
    if not 1 <= c.launch.master_port <= 65535:
        out.append(f"launch.master_port={c.launch.master_port}: must be a TCP port in 1..65535, e.g. 29517")
    if c.worker.simulate_oom_above_bytes is not None and c.worker.simulate_oom_above_bytes < 1:
        out.append(f"worker.simulate_oom_above_bytes={c.worker.simulate_oom_above_bytes}: must be positive or null")
    hw = c.hardware
    for key in ("host_memory_bytes", "matmul_efficiency", "memory_bandwidth_gbps", "intra_node_bandwidth_gbps",
                "inter_node_bandwidth_gbps", "host_link_bandwidth_gbps"):
        value = getattr(hw, key)
        if not (value > 0 and math.isfinite(value)):
            out.append(f"hardware.{key}={value}: must be a positive number")
    if not hw.matmul_efficiency <= 1:
        out.append(f"hardware.matmul_efficiency={hw.matmul_efficiency}: must be at most 1 (a fraction of peak)")
    out += [f"hardware.peak_tflops.{k}={v}: must be a positive number" for k, v in hw.peak_tflops.items()
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v))]
    try:
        if hw.nccl_version is not None:
            runtime.nccl_version(hw.nccl_version)
    except ValueError as err:
        out.append(f"hardware.nccl_version={hw.nccl_version}: {err}")
    if hw.nccl_transport not in runtime.NCCL_TRANSPORTS:
        out.append(f"hardware.nccl_transport={hw.nccl_transport}: must be one of {', '.join(runtime.NCCL_TRANSPORTS)}")
    if not 1 <= hw.nccl_channels <= 64:
        out.append(f"hardware.nccl_channels={hw.nccl_channels}: must be 1-64 (the 'coll channels' NCCL logs)")
    out += launch_problems(c)
    return out


def problems(c: LauncherConfig, argv: list[str] | None = None) -> list[str]:
    """Every problem with the values, each naming the key and the fix."""
    out: list[str] = run_problems(c)
    t = c.training
    if c.gpus < 1:
        out.append(f"gpus={c.gpus}: must be at least 1; e.g. gpus=4")
    if c.nodes < 1:
        out.append(f"nodes={c.nodes}: must be at least 1; e.g. nodes=2")
    elif c.gpus >= 1 and c.gpus % c.nodes:
        out.append(f"gpus={c.gpus} is not divisible by nodes={c.nodes}; gpus counts GPUs over all nodes, "
                   f"e.g. gpus={c.nodes * max(1, c.gpus // c.nodes)} nodes={c.nodes}")
    for key in ("seq_len", "max_steps", "length_replay_batches", "length_multiple_of"):
        if getattr(t, key) < 1:
            out.append(f"training.{key}={getattr(t, key)}: must be at least 1")
    if t.length_profile is not None:
        try:
            lengths.load(t.length_profile)
        except ConfigError as err:
            out.append(str(err))
    for key in ("micro_batch_size", "global_batch_size"):
        v = getattr(t, key)
        if v is not None and v < 1:
            out.append(f"training.{key}={v}: must be at least 1 (or null to let the planner choose)")
    if t.micro_batch_size and t.global_batch_size and c.gpus >= 1 and t.global_batch_size % (t.micro_batch_size * c.gpus):
        m, dp = t.micro_batch_size, c.gpus
        out.append(f"training.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size x "
                   f"data-parallel size = {m} x {dp}; try training.global_batch_size={m * dp * max(1, t.global_batch_size // (m * dp))}")
    one = STRATEGIES.get(c.strategy.name)
    if one is not None and backend_of(one).rules(one).single_process and c.gpus > 1:
        out.append(f"strategy={one.name} runs one process without a data-parallel wrapper; with gpus={c.gpus} "
                   "use strategy=ddp (or auto)")
    if t.learning_rate <= 0:
        out.append(f"training.learning_rate={t.learning_rate}: must be positive")
    in_backward = in_backward_problem(t.max_grad_norm, t.precision.name, 1) if t.optimizer_in_backward else ""
    out += [in_backward] if in_backward else []
    if t.optimizer_in_backward and not t.zero_grad_set_to_none:
        out.append("training.zero_grad_set_to_none=false: training.optimizer_in_backward=true frees each gradient "
                   "in its hook, so none is kept; set training.zero_grad_set_to_none=true")
    if c.planner.safety_margin is not None and not 0 <= c.planner.safety_margin < 1:
        out.append(f"planner.safety_margin={c.planner.safety_margin}: must be in [0, 1), e.g. 0.05")
    if c.planner.max_micro_batch_size < 1:
        out.append(f"planner.max_micro_batch_size={c.planner.max_micro_batch_size}: must be at least 1")
    ds = c.deepspeed
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_max_live_parameters", "sub_group_size"):
        if getattr(ds, key) < 1:
            out.append(f"deepspeed.{key}={getattr(ds, key)}: must be a positive number of elements")
    if c.ddp.bucket_cap_mb <= 0:
        out.append(f"ddp.bucket_cap_mb={c.ddp.bucket_cap_mb}: must be positive, e.g. 25")
    out += flash_attention_problems(c)
    if c.hardware.memory_bytes <= 0:
        out.append(f"hardware.memory_bytes={c.hardware.memory_bytes}: must be positive")
    if c.model.trust_remote_code and not set_true_on_command_line(
            "model.trust_remote_code", sys.argv[1:] if argv is None else argv):
        out.append("model.trust_remote_code: may only be enabled on the command line "
                   "(model.trust_remote_code=true), never from a config or recipe file")
    return out


def flash_attention_problems(c: LauncherConfig) -> list[str]:
    """FlashAttention-2 runs on Ampere and newer only (flash-attn README, "FlashAttention-2 currently
    supports: Ampere, Ada, or Hopper GPUs"; its kernels refuse older GPUs with "FlashAttention only
    supports Ampere GPUs or newer", csrc/flash_attn/flash_api.cpp): on a profile below sm80 the run
    would stop at its first step. SDPA runs there, without its flash backend (PyTorch's SDPA
    dispatch, aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, takes flash from sm80 on)."""
    hw = c.hardware
    if hw.device != "cuda" or not 0 < hw.sm_arch < 80:
        return []
    return [f"{key}=flash_attention_2: FlashAttention-2 needs an Ampere or newer GPU (sm80+) and "
            f"hardware={hw.name} is sm{hw.sm_arch}; use {key}=sdpa"
            for key, attn in (("training.attn_implementation", c.training.attn_implementation),
                              ("inference.attn_implementation", c.inference.attn_implementation))
            if attn.name == "flash_attention_2"]

"""From the chosen candidate to a torchrun command: write run.json, the framework config and the
exact command into the run directory; start it when asked."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.config import LauncherConfig
from launcher.model import ModelSpec, effective_attention
from launcher.runspec import RunSpec
from launcher.shell import shell_word  # quotes, but keeps ${MASTER_ADDR}/${RUN_ID} expandable
from launcher.types import Candidate, Plan, Strategy
from launcher.backends import registry
from launcher.emit import emit
from launcher.recipes import installed_versions # provenance of measured numbers (recipe_from=)
from launcher.errors import ConfigError


@dataclass(frozen=True)
class Job:
    argv: tuple[str, ...]
    env: dict
    run_dir: Path
    world_size: int

    @property
    def command_line(self) -> str:
        return " ".join(shell_word(a) for a in self.argv)


def worker_python(backend: str, strategy: str) -> str:
    """The Python the ranks of `strategy` run with: the backend's choice (`Backend.interpreter`,
    e.g. ColossalAI's shardformer strategies in the environment with its transformers version),
    else the launcher's own."""
    hook = registry.get(backend).interpreter
    template = registry.STRATEGIES.get(strategy) or Strategy(strategy, backend)
    return (hook(template) if hook else None) or sys.executable


def torchrun_argv(config: LauncherConfig, run_json: Path, python: str = sys.executable) -> list[str]:
    """torchrun (torch.distributed.run) for this plan, run by `python` (`worker_python`): one process
    per GPU (per CPU rank with hardware=cpu); single node uses --standalone, several nodes a c10d
    rendezvous."""
    per_node = config.gpus // config.nodes
    argv = [python, "-m", "torch.distributed.run", f"--nproc-per-node={per_node}"]
    if config.nodes == 1:
        argv.append("--standalone")
    else:
        argv += [f"--nnodes={config.nodes}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint=${{MASTER_ADDR}}:{config.launch.master_port}", "--rdzv-id=${RUN_ID}"]
    argv.append(f"--max-restarts={config.launch.max_restarts}")
    argv += ["-m", "launcher.worker", str(run_json)]
    return argv


def run_spec(c: Candidate, config: LauncherConfig, spec: ModelSpec, run_dir: Path, framework: dict) -> RunSpec:
    t = config.training
    return RunSpec(
        run_dir=str(run_dir), backend=c.strategy.backend, strategy=c.strategy.name, model_name=spec.name,
        hf_config=spec.hf_config, init=config.init.name, pretrained_path=config.model.pretrained_path,
        tokenizer_path=config.model.tokenizer_path, trust_remote_code=config.model.trust_remote_code,
        device=config.hardware.device, precision=t.precision.name, optimizer=t.optimizer.name,
        attn_implementation=registry.backend_of(c.strategy).attention_of(
            c.strategy, spec.model_type, effective_attention(spec, t.attn_implementation.name)[0]),
        gradient_checkpointing=t.gradient_checkpointing or c.gradient_checkpointing,
        checkpoint_policy=t.checkpoint_policy.name, liger_kernel=t.liger_kernel,
        liger_kernels=tuple(t.liger_kernels), peft=c.peft or {},
        seq_len=t.seq_len, micro_batch_size=c.micro_batch_size, grad_accum_steps=c.grad_accum_steps,
        max_steps=t.max_steps, learning_rate=t.learning_rate, weight_decay=t.weight_decay,
        sgd_momentum=t.sgd_momentum, max_grad_norm=t.max_grad_norm, optimizer_in_backward=t.optimizer_in_backward,
        zero_grad_set_to_none=t.zero_grad_set_to_none,
        warmup_steps=t.warmup_steps, seed=t.seed,
        data_path=config.data.path, text_key=config.data.text_key, framework_config=framework,
        measure_memory=True, checkpoint_every=config.checkpoint.every_steps, checkpoint_keep=config.checkpoint.keep,
        resume=config.resume,
        estimate={"peak_allocated_bytes": c.memory.peak_allocated_bytes,
                  "peak_reserved_bytes": c.memory.peak_reserved_bytes,
                  "device_total_bytes": c.memory.device_total_bytes, "step_s": c.speed.step_s,
                  "breakdown": dict(c.memory.breakdown),
                  "per_rank_peak_allocated_bytes": list(c.memory.per_rank_peak_allocated_bytes)},
    )


def job_env(config: LauncherConfig) -> dict:
    """Environment of the torchrun command: threads per rank, restart and testing settings."""
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, config.gpus // config.nodes)))}
    if config.launch.max_restarts > 0:
        # Restarted workers must not share torchrun's rendezvous store: keys of the previous attempt
        # (gloo/NCCL addresses) would be read again (https://github.com/pytorch/pytorch/issues/135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if config.worker.simulate_oom_above_bytes is not None:  # testing aid, launcher/worker/oom.py
        env["LAUNCHER_SIMULATE_OOM_ABOVE_BYTES"] = str(config.worker.simulate_oom_above_bytes)
    return env


def prepare(plan: Plan, config: LauncherConfig, spec: ModelSpec, run_dir: Path) -> Job:
    """Write run.json, the emitted framework config and launch_command.sh; return the Job."""
    c = plan.candidates[plan.chosen]
    dp = config.gpus // (c.strategy.tp_size * c.strategy.pp_size)
    filename, framework = emit(c.strategy, training=config.training, knobs=registry.knobs(config),
                               micro_batch_size=c.micro_batch_size, grad_accum_steps=c.grad_accum_steps, dp_size=dp,
                               device=config.hardware.device, vocab_size=spec.vocab_size)
    (run_dir / filename).write_text(json.dumps(framework, indent=2, sort_keys=True) + "\n")
    run_json = run_dir / "run.json"
    run_spec(c, config, spec, run_dir, framework).save(run_json)
    argv = torchrun_argv(config, run_json, worker_python(c.strategy.backend, c.strategy.name))
    env = job_env(config)
    job = Job(tuple(argv), env, run_dir, config.gpus)
    script = ["#!/usr/bin/env bash", "# Re-run this training exactly as launched.", "set -euo pipefail",
              *(f"export {k}={shlex.quote(v)}" for k, v in env.items()), job.command_line, ""]
    path = run_dir / "launch_command.sh"
    path.write_text("\n".join(script))
    path.chmod(0o755)

    (run_dir / "versions.json").write_text(json.dumps(installed_versions(), indent=2, sort_keys=True) + "\n")
    return job


def check(job: Job) -> None:
    """Validate run.json in one process (model, tokenizer, dataset, framework config) before
    torchrun starts, so a bad input is one line, not a failure on every rank."""
    run_json = job.argv[-1]
    proc = subprocess.run([job.argv[0], "-m", "launcher.worker", "--check", run_json],
                          env={**os.environ, **job.env, "WORLD_SIZE": str(job.world_size)},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        last = proc.stderr.strip().splitlines()[-1:] or [f"input check exited with code {proc.returncode}"]
        raise ConfigError(lines[-1].removeprefix("error: ") if lines else last[0])


def execute(job: Job, quiet: bool = False, log_name: str = "train.log") -> int:
    """Check, then run torchrun in the foreground; the worker's rank 0 prints progress; with
    `quiet` its output goes to train.log in the run directory. Returns torchrun's exit code."""
    check(job)
    env = {**os.environ, **job.env}
    if not quiet:
        return subprocess.run(job.argv, env=env).returncode
    with open(job.run_dir / log_name, "x") as log:
        return subprocess.run(job.argv, env=env, stdout=log, stderr=subprocess.STDOUT).returncode

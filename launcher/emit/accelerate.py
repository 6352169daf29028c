"""Accelerate's config file and the launcher command lines for a candidate: pure functions.

`accelerate_config` is the dict `accelerate launch --config_file` reads
(accelerate/commands/config/config_args.py `ClusterConfig`; every key is one of its fields): the
keys every launch shares here, and those of the candidate's backend (`Backend.accelerate`: torch
DDP's MULTI_GPU, MULTI_CPU or NO, DeepSpeed's DEEPSPEED pointing at its stand-alone config). A
backend without them (ColossalAI) gets no Accelerate config; FSDP writes its own through its
exports.

`command_lines` gives the same job as `torchrun`, `accelerate launch` and a backend's own
launchers (`Backend.launch_commands`: DeepSpeed's `deepspeed`), each starting
`-m launcher.worker run.json` as launch_command.sh does.
"""
from __future__ import annotations

from typing import Optional

from launcher.backends.registry import backend_of
from launcher.types import Strategy

MIXED_PRECISION = {"bf16-mixed": "bf16", "16-mixed": "fp16"}
"""Lightning precision -> Accelerate `mixed_precision`; every other precision is 'no' (the
model is built in its dtype by the training script)."""


def accelerate_unsupported(strategy: Strategy) -> Optional[str]:
    """Why this strategy gets no Accelerate config here, or None."""
    if backend_of(strategy).accelerate:
        return None
    return (f"{strategy.name}: Accelerate's config is written for torch DDP and DeepSpeed candidates "
            f"(FSDP's by its own exports), not for the {strategy.backend} backend's")


def accelerate_config(strategy: Strategy, precision: str, num_processes: int, num_machines: int,
                      device: str, run_dir: Optional[str] = None, master_port: int = 29500) -> dict:
    """The Accelerate ClusterConfig for `strategy` on `num_processes` ranks over `num_machines`;
    `run_dir`: where the files the backend's keys name are written."""
    reason = accelerate_unsupported(strategy)
    if reason:
        raise ValueError(reason)
    config: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "num_processes": num_processes,
        "num_machines": num_machines,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": MIXED_PRECISION.get(precision, "no"),
        "rdzv_backend": "static" if num_machines == 1 else "c10d",
        "same_network": True,
        "use_cpu": device == "cpu",
        "debug": False,
    }
    if num_machines > 1:
        config["main_process_port"] = master_port
    config.update(backend_of(strategy).accelerate(strategy, device, run_dir))
    return config


def command_lines(*, num_processes: int, num_machines: int, run_json: str, master_port: int,
                  accelerate_file: Optional[str], strategy: Optional[Strategy] = None) -> dict[str, list[str]]:
    """argv of each launcher that starts the job: 'torchrun' always, those of `strategy`'s backend
    (`Backend.launch_commands`), 'accelerate' when an Accelerate config was written."""
    per_node = num_processes // num_machines
    worker = ["-m", "launcher.worker", run_json]
    out = {"torchrun": ["torchrun", f"--nproc-per-node={per_node}"]
           + (["--standalone"] if num_machines == 1 else
              [f"--nnodes={num_machines}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=${{MASTER_ADDR}}:{master_port}", "--rdzv-id=${RUN_ID}"]) + worker}
    own = backend_of(strategy).launch_commands if strategy is not None else None
    if own:
        out.update(own(per_node, num_machines, run_json, master_port))
    if accelerate_file:
        out["accelerate"] = ["accelerate", "launch", f"--config_file={accelerate_file}", *worker]
    return out

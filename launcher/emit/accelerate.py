"""Accelerate's config file and the launcher command lines for a candidate: pure functions.

`accelerate_config` is the dict `accelerate launch --config_file` reads
(accelerate/commands/config/config_args.py `ClusterConfig`; every key is one of its fields).
A DeepSpeed candidate points `deepspeed_config.deepspeed_config_file` at the stand-alone
DeepSpeed config (launcher/backends/deepspeed/standalone.py); torch DDP becomes Accelerate's MULTI_GPU, or
MULTI_CPU with `use_cpu` on CPU processes, and one process without a wrapper (`single`) NO.
ColossalAI has no Accelerate equivalent.

`command_lines` gives the same job as `torchrun`, `deepspeed` and `accelerate launch` commands,
each starting `-m launcher.worker run.json` as launch_command.sh does.
"""
from __future__ import annotations

from typing import Optional

from launcher.types import Strategy

MIXED_PRECISION = {"bf16-mixed": "bf16", "16-mixed": "fp16"}
"""Lightning precision -> Accelerate `mixed_precision`; every other precision is 'no' (the
model is built in its dtype by the training script)."""


def accelerate_unsupported(strategy: Strategy) -> Optional[str]:
    """Why Accelerate cannot express this strategy, or None."""
    if strategy.backend in ("ddp", "deepspeed"):
        return None
    return f"{strategy.name} is a ColossalAI plugin; Accelerate launches torch DDP, DeepSpeed and FSDP only"


def accelerate_config(strategy: Strategy, precision: str, num_processes: int, num_machines: int,
                      device: str, ds_config_file: Optional[str] = None, master_port: int = 29500) -> dict:
    """The Accelerate ClusterConfig for `strategy` on `num_processes` ranks over `num_machines`."""
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
    if strategy.backend == "deepspeed":
        if not ds_config_file:
            raise ValueError("a DeepSpeed candidate needs the stand-alone DeepSpeed config file")
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {"deepspeed_config_file": ds_config_file,
                                      "zero3_init_flag": strategy.zero_stage == 3}
    elif strategy.name == "single":  # one process, no data-parallel wrapper
        config["distributed_type"] = "NO"
    else:
        config["distributed_type"] = "MULTI_CPU" if device == "cpu" else "MULTI_GPU"
    return config


def command_lines(*, num_processes: int, num_machines: int, run_json: str, master_port: int,
                  accelerate_file: Optional[str], deepspeed: bool) -> dict[str, list[str]]:
    """argv of each launcher that starts the job: 'torchrun' always, 'deepspeed' for a DeepSpeed
    candidate, 'accelerate' when an Accelerate config was written."""
    per_node = num_processes // num_machines
    worker = ["-m", "launcher.worker", run_json]
    out = {"torchrun": ["torchrun", f"--nproc-per-node={per_node}"]
           + (["--standalone"] if num_machines == 1 else
              [f"--nnodes={num_machines}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=${{MASTER_ADDR}}:{master_port}", "--rdzv-id=${RUN_ID}"]) + worker}
    if deepspeed:
        nodes = ([] if num_machines == 1 else
                 ["--hostfile=hostfile", f"--master_port={master_port}"])
        out["deepspeed"] = ["deepspeed", f"--num_gpus={per_node}", f"--num_nodes={num_machines}", *nodes,
                            "--no_local_rank", "--module", "launcher.worker", run_json]
    if accelerate_file:
        out["accelerate"] = ["accelerate", "launch", f"--config_file={accelerate_file}", *worker]
    return out

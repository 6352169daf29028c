"""Keyword arguments for torch.nn.parallel.DistributedDataParallel (torch/nn/parallel/distributed.py).

- bucket_cap_mb, gradient_as_bucket_view, static_graph: from `DDPConfig`, the same values the
  estimators read.
- find_unused_parameters=False: a causal LM uses every trainable parameter in each forward
  (embeddings, every layer, final norm, LM head; frozen PEFT base weights do not require grad and
  DDP ignores them). True would add a graph traversal after every forward, and it breaks
  reentrant gradient checkpointing (transformers' Trainer turns it off under checkpointing for
  that reason, trainer.py `create_accelerator_and_postprocess`).
- no buffer broadcast before each forward: the buffers of transformers decoders (rotary
  `inv_freq`, causal-mask helpers) are computed identically on every rank from the config and
  never updated by training, so re-broadcasting them from rank 0 only costs a collective. torch
  2.13 renamed the flag: `forward_sync_buffers=False` (buffers still synced once at init) replaces
  the deprecated `broadcast_buffers=False`; the name the installed torch accepts is used.
"""
from __future__ import annotations

import re

from launcher.config import DDPConfig
from launcher.environment import installed_version


def buffer_sync_kwarg() -> str:
    """`forward_sync_buffers` on torch >= 2.13, else `broadcast_buffers`
    (torch/nn/parallel/distributed.py DistributedDataParallel.__init__), from the installed
    version, so a plan does not import torch."""
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", installed_version("torch") or "0.0").groups())
    return "forward_sync_buffers" if (major, minor) >= (2, 13) else "broadcast_buffers"


def ddp_settings(ddp: DDPConfig) -> dict:
    """DistributedDataParallel(module, **ddp_settings(ddp))."""
    return {
        "bucket_cap_mb": float(ddp.bucket_cap_mb),
        "gradient_as_bucket_view": bool(ddp.gradient_as_bucket_view),
        "static_graph": bool(ddp.static_graph),
        "find_unused_parameters": False,
        buffer_sync_kwarg(): False,
    }


def accelerate_keys(strategy, device: str, run_dir=None) -> dict:
    """Accelerate's launch of torch DDP (accelerate/commands/config/config_args.py `ClusterConfig`):
    MULTI_GPU, or MULTI_CPU on CPU processes; one process without a wrapper (`single`) NO."""
    if strategy.name == "single":
        return {"distributed_type": "NO"}
    return {"distributed_type": "MULTI_CPU" if device == "cpu" else "MULTI_GPU"}

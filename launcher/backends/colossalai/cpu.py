"""ColossalAI on CPU processes: the CPU shim the worker applies before `launch_from_torch` when a
run's device is cpu (launcher/backends/colossalai/worker.py `launch`). Never applied on CUDA.

ColossalAI 0.5.0 picks its CPU accelerator by itself on a gloo process group
(colossalai/accelerator/cpu_accelerator.py `CpuAccelerator`), but that accelerator raises "this
method is not supported for cpu accelerator" for the RNG-state, seeding, stream/event,
synchronize, device-query and memory-statistics methods that LowLevelZeroPlugin and
HybridParallelPlugin call on every step; its `get_rng_state(device)` passes the device to
`torch.get_rng_state()`, which takes no argument; and `LowLevelZeroOptimizer._sanity_checks`
asserts the accelerator is cuda or npu; the pipeline's p2p check (colossalai/pipeline/p2p.py
`_check_for_nccl_hccl_backend`) calls `torch.distributed.is_hccl_available`, which a CPU build
of torch newer than ColossalAI's pin lacks (on CUDA builds `is_nccl_available()` short-circuits
it); and ColossalAI's GPT-2 forward calls `torch.cuda.set_device(hidden_states.device)` before
each block (colossalai/shardformer/modeling/gpt2.py `gpt2_model_forward`), which raises for a CPU
device, and its gather of GPT-2's fused QKV weight for an unsharded checkpoint moves the shard
to CUDA (colossalai/shardformer/layer/qkv_fused_linear.py `gather_fused_qkv_in_gpt2_style`:
`qkv.cuda()`). `apply()` replaces those methods with CPU equivalents
(torch's CPU RNG) or no-ops (CPU ops are synchronous: streams and events have nothing to wait
for), makes `torch.cuda.set_device` ignore CPU devices, runs the fused-QKV gather with
`Tensor.cuda` answering the tensor itself, and keeps the sanity check's dtype test. None of this allocates tensors, so the memory a
CPU run measures is ColossalAI's own. The emitter turns off communication overlap on CPU
(launcher/backends/colossalai/emit.py), which would need streams.

GeminiPlugin is not made to run: it has no fp32 path on CPU and its bf16 chunk handling fails.
"""
from __future__ import annotations

import contextlib


class _CpuStream:
    """Stands for a CUDA stream: CPU work is synchronous, so every wait is already satisfied."""

    def wait_stream(self, other) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event=None):
        return event or _CpuEvent()

    def query(self) -> bool:
        return True


class _CpuEvent:
    def record(self, stream=None) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _replacements(torch) -> dict:
    zero = lambda *a, **k: 0  # noqa: E731
    none = lambda *a, **k: None  # noqa: E731
    return {
        "current_device": lambda self: 0,
        "set_device": none,
        "get_device_name": lambda self, *a, **k: "cpu",
        "synchronize": none,
        "device_count": lambda self: 1,
        "get_device_capability": lambda self, *a, **k: (0, 0),
        "get_device_properties": none,
        "utilization": zero,
        "get_rng_state": lambda self, device=None: torch.get_rng_state(),
        "get_rng_state_all": lambda self: [torch.get_rng_state()],
        "set_rng_state": lambda self, new_state, device=None: torch.set_rng_state(new_state),
        "set_rng_state_all": lambda self, new_states: torch.set_rng_state(new_states[0]),
        "manual_seed": lambda self, seed: torch.manual_seed(seed),
        "manual_seed_all": lambda self, seed: torch.manual_seed(seed),
        "seed": lambda self: torch.seed(),
        "seed_all": lambda self: torch.seed(),
        "initial_seed": lambda self: torch.initial_seed(),
        "empty_cache": none,
        "memory_stats": lambda self, *a, **k: {},
        "memory_summary": lambda self, *a, **k: "",
        "memory_snapshot": lambda self: [],
        "memory_allocated": zero,
        "max_memory_allocated": zero,
        "reset_max_memory_allocated": none,
        "reset_max_memory_cached": none,
        "memory_reserved": zero,
        "max_memory_reserved": zero,
        "set_per_process_memory_fraction": none,
        "reset_peak_memory_stats": none,
        "Stream": lambda self, *a, **k: _CpuStream(),
        "Event": lambda self, *a, **k: _CpuEvent(),
        "current_stream": lambda self, *a, **k: _CpuStream(),
        "default_stream": lambda self, *a, **k: _CpuStream(),
        "set_stream": none,
        "stream": lambda self, stream_: contextlib.nullcontext(),
    }


def _dtype_checks_only(self) -> None:
    """`LowLevelZeroOptimizer._sanity_checks` without its `accelerator in (cuda, npu)` assert."""
    for group in self.optim.param_groups:
        for param in group["params"]:
            if not getattr(param, "skip_zero_check", False):
                assert param.dtype == self._dtype, (
                    f"Parameters are expected to have the same dtype `{self._dtype}`, but got `{param.dtype}`")


_MARK = "_launcher_cpu_shim"


def _ignoring_cpu(set_device, torch):
    def wrapped(device):
        if isinstance(device, torch.device) and device.type == "cpu" or device == "cpu":
            return None
        return set_device(device)

    setattr(wrapped, _MARK, True)
    return wrapped


def _tensors_stay_on_cpu(fn, torch):
    def wrapped(*args, **kwargs):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    setattr(wrapped, _MARK, True)
    return wrapped


def apply() -> list[str]:
    """Patch ColossalAI's CPU accelerator and LowLevelZero's sanity check; returns the names of
    the replaced accelerator methods. Idempotent."""
    import torch
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    replaced = []
    for name, fn in _replacements(torch).items():
        if hasattr(CpuAccelerator, name):
            setattr(CpuAccelerator, name, fn)
            replaced.append(name)
    LowLevelZeroOptimizer._sanity_checks = _dtype_checks_only
    if not getattr(torch.cuda.set_device, _MARK, False):
        torch.cuda.set_device = _ignoring_cpu(torch.cuda.set_device, torch)
    from colossalai.shardformer.layer import qkv_fused_linear

    gather = qkv_fused_linear.gather_fused_qkv_in_gpt2_style
    if not getattr(gather, _MARK, False):
        qkv_fused_linear.gather_fused_qkv_in_gpt2_style = _tensors_stay_on_cpu(gather, torch)
    if not hasattr(torch.distributed, "is_hccl_available"):
        torch.distributed.is_hccl_available = lambda: False
    return replaced

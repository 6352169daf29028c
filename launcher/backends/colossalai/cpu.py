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

One collective is replaced as well: LowLevelZero's partitioned-gradient reduction
(colossalai/zero/low_level/low_level_optim.py `_run_reduction`, ZeRO-2, also HybridParallelPlugin's
zero_stage 2) calls `dist.reduce_scatter_tensor(received_grad, flat_grads)`, which gloo runs by
reducing into a copy of the whole flat bucket (`reduce_scatter_single` -> ProcessGroupGloo's
reduce-scatter work, torch/csrc/distributed/c10d/ProcessGroupGloo.cpp) that its worker thread
releases at a moment the scheduler picks. That copy is one more bucket of gradients that NCCL
does not allocate: with gradient checkpointing the post-backward reduction is the step's peak,
and a real CPU run measured it 9% (bf16) and 20% (fp32) above the NCCL layout the estimator models
(launcher/backends/colossalai/layout.py `lowlevel_zero_layout`). `_InPlaceReduceScatter` makes
it an in-place all-reduce of the flat bucket (which `_run_reduction` keeps alive past the call
anyway) and a copy of this rank's chunk into `received_grad`, the same result and the same
storages as NCCL's reduce-scatter, at twice its traffic; the FSDP2 worker does the same for its
reduce-scatter (launcher/backends/fsdp2/worker.py `gloo_reduce_scatter`).

The shardformer's own collectives (colossalai/shardformer/layer/_operation.py, loss.py) keep
running on gloo, but return only once gloo's worker thread has let go of their tensors
(`_SettledCollectives`). ProcessGroupGloo's `runLoop` resets its reference to a finished work
(`workInProgress_[i].reset()`) after `AsyncWork::execute` has completed it, so a caller's `wait()`
can return while the work still holds its tensors. The column-parallel linear's input gradient
(`LinearWithAsyncCommunication.backward`: `dist.all_reduce(grad_input, async_op=True)`, then
`handle.wait()`) then outlives the autograd node that frees it, at the backward peak of some runs
and not of others. NCCL holds no such reference: after `wait()` only the caller's handle keeps the
tensor (ProcessGroupNCCL.cpp `WorkNCCL::synchronizeStream` unstashes it; the watchdog's copy of
the work is made without `outputs_`), and the caching allocator stops counting a block when its
last reference is dropped (`DeviceCachingAllocator::free` decreases `allocated_bytes` before it
inserts stream events). Waiting for gloo's thread (a spin on the tensors' reference counts, at
most a second) makes a CPU run hold what a GPU run holds, and allocates nothing. An async call runs
blocking: settled at `wait()` to the count read then, less the references the work took at the
call, it spun for its full second whenever gloo had already let go (the count fell below the
caller's own), and once gloo completes a work its future holds the outputs too, so the work's
references at `wait()` cannot be told from the caller's. gloo's thread also holds a Python
reference to the tensor for a while after its C++ references are gone, and drops it only when it
gets the GIL; settling waits for both counts (launcher/worker/gloo.py). When it waited for the C++
count alone, a tensor-parallel BLOOM run read, on one rank in 11 of 62 runs here (each of the 11
while other test processes ran), the column-parallel linear's input gradient (32,768 bytes) above
the estimate: the caller had dropped it, and gloo's thread (pt_gloo_runloop) freed it past the
backward peak.

GeminiPlugin is not made to run: it has no fp32 path on CPU and its bf16 chunk handling fails.
"""
from __future__ import annotations

import contextlib

from launcher.worker.gloo import references, settle


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


class _InPlaceReduceScatter:
    """`torch.distributed` as low_level_optim.py sees it (its module global `dist`), but for
    `reduce_scatter_tensor`: an in-place all-reduce of the input, then this rank's chunk copied
    into the output (allocates nothing; see the module docstring)."""

    def __init__(self, dist) -> None:
        self._dist = dist
        setattr(self, _MARK, True)

    def __getattr__(self, name):
        return getattr(self._dist, name)

    def reduce_scatter_tensor(self, output, input, op=None, group=None, async_op=False):
        dist = self._dist
        if async_op:  # overlap_communication, off on CPU (emit.py): gloo's own, unchanged
            return dist.reduce_scatter_tensor(output, input, op=op or dist.ReduceOp.SUM, group=group, async_op=True)
        dist.all_reduce(input, op=op or dist.ReduceOp.SUM, group=group)
        output.copy_(input.view(dist.get_world_size(group), -1)[dist.get_rank(group)])
        return None


class _Done:
    """The handle of a collective that has already run and settled (`_SettledCollectives`)."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _SettledCollectives:
    """`torch.distributed` as the shardformer's layer modules see it (their module global `dist`),
    with all_reduce, all_gather and reduce_scatter returning only after gloo's worker thread has
    released their tensors, an async call run blocking (see the module docstring)."""

    NAMES = ("all_reduce", "all_gather", "reduce_scatter")

    def __init__(self, dist) -> None:
        self._dist = dist
        setattr(self, _MARK, True)

    def __getattr__(self, name):
        attribute = getattr(self._dist, name)
        return self._settled(attribute) if name in self.NAMES else attribute

    @staticmethod
    def _settled(collective):
        """An async call runs blocking and returns a finished handle (module docstring): only a
        blocking call, whose caller holds nothing of the work after it returns, can be settled to
        the counts before it. On CPU the overlap lost is that of the column-parallel linear's
        input-gradient all-reduce with its weight-gradient matmul; the tensors live as long."""
        def call(*args, **kwargs):
            tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else [a])
                       if hasattr(t, "_use_count")]
            counts = references(tensors)
            asked_async = kwargs.pop("async_op", False)
            work = collective(*args, **kwargs)
            settle(tensors, counts)
            return _Done() if asked_async else work

        return call


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
    """Patch ColossalAI's CPU accelerator, LowLevelZero's sanity check and its gradient
    reduce-scatter, and settle the shardformer's collectives; returns the names of the replaced
    accelerator methods. Idempotent."""
    import torch
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    replaced = []
    for name, fn in _replacements(torch).items():
        if hasattr(CpuAccelerator, name):
            setattr(CpuAccelerator, name, fn)
            replaced.append(name)
    LowLevelZeroOptimizer._sanity_checks = _dtype_checks_only
    from colossalai.zero.low_level import low_level_optim

    if not getattr(low_level_optim.dist, _MARK, False):
        low_level_optim.dist = _InPlaceReduceScatter(low_level_optim.dist)
    from colossalai.shardformer.layer import _operation, loss

    for module in (_operation, loss):
        if not getattr(module.dist, _MARK, False):
            module.dist = _SettledCollectives(module.dist)
    if not getattr(torch.cuda.set_device, _MARK, False):
        torch.cuda.set_device = _ignoring_cpu(torch.cuda.set_device, torch)
    from colossalai.shardformer.layer import qkv_fused_linear

    gather = qkv_fused_linear.gather_fused_qkv_in_gpt2_style
    if not getattr(gather, _MARK, False):
        qkv_fused_linear.gather_fused_qkv_in_gpt2_style = _tensors_stay_on_cpu(gather, torch)
    if not hasattr(torch.distributed, "is_hccl_available"):
        torch.distributed.is_hccl_available = lambda: False
    return replaced

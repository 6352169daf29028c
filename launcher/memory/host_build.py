"""On CPU processes, building the model is part of the run's peak: the worker builds the whole
model on the host (launcher/worker/model.py `build_model`: `from_config` or `from_pretrained`,
then peft) before any backend shards, partitions or wraps it, and on CPU processes the host is
the device. Its parameters and buffers, in the dtype the worker builds them in
(launcher/precision.py `model_dtype`), are all alive, with the construction's own temporaries: a model that ties its
LM head to the embeddings first allocates the head's weight, then `tie_weights` drops it. The
traced step records that build (launcher/trace.py, phase `build`); its peak, extrapolated to the
real depth, is the run's `setup` peak when it exceeds the step's: a sharded strategy (FSDP2,
ZeRO-3) whose step holds only a shard of the weights, adapters on a large frozen base, short
sequences (opt-125m LoRA under fsdp2 at 8 tokens on 2 processes: 312.5 MiB at setup, against a
step of 301.7).

On GPUs the build is on the host. A strategy that shards the model takes it from there, a part
at a time (the worker classes' `MOVES_MODEL`): FSDP2's `fully_shard` one block
(launcher/backends/fsdp2/worker.py), ZeRO-3 one parameter (launcher/backends/deepspeed/worker.py
`_partition_on_host`), Gemini one chunk and the tensor- and pipeline-parallel plugin the rank's
shard (launcher/backends/colossalai/worker.py `plugin_moves_model`), so the whole model is never
on the device. The others keep the whole model on each GPU and the worker moves it there first:
below the step's peak, which holds it too.

Tensor- and pipeline-parallel strategies build the whole model too: their build is read from
the unsharded step (a tensor-parallel trace holds one rank's shard; a pipeline's, every layer).
On GPUs the build is checked against the node's host RAM instead (launcher/planner.py
`HOST_BUILD_NOTE`): every rank builds at once.

Not modelled: quantized bases (bitsandbytes' and GPTQ's construction differs from the trace's
stand-ins).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from launcher.memory.common import CATEGORIES, DTYPE_BYTES
from launcher.precision import model_dtype
from launcher.steptrace import TraceSet, event_curve
from launcher.types import MemoryEstimate, Strategy, Workload


def build_peak_bytes(traces: TraceSet, traced_dtype: str, build_dtype: str) -> int:
    """Peak live bytes of the traced `build` phase at the real depth (`TraceSet.phase_max`), with
    the storages traced in `traced_dtype` (the strategy's trace holds the model as its framework
    computes with it) counted in `build_dtype` (what the worker builds): adapters that peft keeps
    in fp32 on a 16-bit model, integer buffers and inputs keep their own size."""
    traced, built = DTYPE_BYTES[traced_dtype], DTYPE_BYTES[build_dtype]

    def curve(t):
        nbytes = t.nbytes
        if traced != built:
            nbytes = np.where(t.itemsize == traced, nbytes // traced * built, nbytes)
        return event_curve(t.alloc, t.free, nbytes, t.num_events)
    return int(round(traces.phase_max("build", curve)))


def host_build_bytes(traces: TraceSet, strategy: Strategy, workload: Workload, traced_dtype: str,
                     quantized: bool) -> int:
    """What one rank's build of the whole model peaks at on the host (`build_peak_bytes` in the
    dtype the worker builds it in), from `traces` of the whole model (a tensor-parallel
    candidate's are its unsharded step: launcher/planner.py `whole_model_traces`); 0 where not
    modelled (quantized bases)."""
    if quantized:
        return 0
    return build_peak_bytes(traces, traced_dtype, model_dtype(workload.precision, strategy.backend))


def with_host_build(mem: MemoryEstimate, build: int, dtype: str) -> MemoryEstimate:
    """`mem` on CPU processes, where the host is the device, with `build` (`host_build_bytes`,
    built in `dtype`) as its `setup` phase where that is the larger, on every rank (each builds
    the whole model)."""
    if not build:
        return mem
    note = (f"CPU processes: building the whole model on the host ({dtype}) peaks at "
            f"{build / 2**20:.1f} MiB (parameters, buffers and construction temporaries, traced); "
            "the peak is the larger of that and the step's.")
    if build <= mem.peak_allocated_bytes:
        return replace(mem, notes=tuple(mem.notes) + (note,))
    per_rank = tuple(max(b, build) for b in mem.per_rank_peak_allocated_bytes)
    breakdown = {**dict.fromkeys(CATEGORIES, 0), "parameters": build, "runtime": 0}
    return replace(mem, peak_allocated_bytes=build, peak_reserved_bytes=build, device_total_bytes=build,
                   breakdown=breakdown, peak_phase="setup", notes=tuple(mem.notes) + (note,),
                   per_rank_peak_allocated_bytes=per_rank)

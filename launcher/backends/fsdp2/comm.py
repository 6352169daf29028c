"""FSDP2's communication per optimizer step and how much of it compute hides (the speed model's
comm term, in the style of launcher/speed.py `_zero3_comm`).

Per micro-batch, every `fully_shard` group (each decoder block, and the root):
- all-gathers its parameters in forward (world x padded shard numel in the param dtype:
  _fsdp_collectives.py `foreach_all_gather`), and again in backward when it resharded after
  forward (the backward prefetch, `_backward_prefetch`): with `reshard_after_forward=True` every
  block, but the last one only with fsdp2.keep_last_block=false (rules.py `keep_last_block`), and
  never the root (`_lazy_init`);
- reduce-scatters its gradients in backward (`foreach_reduce`, in the reduce dtype), every
  micro-batch (FSDP2's default, the worker's).
Ring volumes: (n-1)/n x bytes for all-gather and reduce-scatter (launcher/speed.py `ring_time_s`;
ZeRO paper arXiv:1910.02054 sec. 7.2.2: 3 x (n-1)/n x S per step at full sharding, 2x with
reshard_after_forward=False), each call also `collective_latency_s`.

Overlap on GPUs: FSDP2 issues the next group's all-gather on its own stream while the current
group computes (implicit forward prefetch, _fsdp_param_group.py "overlap the next copy-in with
the current all-gather"; explicit backward prefetch of the previous block), and reduce-scatters
on a separate stream. So per block only what exceeds that block's compute is exposed, plus the
first all-gather of each pass (nothing to hide it) and the root's reduce-scatter in the final
callback (after the last compute). In backward every block but the first prefetches the block
before it; the first block's window hides only a reduce-scatter. On CPU processes (gloo) every
collective is synchronous: nothing overlaps.

Tensor parallelism adds the Megatron all-reduces of each layer (launcher/collectives.py
`tp_comm_s`).

CPU host terms (`host_equivalent`): torch DDP's (launcher/host_time.py), whose per-step all-reduce
of the gradients is what the worker's gloo reduce-scatter moves (an in-place all-reduce per block,
worker.py `gloo_reduce_scatter`), plus FSDP2's all-gathers at gloo's calibrated all-gather
bandwidth. DDP's optimizer term steps every parameter where FSDP2 steps 1/dp of them: the CPU
step time is overestimated by that share (not calibrated against FSDP2 runs).
"""
from __future__ import annotations

from dataclasses import dataclass

from launcher.backends.base import CommInput, HostEquivalent, default_group
from launcher.backends.fsdp2.rules import keep_last_block, mixed_precision, model_dtype, reshard_after_forward
from launcher.collectives import bus_bandwidth_gbps, ring_time_s, tp_comm_s
from launcher.host_time import _call_s, bus_gbps, torch_ddp
from launcher.memory.common import DTYPE_BYTES
from launcher.types import Strategy


@dataclass(frozen=True)
class FSDP2Comm:
    raw_s: float  # all collective time per optimizer step
    exposed_s: float  # what compute does not hide


def comm_bytes(precision: str) -> tuple[int, int]:
    """(param dtype bytes of the all-gathers, reduce dtype bytes of the reduce-scatters)."""
    mp = mixed_precision(precision)
    compute = mp["param_dtype"] or model_dtype(precision)
    return DTYPE_BYTES[compute], DTYPE_BYTES[mp["reduce_dtype"] or compute]


def fsdp2_comm(strategy: Strategy, cluster, *, num_params: int, num_trainable_params: int, num_layers: int,
               dp: int, accum: int, forward_s: float, backward_s: float, param_bytes: int,
               reduce_bytes: int, keep_last: bool = True) -> FSDP2Comm:
    """(raw, exposed) seconds per optimizer step of FSDP2's all-gathers and reduce-scatters over
    `dp` ranks. `forward_s`/`backward_s`: one micro-batch's compute; parameters split evenly over
    the `num_layers` blocks (the root's embeddings and head count as one more group).
    `keep_last`: the last block stays unsharded after forward (rules.py `keep_last_block`), else
    reshards like the others (fsdp2.keep_last_block=false, FSDP1's FULL_SHARD)."""
    if dp <= 1:
        return FSDP2Comm(0.0, 0.0)
    bus = bus_bandwidth_gbps(cluster)
    groups = num_layers + 1
    latency = cluster.collective_latency_s
    gather_block = ring_time_s(num_params / groups * param_bytes, dp, bus, "all_gather") + latency
    scatter_block = ring_time_s(num_trainable_params / groups * reduce_bytes, dp, bus, "reduce_scatter") + latency
    backward_gathers = resharded_blocks(strategy, num_layers, keep_last)
    raw = (groups * gather_block + backward_gathers * gather_block + groups * scatter_block) * accum
    if cluster.device == "cpu":
        return FSDP2Comm(raw, raw)
    fwd_block, bwd_block = forward_s / groups, backward_s / groups
    bwd_gather = gather_block if backward_gathers else 0.0
    first_gather = gather_block if backward_gathers == num_layers else 0.0  # a kept last block: none
    exposed_forward = gather_block + (groups - 1) * max(0.0, gather_block - fwd_block)
    # blocks L-1..1 each prefetch the block before them; block 0 has none to prefetch
    exposed_backward = (first_gather + (groups - 2) * max(0.0, bwd_gather + scatter_block - bwd_block)
                        + max(0.0, scatter_block - bwd_block) + scatter_block)
    return FSDP2Comm(raw, (exposed_forward + exposed_backward) * accum)


def resharded_blocks(strategy: Strategy, num_layers: int, keep_last: bool = True) -> int:
    """Groups all-gathered again in backward per micro-batch (module docstring): every block
    resharded after forward, the last one only when it is not kept."""
    if not reshard_after_forward(strategy):
        return 0
    return max(0, num_layers - int(keep_last))


def comm(x: CommInput, keep_last: bool = True) -> tuple:
    """(compute_s, raw comm_s, exposed comm_s, bytes per gradient element) for launcher/speed.py:
    FSDP2's collectives over the dp ranks (`fsdp2_comm`; with tp > 1 the parameter counts are
    the traced shard's) plus the tensor-parallel all-reduces (not overlapped). `keep_last`: false
    for FSDP1, whose FULL_SHARD reshards the last block too."""
    keep_last = keep_last and keep_last_block(x.strategy, x.knobs.get("fsdp2"))
    cb, rb = comm_bytes(x.workload.precision)
    layers = x.spec.num_layers if x.spec is not None else 1
    c = fsdp2_comm(x.strategy, x.cluster, num_params=x.num_params, num_trainable_params=x.trainable,
                   num_layers=layers, dp=x.dp, accum=x.accum, forward_s=x.forward_s, backward_s=x.backward_s,
                   param_bytes=cb, reduce_bytes=rb, keep_last=keep_last)
    tp_s = tp_comm_s(x.strategy, x.workload, x.cluster, x.spec, x.accum, cb)
    return x.compute_s, c.raw_s + tp_s, c.exposed_s + tp_s, rb


def host_equivalent(x: CommInput, keep_last: bool = True) -> HostEquivalent:
    """torch DDP's host terms (DDP's default 25 MiB buckets: the ddp group's settings are DDP's own)
    plus FSDP2's all-gathers (one per group and micro-batch, and one more per block resharded
    after forward) and the tensor-parallel all-reduces (module docstring)."""
    keep_last = keep_last and keep_last_block(x.strategy, x.knobs.get("fsdp2"))
    cb, _ = comm_bytes(x.workload.precision)
    groups = (x.spec.num_layers if x.spec is not None else 1) + 1
    layers = x.spec.num_layers if x.spec is not None else 1
    again = resharded_blocks(x.strategy, layers, keep_last) / groups  # the share gathered again in backward
    gathered = (1 + again) * x.accum * x.num_params * cb
    calls = (groups + resharded_blocks(x.strategy, layers, keep_last)) * x.accum
    extra = tp_comm_s(x.strategy, x.workload, x.cluster, x.spec, x.accum, cb)
    if x.dp > 1:
        ring = (x.dp - 1) / x.dp
        extra += _call_s(calls, gathered, ring, bus_gbps(x.cluster, "all_gather", cb, gathered / calls), x.cluster)
    return HostEquivalent(torch_ddp(), extra_comm_s=extra)


def communicators(strategy: Strategy, dp: int) -> tuple[int, ...]:
    """NCCL communicators of one rank (Backend.communicators): the default process group, which a
    DeviceMesh dimension over every rank reuses (torch/distributed/device_mesh.py
    `_init_one_process_group`: a dimension spanning the world takes the default group), and, for
    the 2-D ("dp", "tp") mesh (worker.py `init_device_mesh`), a new group per dimension over fewer
    ranks than the world."""
    world = default_group(strategy, dp)
    return (world, *(n for n in (dp, strategy.tp_size) if 1 < n < world))

"""FSDP1's communication per optimizer step: the same collectives as FSDP2's, per unit (each
decoder block and the root) and micro-batch: an all-gather of the unit's flat parameter in forward,
again in backward under FULL_SHARD, and a reduce-scatter of its flat gradient
(_runtime_utils.py `_unshard`, `_reduce_grad`), overlapped on GPUs by FSDP1's unshard and
post-backward streams with `BACKWARD_PRE` prefetch as FSDP2's are (launcher/backends/fsdp2/comm.py).
"""
from __future__ import annotations

from dataclasses import replace

from launcher.backends.base import CommInput, HostEquivalent
from launcher.backends.fsdp1.rules import reshard_after_forward
from launcher.backends.fsdp2 import comm as fsdp2_comm
from launcher.types import Strategy


def as_fsdp2(strategy: Strategy) -> Strategy:
    """The FSDP2 strategy with the same collectives (reshard after forward or not)."""
    return Strategy("fsdp2" if reshard_after_forward(strategy) else "fsdp2_grad_op", "fsdp2",
                    zero_stage=strategy.zero_stage)


def comm(x: CommInput) -> tuple:
    """FULL_SHARD reshards every block after forward, the last one too (only the root is kept:
    _runtime_utils.py "Do not free the root's parameters in the post-forward for FULL_SHARD")."""
    return fsdp2_comm.comm(replace(x, strategy=as_fsdp2(x.strategy)), keep_last=False)


def host_equivalent(x: CommInput) -> HostEquivalent:
    return fsdp2_comm.host_equivalent(replace(x, strategy=as_fsdp2(x.strategy)), keep_last=False)

"""Communication of torch DDP: one bucketed gradient all-reduce per optimizer step (under `no_sync`
accumulation), overlapped with backward except the last bucket (Li et al., PyTorch Distributed,
arXiv:2006.15704 sec. 3.2.3-3.2.4)."""
from __future__ import annotations

from launcher.backends.base import CommInput, HostEquivalent
from launcher.collectives import bucketed_reduction_s, bus_bandwidth_gbps
from launcher.host_time import torch_ddp

MIB = 2**20


def grad_bytes_per_elem(precision: str) -> int:
    """Bytes per gradient element on the wire: *-true the model dtype; mixed under autocast keeps
    fp32 parameters, so fp32 gradients."""
    if precision == "32-true":
        return 4
    return 2 if precision.endswith("-true") else 4


def ddp_reduction_s(x: CommInput, grad_bytes: float) -> tuple[float, float]:
    """(raw, exposed) seconds of DDP's bucketed all-reduce of `grad_bytes`."""
    return bucketed_reduction_s(grad_bytes, x.dp, bus_bandwidth_gbps(x.cluster), "all_reduce", 1,
                                x.knobs["ddp"].bucket_cap_mb * MIB, True, x.backward_s)


def comm(x: CommInput) -> tuple:
    elem = grad_bytes_per_elem(x.workload.precision)
    raw, exposed = ddp_reduction_s(x, x.trainable * elem)
    return x.compute_s, raw, exposed, elem


def host_equivalent(x: CommInput) -> HostEquivalent:
    return HostEquivalent(torch_ddp(x.knobs["ddp"].bucket_cap_mb))

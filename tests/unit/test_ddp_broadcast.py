"""DDP's construction-time state broadcast (launcher/backends/ddp/layout.py `broadcast_buckets`,
`broadcast_peak_bytes`) against torch's own `_broadcast_coalesced`, the call DDP's constructor
makes, run on a one-process gloo group with the live-storage tracker the worker measures with."""
import pytest
import torch
import torch.distributed as dist

from launcher.backends.ddp.layout import broadcast_buckets, broadcast_peak_bytes
from launcher.worker.storage_tracker import StorageTracker

# bf16 and fp32 tensors interleaved (the buckets are filled per dtype and broadcast in the order
# of their first tensor), sized so that the answer differs from the largest bucket and from the
# two largest buckets
MIXED = [(torch.bfloat16, 300), (torch.float32, 50), (torch.bfloat16, 700), (torch.bfloat16, 200),
         (torch.float32, 400), (torch.bfloat16, 900), (torch.float32, 10)]


def _measured_extra(tmp_path, sizes, limit: int) -> int:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with StorageTracker() as tracker:
            tensors = [torch.zeros(n, dtype=dtype) for dtype, n in sizes]
            base = tracker.live_bytes
            tracker.reset_peak()
            dist._broadcast_coalesced(dist.group.WORLD, tensors, limit, 0)
            assert tracker.live_bytes == base  # the flat buckets are gone afterwards
            return tracker.peak_bytes - base
    finally:
        dist.destroy_process_group()


# a tensor that fills a bucket alone is broadcast in place (its flat "copy" is a view)
ALONE = [(torch.float32, 300), (torch.float32, 20), (torch.float32, 20), (torch.float32, 300), (torch.float32, 10)]


@pytest.mark.parametrize("sizes,limit", [(MIXED, 1000), (MIXED, 3000), (MIXED[:1], 1000), (ALONE, 1000),
                                         ([(torch.float32, 100)] * 9, 800)])
def test_broadcast_peak_matches_torch(tmp_path, sizes, limit):
    tensors = [(torch.tensor([], dtype=dtype).element_size(), n * torch.tensor([], dtype=dtype).element_size())
               for dtype, n in sizes]
    assert broadcast_peak_bytes(broadcast_buckets(tensors, limit)) == _measured_extra(tmp_path, sizes, limit)

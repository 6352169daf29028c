"""The traced tensor-parallel loss allocates what ColossalAI's `dist_cross_entropy` allocates.

Both run forward and backward on the same logits under the live-storage tracker the worker uses;
ColossalAI's runs on a one-process gloo group (its all-reduces then work in place on one rank's
tensors, as they do on every rank of a larger group)."""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("colossalai") is None,
                                reason="ColossalAI is not installed (optional extra of scripts/setup)")


def _allocations(loss_fn, logits, labels):
    """(sizes of every storage allocated, peak live bytes, loss value, logits grad) of one
    forward + backward, with the logits held by the caller as the causal-LM forward holds them."""
    from launcher.worker.storage_tracker import StorageTracker

    sizes = []
    logits = logits.detach().clone().requires_grad_(True)
    with StorageTracker() as tracker:
        original = tracker._change
        tracker._change = lambda phase, delta: (sizes.append(delta) if delta > 0 else None,
                                                original(phase, delta))
        tracker.track_tensor(logits)
        sizes.clear()
        tracker.reset_peak()
        base = tracker.live_bytes
        loss = loss_fn(logits, labels)
        loss.backward()
        peak = tracker.peak_bytes - base
    return sizes, peak, float(loss), logits.grad


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_traced_loss_allocates_like_colossalai(tmp_path, dtype):
    import torch
    import torch.distributed as dist
    from colossalai.shardformer.layer.loss import dist_cross_entropy

    from launcher.vocab_parallel_loss import vocab_parallel_loss

    torch.manual_seed(0)
    batch, seq, shard = 2, 16, 40
    logits = torch.randn(batch, seq, shard, dtype=getattr(torch, dtype))
    labels = torch.randint(0, shard, (batch, seq))
    labels[0, 3] = -100  # an ignored position exercises the masked paths
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        world = dist.group.WORLD
        shard_config = SimpleNamespace(
            sequence_parallel_process_group=world, sequence_parallel_size=1, sequence_parallelism_mode=None,
            parallel_output=True, enable_tensor_parallelism=True, tensor_parallel_process_group=world)
        real = _allocations(lambda x, y: dist_cross_entropy(y, x, shard_config, shard, x.dtype), logits, labels)
    finally:
        dist.destroy_process_group()
    traced = _allocations(lambda x, y: vocab_parallel_loss(x, y), logits, labels)
    # the same storages in the same order; 0-dim scalars (<= 8 bytes: the loss and its
    # bookkeeping) are left out, their count differs by a few without changing the peak
    assert [n for n in traced[0] if n > 8] == [n for n in real[0] if n > 8]
    assert traced[1] == real[1] > 3 * (batch * (seq - 1) * shard * logits.element_size())
    assert traced[2] == pytest.approx(real[2])
    assert torch.equal(traced[3], real[3])

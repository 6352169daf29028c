"""Collectives on gloo that return only once gloo's worker thread has let go of their tensors
(launcher/worker/gloo.py `settle`): the shardformer's async collectives
(launcher/backends/colossalai/cpu.py `_SettledCollectives`), even when the caller drops references
of its own between the call and `wait()`, and FSDP2's all-gather on CPU processes
(launcher/backends/fsdp2/worker.py `gloo_all_gather`)."""
import json
import os
import subprocess
import sys

import pytest


def on_two_gloo_ranks(script: str, tmp_path) -> list[dict]:
    """Run `script` on 2 gloo ranks (torchrun) and read the JSON each rank wrote to
    result-<rank>.json (one file per rank: their stdout lines interleave)."""
    path = tmp_path / "settled.py"
    path.write_text(script)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
                           str(path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]


ASYNC_SCRIPT = r"""
import json, torch, torch.distributed as dist
from launcher.backends.colossalai.cpu import _SettledCollectives

dist.init_process_group("gloo")
collectives = {"gloo": dist, "settled": _SettledCollectives(dist)}
held = dict.fromkeys(collectives, 0)
leaf = torch.ones(1, requires_grad=True)
for _ in range(300):
    for name, d in collectives.items():
        grad = torch.ones(8192)
        alone = grad._use_count()
        # the caller's own references (autograd nodes that saved `grad`), as many as the work takes,
        # dropped before it waits
        mine = [leaf * grad for _ in range(4)]
        handle = d.all_reduce(grad, async_op=True)
        del mine
        handle.wait()
        del handle
        held[name] += grad._use_count() > alone  # still referenced by gloo's worker thread
with open(f"result-{dist.get_rank()}.json", "w") as f:
    json.dump(held, f)
dist.destroy_process_group()
"""


@pytest.mark.integration
@pytest.mark.long
def test_async_all_reduce_waits_for_gloo_even_when_the_caller_drops_a_reference(tmp_path):
    """The settle used to wait for the count taken before the call: once the caller had dropped
    references of its own, that count matched while gloo still held the tensor, and `wait()`
    returned early (102 of 300 calls on one rank here). Settling at `wait()` to the count then, less
    the references the work took at the call, spun for its full second when gloo had already let
    go. An async call now runs blocking and settles to the count before it (and, since, to the
    Python reference count too: test_settled_all_reduce_returns_once_gloo_drops_its_python_reference)."""
    for held in on_two_gloo_ranks(ASYNC_SCRIPT, tmp_path):
        assert held["settled"] == 0, held


SETTLED_SCRIPT = r"""
import json, torch, torch.distributed as dist
from launcher.backends.fsdp2.worker import gloo_all_gather

dist.init_process_group("gloo")
group, settled = dist.group.WORLD, gloo_all_gather()
held = {"gloo": 0, "settled": 0}
for _ in range(300):
    for name in held:
        inp, out = torch.ones(4096), torch.empty(2 * 4096)
        before = out._use_count()
        if name == "gloo":
            dist.all_gather_single(out, inp, group=group)
        else:
            settled(out, inp, group)
        held[name] += out._use_count() > before  # still referenced by gloo's worker thread
with open(f"result-{dist.get_rank()}.json", "w") as f:  # one file per rank: their stdout lines interleave
    json.dump(held, f)
dist.destroy_process_group()
"""


@pytest.mark.integration
def test_fsdp2_all_gather_on_gloo_returns_once_gloo_lets_go_of_its_output(tmp_path):
    """gloo's worker thread can still reference a finished all-gather's output when the call
    returns (launcher/worker/gloo.py); the worker's FSDP2 all-gather on CPU processes returns only
    once it has let go, so FSDP2 frees the output where it would on a GPU. 300 calls each way on 2
    gloo ranks: the settled one never returns with the output still held."""
    for held in on_two_gloo_ranks(SETTLED_SCRIPT, tmp_path):
        assert held["settled"] == 0, held


PYREF_SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
from launcher.backends.colossalai.cpu import _SettledCollectives

dist.init_process_group("gloo")
settled = _SettledCollectives(dist)
held = {"use_count": 0, "settled": 0}
for _ in range(1000):
    for name in held:
        grad = torch.ones(8192)
        before = sys.getrefcount(grad)
        if name == "settled":
            settled.all_reduce(grad)
        else:  # what settling waited for before: gloo's C++ references only
            dist.all_reduce(grad)
            while grad._use_count() > 1:
                pass
        held[name] += sys.getrefcount(grad) > before  # a Python reference gloo's thread still holds
with open(f"result-{dist.get_rank()}.json", "w") as f:
    json.dump(held, f)
dist.destroy_process_group()
"""


@pytest.mark.integration
def test_settled_all_reduce_returns_once_gloo_drops_its_python_reference(tmp_path):
    """Once gloo's C++ references to a tensor are gone, its worker thread can still hold a Python
    reference, which it drops only when it gets the GIL: a tensor the caller frees then is freed
    on gloo's thread, late (the tensor-parallel BLOOM run's one-gradient hold). 1,000 blocking
    all-reduces each way on 2 gloo ranks: waiting for the C++ count alone returns with the Python
    reference still held (about one call in six here); the settled call never does."""
    for held in on_two_gloo_ranks(PYREF_SCRIPT, tmp_path):
        assert held["use_count"] > 0, held
        assert held["settled"] == 0, held

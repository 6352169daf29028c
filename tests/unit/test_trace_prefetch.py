"""Steps traced by a helper process alongside the planner (launcher/trace.py `prefetch`): the plan
equals the one traced in one process, and the helper is gone when the plan is made."""
import os

from launcher import planner, trace
from launcher.app import model_spec
from launcher.cli import compose
from launcher.hardware import cluster_from


def _plan(cache, monkeypatch, cpus):
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(trace, "_MEMO", {})
    config = compose(["model=tiny-llama", "hardware=a100-80g", "training.seq_len=64", "gpus=2", f"cache_dir={cache}"])
    return planner.plan(config, model_spec(config), cluster_from(config.hardware, config.gpus, config.nodes))


def test_a_helper_traces_alongside_and_ends_with_the_plan(tmp_path, monkeypatch):
    forks = []
    fork = os.fork
    monkeypatch.setattr(os, "fork", lambda: forks.append(fork()) or forks[-1])
    together = _plan(tmp_path / "two", monkeypatch, 2)
    assert len(forks) == 1 and trace._HELPER.pid is None
    try:
        os.waitpid(forks[0], os.WNOHANG)
        raise AssertionError("the helper was not reaped")
    except ChildProcessError:
        pass
    alone = _plan(tmp_path / "one", monkeypatch, 1)
    assert len(forks) == 1
    assert together == alone
    assert not list((tmp_path / "two").glob(".*.tmp"))

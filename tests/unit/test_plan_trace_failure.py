"""A strategy whose traced step fails (the model's own code refuses how the strategy runs it) is a
line in the plan under strategy=auto and one error naming the strategy when asked for by name,
never a traceback that loses every other candidate."""
import pytest

from launcher import planner
from launcher.app import model_spec
from launcher.cli import compose
from launcher.errors import ConfigError
from launcher.hardware import cluster_from


def _plan(tmp_path, monkeypatch, *overrides):
    config = compose(["model=tiny-llama", "hardware=a100-80g", "gpus=2", "training.seq_len=64",
                      "training.micro_batch_size=1", f"cache_dir={tmp_path}", *overrides])
    real = planner.evaluate

    def evaluate(config, spec, cluster, strategy, micro, variant=None):
        if strategy.name == "ddp":  # a model whose kernel refuses fp32 inputs under autocast
            raise RuntimeError("Expected inputs of BF16 type but got mat_a.dtype=torch.float32\nmore")
        return real(config, spec, cluster, strategy, micro, variant)

    monkeypatch.setattr(planner, "evaluate", evaluate)
    return planner.plan(config, model_spec(config), cluster_from(config.hardware, config.gpus, config.nodes))


def test_failed_trace_is_a_line_not_a_lost_plan(tmp_path, monkeypatch):
    plan = _plan(tmp_path, monkeypatch)
    assert "ddp" not in {c.strategy.name for c in plan.candidates}
    assert {"zero1", "zero3"} <= {c.strategy.name for c in plan.candidates} and plan.chosen is not None
    (line,) = [n for n in plan.notes if n.startswith("ddp not planned")]
    assert "the traced step fails at micro-batch 1: Expected inputs of BF16 type" in line and "more" not in line


def test_failed_trace_of_the_asked_strategy_is_one_error(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"strategy=ddp: the traced step fails at micro-batch 1"):
        _plan(tmp_path, monkeypatch, "strategy=ddp")

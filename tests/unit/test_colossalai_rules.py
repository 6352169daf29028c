"""Which optimizers each ColossalAI plugin runs through the worker (launcher/backends/colossalai/
rules.py): the planner refuses what the plugin's checkpoint IO or optimizer wrapper would fail on."""
from dataclasses import replace

import pytest

from launcher.backends.base import Ask
from launcher.backends.colossalai.worker import gemini_optimizer
from launcher.backends.registry import backend_of, strategy
from launcher.errors import ConfigError


def _problem(name: str, optimizer: str, **sizes) -> str:
    s = replace(strategy(name), **sizes)
    return backend_of(s).rules(s).problem(s.name, Ask("bf16-mixed", optimizer, device="cuda", num_processes=4))


SHARDED = [("cai_zero1", {}), ("cai_zero2", {}), ("cai_tp", {}), ("cai_pp", {"zero_stage": 1}),
           ("cai_pp", {"tp_size": 2})]


@pytest.mark.parametrize("name,sizes", SHARDED, ids=lambda x: str(x))
def test_sharded_states_run_only_optimizers_whose_states_have_the_parameters_shape(name, sizes):
    """LowLevelZero's `state_dict` and HybridParallel's `gather_from_sharded_optimizer_state` failed
    on Adafactor's factored states in 2-rank CPU runs (`shape '[32000, 256]' is invalid`, `zero-dimensional
    tensor cannot be concatenated`) at the first checkpoint."""
    for optimizer in ("adafactor", "adamw_bnb_8bit", "paged_adamw_32bit"):
        assert "checkpoint IO" in _problem(name, optimizer, **sizes)
    for optimizer in ("adamw_torch", "sgd"):
        assert _problem(name, optimizer, **sizes) == ""


def test_a_pipeline_without_sharded_states_runs_adafactor():
    assert _problem("cai_pp", "adafactor") == ""
    assert _problem("cai_ddp", "adafactor") == ""


def test_gemini_runs_hybrid_adam_for_the_adamw_names_only():
    assert _problem("cai_gemini", "adamw_torch") == ""
    for optimizer in ("sgd", "adafactor", "adamw_bnb_8bit"):
        assert "HybridAdam" in _problem("cai_gemini", optimizer)
    with pytest.raises(ConfigError, match="HybridAdam"):
        gemini_optimizer("sgd", [], 1e-3, 0.0)

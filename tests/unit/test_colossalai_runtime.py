"""Which Python runs a ColossalAI strategy, and when the planner calls it launchable
(launcher/backends/colossalai/runtime.py, launcher/environment.py, launcher/launch.py)."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from launcher import environment, launch
from launcher.backends import registry
from launcher.backends.colossalai import runtime
from launcher.environment import SHARDFORMER, Env
from launcher.planner import launch_problem
from launcher.types import Strategy

TP, PP = registry.strategy("cai_tp"), registry.strategy("cai_pp")
ZERO = registry.strategy("cai_zero2")


def test_only_the_shardformer_strategies_leave_the_launchers_python(tmp_path, monkeypatch):
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setenv(environment.COLOSSALAI_PYTHON_ENV, str(python))
    monkeypatch.setattr(runtime, "version", lambda name: "5.23.0")
    assert launch.worker_python("colossalai", "cai_tp") == str(python)
    assert launch.worker_python("colossalai", "cai_pp") == str(python)
    assert launch.worker_python("colossalai", "cai_zero2") == sys.executable
    assert launch.worker_python("deepspeed", "zero3") == sys.executable
    assert launch.torchrun_argv.__defaults__ == (sys.executable,)


def test_transformers_4_runs_the_shardformer_here(monkeypatch):
    monkeypatch.setattr(runtime, "version", lambda name: "4.51.3")
    assert runtime.interpreter(TP) is None  # the launcher's own Python
    assert environment.shardformer_python("4.51.3") == ""


def test_a_named_python_that_does_not_exist_is_no_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(environment.COLOSSALAI_PYTHON_ENV, str(tmp_path / "missing"))
    assert environment.colossalai_python() is None
    assert environment.shardformer_python("5.23.0") is None


@pytest.mark.parametrize("strategy", [TP, PP, Strategy("cai_tp", "colossalai", tp_size=4)])
def test_without_an_environment_tp_and_pp_are_estimates(strategy):
    why = runtime.launch_problem(strategy, frozenset({"colossalai"}), "5.23.0")
    assert "transformers 4.51" in why and ".venv-colossalai" in why and why.endswith("estimate only")
    assert runtime.launch_problem(strategy, frozenset({"colossalai", SHARDFORMER}), "5.23.0") == ""
    assert runtime.launch_problem(ZERO, frozenset({"colossalai"}), "5.23.0") == ""


@pytest.mark.parametrize("model_type,expected", [("llama", "sdpa"), ("qwen2", "sdpa"), ("opt", "eager"),
                                                 ("bloom", "eager"), ("gpt2", "eager")])
def test_shardformer_attention(model_type, expected):
    backend = registry.get("colossalai")
    assert backend.attention_of(TP, model_type, "sdpa") == expected
    assert backend.attention_of(PP, model_type, "sdpa") == expected
    assert backend.attention_of(ZERO, model_type, "sdpa") == "sdpa"  # the model's own forwards
    assert registry.get("ddp").attention_of(registry.strategy("ddp"), model_type, "sdpa") == "sdpa"


@pytest.mark.parametrize("name,moves", [("cai_gemini", True), ("cai_tp", True), ("cai_pp", True),
                                        ("cai_ddp", False), ("cai_zero1", False), ("cai_zero2", False)])
def test_the_worker_leaves_the_model_on_the_host_for_plugins_that_shard_it(name, moves):
    """Gemini and the hybrid plugin move the rank's part of a host-built model themselves; the
    worker moves the whole model first only for the plugins that keep it whole on each GPU, and
    for a QLoRA base, which is quantized on the device as it is built."""
    from launcher.backends.colossalai.emit import PLUGIN_OF
    from launcher.worker.backends import moves_model

    spec = SimpleNamespace(backend="colossalai", framework_config={"plugin": PLUGIN_OF[name], "kwargs": {}}, peft=None)
    assert moves_model(spec) is moves
    qlora = SimpleNamespace(**{**vars(spec), "peft": {"r": 8, "quant_type": "nf4"}})
    assert moves_model(qlora) is False


def test_the_planner_asks_the_backend_why_a_candidate_cannot_launch():
    """planner.launch_problem reaches ColossalAI's reasons through the backend's `launch_problem`
    hook: a vocabulary that tp does not divide is padded (launcher/tp_shard.py `vocab_multiple`)
    and ColossalAI 0.5.0 cannot checkpoint the padded layers' optimizer state (GPT-2's 50,257
    tokens over 2 ranks); without the ColossalAI environment tp and pp are estimates; ZeRO and a
    vocabulary tp divides (Llama's 32,000) launch."""
    ready = Env(frozenset({"colossalai", SHARDFORMER}), {"transformers": "5.23.0"})
    gpt2, llama = (SimpleNamespace(vocab_size=v, hf_config={}, model_type=m)
                   for v, m in ((50257, "gpt2"), (32000, "llama")))
    why = launch_problem(TP, gpt2, None, ready)
    assert "tp_size=2 does not divide the vocabulary (50257)" in why and why.endswith("estimate only")
    assert launch_problem(TP, llama, None, ready) == "" and launch_problem(PP, gpt2, None, ready) == ""
    bare = Env(frozenset({"colossalai"}), {"transformers": "5.23.0"})
    assert "transformers 4.51" in launch_problem(PP, llama, None, bare)
    assert launch_problem(ZERO, gpt2, None, bare) == ""

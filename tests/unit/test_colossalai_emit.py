"""colossalai_plugin.json: every emitted kwarg is an argument of the installed plugin class, and
the planner's ColossalAI strategies and their errors."""
from __future__ import annotations

import importlib.util
import inspect

import pytest

from launcher.config import ColossalAIConfig, Precision, TrainingConfig
from launcher.emit import emit
from launcher.planner import STRATEGIES

needs_cai = pytest.mark.skipif(importlib.util.find_spec("colossalai") is None,
                               reason="ColossalAI is not installed (optional: scripts/setup installs it unless LAUNCHER_SKIP_COLOSSALAI=1)")


def _emit(name, precision="bf16-mixed", device="cuda", **cai):
    training = TrainingConfig(precision=Precision[precision])
    return emit(STRATEGIES[name], training=training, micro_batch_size=1, grad_accum_steps=1, dp_size=2,
                knobs={"colossalai": ColossalAIConfig(**cai)}, device=device)


@needs_cai
@pytest.mark.parametrize("name", ["cai_ddp", "cai_zero1", "cai_zero2", "cai_gemini", "cai_tp", "cai_pp"])
def test_emitted_kwargs_are_plugin_arguments(name):
    """GeminiPlugin and HybridParallelPlugin build process-group meshes in __init__ (a distributed
    run), so the kwargs are checked against each class's __init__ signature."""
    import colossalai.booster.plugin as plugins

    filename, config = _emit(name)
    assert filename == "colossalai_plugin.json"
    params = inspect.signature(getattr(plugins, config["plugin"]).__init__).parameters
    assert set(config["kwargs"]) <= set(params) - {"self"}


def test_gemini_static_fractions_and_cpu_overlap():
    _, g = _emit("cai_gemini", offload_optim_frac=0.5)
    assert g["plugin"] == "GeminiPlugin" and g["kwargs"]["offload_optim_frac"] == 0.5
    assert g["kwargs"]["precision"] == "bf16"
    _, auto = _emit("cai_gemini", placement_policy="auto")
    assert "shard_param_frac" not in auto["kwargs"]
    _, z = _emit("cai_zero2", precision="32-true", device="cpu")
    assert z["kwargs"]["overlap_communication"] is False and z["kwargs"]["precision"] == "fp32"


def test_gemini_rejects_fp32():
    from launcher.errors import ConfigError

    with pytest.raises(ConfigError, match="cai_gemini"):
        _emit("cai_gemini", precision="32-true")


def test_invalid_tp_size_is_one_line_error(cli):
    r = cli("model=tiny-llama", "gpus=4", "hardware=a100-80g", "mode=plan", "strategy=cai_tp",
            "training.seq_len=64", "colossalai.tp_size=3")
    assert r.returncode == 2
    assert "colossalai.tp_size=3" in r.stderr and "valid: [2]" in r.stderr


@pytest.mark.parametrize("strategy,gpus,extra,names", [
    ("cai_tp", 3, [], "(tp=3: tp_size=3 does not divide"), ("cai_pp", 5, [], "pipeline sizes valid for this model: [2"),
    ("cai_pp", 2, ["colossalai.tp_size=2"], "colossalai.tp_size=2 times any pipeline size in [2]")])
def test_a_strategy_named_with_no_layout_on_these_gpus_is_one_line_error(cli, strategy, gpus, extra, names):
    """Asked for by name, a tensor- or pipeline-parallel strategy that no size can lay out on this
    many GPUs is the user's input to fix, not a plan where "nothing fits" (which suggested
    checkpointing and LoRA for it)."""
    r = cli("model=tiny-llama", f"gpus={gpus}", "hardware=a100-80g", "mode=plan", f"strategy={strategy}",
            "training.seq_len=64", *extra)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(errors) == 1 and errors[0].startswith(f"error: strategy={strategy}: ") and names in errors[0]
    assert "strategy=auto" in errors[0]


@pytest.mark.parametrize("name", ["cai_zero2", "cai_gemini", "cai_tp"])
def test_emitted_plugin_config_matches_golden(name):
    """Reviewed against each plugin's documented defaults (colossalai/booster/plugin/*.py):
    LowLevelZero reduce_bucket_size_in_m=12, Gemini search_range_m=32 / min_chunk_size_m=32 /
    static placement fully sharded, HybridParallel ddp_bucket_cap_mb=25, vocabulary padded to 64."""
    import json
    from pathlib import Path

    golden = Path(__file__).resolve().parent.parent / "golden" / f"{name}_bf16.json"
    _, config = _emit(name)
    assert config == json.loads(golden.read_text())

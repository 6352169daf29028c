"""Real 2-process CPU fine-tuning through the launcher with ColossalAI plugins: plan ->
colossalai_plugin.json -> torchrun -> colossalai.launch_from_torch + Booster -> measured peak
next to the estimate. LowLevelZero needs the test compatibility layer
(tests/colossalai_cpu_compat.py), loaded by the worker through LAUNCHER_COLOSSALAI_TEST_PRELOAD."""
from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("colossalai") is None,
                                 reason="ColossalAI is not installed (optional: scripts/setup installs it unless LAUNCHER_SKIP_COLOSSALAI=1)")]

STEPS = 12
PRELOAD = {"LAUNCHER_COLOSSALAI_TEST_PRELOAD": "tests.colossalai_cpu_compat"}


@pytest.mark.parametrize("strategy", ["cai_ddp", "cai_zero1", "cai_zero2"])
def test_colossalai_fine_tunes_through_the_launcher(cli, strategy):
    r = cli("model=tiny-llama", "hardware=cpu", "gpus=2", "mode=run", f"strategy={strategy}",
            "training.micro_batch_size=2", "training.seq_len=64", f"training.max_steps={STEPS}",
            "training.learning_rate=3e-3", "training.precision=32-true", timeout=900, env=PRELOAD)
    assert r.returncode == 0, r.stderr[-3000:]
    (run_dir,) = (cli.cwd / "runs").glob("*/*")
    plugin = json.loads((run_dir / "colossalai_plugin.json").read_text())
    expected_plugin = {"cai_ddp": "TorchDDPPlugin"}.get(strategy, "LowLevelZeroPlugin")
    assert plugin["plugin"] == expected_plugin
    if expected_plugin == "LowLevelZeroPlugin":
        assert plugin["kwargs"]["stage"] == int(strategy[-1])
        assert plugin["kwargs"]["overlap_communication"] is False  # CPU: no streams

    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in records]
    assert [x["step"] for x in records] == list(range(1, STEPS + 1))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses

    plan = json.loads((run_dir / "plan.json").read_text())
    estimate = plan["candidates"][plan["chosen"]]["memory"]["peak_allocated_bytes"]
    summary = json.loads((run_dir / "summary.json").read_text())
    for measured in summary["measured_peak_allocated_bytes"]:
        print(f"{strategy}: estimated {estimate} B, measured {measured} B, "
              f"error {100 * (estimate - measured) / measured:+.3f}%")
        assert abs(estimate - measured) / measured <= 0.01, (estimate, measured)


def test_colossalai_tensor_parallel_run(cli):
    """HybridParallelPlugin tp=2 (one data-parallel rank): the shardformer-sharded Llama trains on
    transformers 5 through the worker's forwards (launcher/backends/colossalai/transformers_tp.py),
    with ColossalAI's vocabulary-parallel loss, and checkpoints its sharded optimizer state."""
    r = cli("model=tiny-llama", "hardware=cpu", "gpus=2", "mode=run", "strategy=cai_tp",
            "training.micro_batch_size=2", "training.seq_len=64", f"training.max_steps={STEPS}",
            "training.learning_rate=3e-3", "training.precision=32-true", timeout=900, env=PRELOAD)
    assert r.returncode == 0, r.stderr[-3000:]
    (run_dir,) = (cli.cwd / "runs").glob("*/*")
    plugin = json.loads((run_dir / "colossalai_plugin.json").read_text())
    assert plugin["plugin"] == "HybridParallelPlugin"
    assert (plugin["kwargs"]["tp_size"], plugin["kwargs"]["pp_size"]) == (2, 1)
    assert plugin["kwargs"]["make_vocab_size_divisible_by"] == 32  # 320 / 2 = 160 = 2^5 x 5: no padding
    losses = [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == STEPS and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    assert any((run_dir / "checkpoints").iterdir())
    plan = json.loads((run_dir / "plan.json").read_text())
    estimate = plan["candidates"][plan["chosen"]]["memory"]["peak_allocated_bytes"]
    summary = json.loads((run_dir / "summary.json").read_text())
    for measured in summary["measured_peak_allocated_bytes"]:
        assert abs(estimate - measured) / measured <= 0.01, (estimate, measured)

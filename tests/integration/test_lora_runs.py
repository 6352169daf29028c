"""LoRA fine-tuning on 2 CPU processes through the launcher's command line (DDP and DeepSpeed
ZeRO-2 and ZeRO-3, which also partitions and gathers the frozen base): the worker applies the same peft.LoraConfig the estimator traced, only the adapters train,
and the measured peak live bytes match the estimate within 1%."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration

STEPS = 12
_LOSSES: dict[str, list[float]] = {}


# LoRA on ZeRO-2 partitions the adapters as ZeRO-2 partitions any trainable set; ZeRO-3's partitioned
# and gathered frozen base is also test_accuracy.py's ZeRO-3 QLoRA cell; LoRA on DDP trains in the
# default suite under QLoRA (below) and in test_accuracy.py (within 1%)
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.long),
                                      pytest.param("zero2", marks=pytest.mark.long),
                                      pytest.param("zero3", marks=pytest.mark.long)])
def test_lora_fine_tunes_through_the_launcher(cli, strategy):
    r = cli("model=tiny-llama", "hardware=cpu", "gpus=2", "mode=run", "peft=lora", f"strategy={strategy}",
            "training.micro_batch_size=2", "training.seq_len=64", f"training.max_steps={STEPS}",
            "training.learning_rate=3e-3", "training.precision=32-true",
            "deepspeed.reduce_bucket_size=200000", "deepspeed.allgather_bucket_size=200000",
            "deepspeed.stage3_prefetch_bucket_size=200000", "deepspeed.stage3_param_persistence_threshold=1000",
            timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (run_dir,) = (cli.cwd / "runs").glob("*/*")
    plan = json.loads((run_dir / "plan.json").read_text())
    chosen = plan["candidates"][plan["chosen"]]
    assert chosen["strategy"] == strategy and chosen["trains"] == "adapters"
    # tiny-llama: q_proj 64->64 and v_proj 64->32 (2 KV heads of 16), rank 8, 2 layers
    expected_trainable = 2 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8)
    assert chosen["num_trainable_params"] == expected_trainable == plan["model"]["num_trainable_params"]
    run = json.loads((run_dir / "run.json").read_text())
    assert run["peft"]["r"] == 8 and run["peft"]["quant_type"] is None

    losses = _trained_within_one_percent(run_dir, chosen)
    _LOSSES[strategy] = losses
    if strategy != "ddp" and "ddp" in _LOSSES:  # the same fp32 adapter update on the same batches
        assert losses == pytest.approx(_LOSSES["ddp"], abs=2e-2)


def test_qlora_fine_tunes_on_cpu_processes_within_one_percent(cli):
    """QLoRA with bitsandbytes' CPU kernels: the base Linears become NF4 `Linear4bit` (double
    quantization), peft's `prepare_model_for_kbit_training` makes every other parameter fp32, the
    adapters train under bf16 autocast. Each Linear4bit casts its bf16 output back to its fp32
    input's dtype (bitsandbytes/nn/modules.py `Linear4bit.forward`); without that copy the estimate
    was 15% under this run."""
    r = cli("model=tiny-llama", "hardware=cpu", "gpus=2", "mode=run", "peft=qlora", "strategy=ddp",
            "training.micro_batch_size=2", "training.seq_len=64", f"training.max_steps={STEPS}",
            "training.learning_rate=3e-3", "training.precision=bf16-mixed", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (run_dir,) = (cli.cwd / "runs").glob("*/*")
    plan = json.loads((run_dir / "plan.json").read_text())
    chosen = plan["candidates"][plan["chosen"]]
    assert chosen["strategy"] == "ddp" and chosen["trains"] == "adapters"
    run = json.loads((run_dir / "run.json").read_text())
    assert run["peft"]["quant_type"] == "nf4" and run["peft"]["double_quant"] is True
    _trained_within_one_percent(run_dir, chosen)
    # resumed from its last checkpoint: the frozen 4-bit base is rebuilt, the adapters and the
    # optimizer loaded (a QLoRA model cannot strictly load its own state_dict: layout.load_model_state)
    r = cli(f"resume={run_dir}", f"training.max_steps={STEPS + 2}", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{STEPS}'} at step {STEPS}" in r.stdout + r.stderr
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 3))


def _trained_within_one_percent(run_dir, chosen) -> list[float]:
    """The run's losses (every step logged, the last three below the first three), after checking
    every rank's measured peak is within 1% of the chosen candidate's estimate."""
    losses = [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == STEPS and sum(losses[-3:]) < sum(losses[:3]), losses
    summary = json.loads((run_dir / "summary.json").read_text())
    estimate = chosen["memory"]["peak_allocated_bytes"]
    for measured in summary["measured_peak_allocated_bytes"]:
        assert abs(estimate - measured) / measured <= 0.01, (estimate, measured)
    return losses

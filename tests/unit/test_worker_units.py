"""Fast tests of the worker's pure parts: tokenizer, data order, config checks, checkpoints,
memory tracking and the summary."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.errors import ConfigError
from launcher.worker import checkpoint, metrics
from launcher.backends.deepspeed.worker import deepspeed_config
from launcher.worker.optim import lr_factor
from launcher.worker.data import (SampleOrder, demo_path, micro_batch_positions, pack_blocks,
                                  read_documents, samples_per_step)
from launcher.worker.model import build_config, check_seq_len, max_positions, precision_plan
from launcher.worker.tokenizer import ByteTokenizer, check_vocab, load_tokenizer


# --- tokenizer -------------------------------------------------------------------------------
def test_byte_tokenizer_roundtrips_utf8_and_keeps_specials_apart() -> None:
    tok = ByteTokenizer()
    text = "Alice said: «ça va?» 🐇"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert min(ids) >= 3 and max(ids) <= 258 and tok.vocab_size == 259
    assert tok.decode(ids) == text
    assert {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id} == {0, 1, 2}


def test_vocab_check() -> None:
    check_vocab(ByteTokenizer(), 259)
    with pytest.raises(ConfigError, match="259 ids.*vocab_size=258"):
        check_vocab(ByteTokenizer(), 258)


def test_pretrained_without_tokenizer_is_rejected() -> None:
    with pytest.raises(ConfigError, match="tokenizer_path"):
        load_tokenizer(None, "pretrained", False)


# --- data ------------------------------------------------------------------------------------
def test_demo_corpus_is_shipped_real_text() -> None:
    text = demo_path().read_text(encoding="utf-8")
    assert len(text) > 20_000
    assert "Alice" in text and "It is a truth universally acknowledged" in text


def test_pack_blocks_appends_eos_and_drops_tail() -> None:
    blocks = pack_blocks([[5, 6, 7], [8, 9]], eos_token_id=2, seq_len=3)
    # stream 5 6 7 2 8 9 2 -> two full blocks, the lone tail token is dropped
    assert blocks.tolist() == [[5, 6, 7], [2, 8, 9]]
    assert blocks.dtype == np.int64


@given(num_blocks=st.integers(1, 50), seed=st.integers(0, 2**31))
@settings(max_examples=30, deadline=None)
def test_every_epoch_is_a_permutation(num_blocks: int, seed: int) -> None:
    order = SampleOrder(num_blocks, seed)
    for epoch in range(2):
        ids = [order.block_index(epoch * num_blocks + i) for i in range(num_blocks)]
        assert sorted(ids) == list(range(num_blocks))
    again = SampleOrder(num_blocks, seed)
    assert [again.block_index(p) for p in range(num_blocks)] == [order.block_index(p) for p in range(num_blocks)]


@given(world=st.integers(1, 8), micro=st.integers(1, 4), accum=st.integers(1, 4), step=st.integers(0, 20))
@settings(max_examples=50, deadline=None)
def test_ranks_and_micro_batches_tile_each_step_exactly(world: int, micro: int, accum: int, step: int) -> None:
    size = samples_per_step(world, micro, accum)
    start = step * size
    seen = [p for m in range(accum) for r in range(world) for p in micro_batch_positions(start, m, r, world, micro)]
    assert sorted(seen) == list(range(start, start + size))


def test_read_txt_jsonl_and_saved_dataset(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("First paragraph\nstill first.\n\n\nSecond.\n")
    assert read_documents(str(tmp_path / "a.txt"), "text") == ["First paragraph\nstill first.", "Second."]
    (tmp_path / "b.jsonl").write_text('{"body": "one"}\n{"other": 1}\n\n{"body": "two"}\n')
    assert read_documents(str(tmp_path / "b.jsonl"), "body") == ["one", "two"]
    import datasets

    datasets.Dataset.from_dict({"text": ["x y", "  ", "z"]}).save_to_disk(str(tmp_path / "ds"))
    assert read_documents(str(tmp_path / "ds"), "text") == ["x y", "z"]
    with pytest.raises(ConfigError, match="no column 'body'"):
        read_documents(str(tmp_path / "ds"), "body")


def test_data_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        read_documents(str(tmp_path / "nope.txt"), "text")
    (tmp_path / "blank.txt").write_text("\n   \n\n")
    with pytest.raises(ConfigError, match="no usable text"):
        read_documents(str(tmp_path / "blank.txt"), "text")
    (tmp_path / "c.jsonl").write_text('{"content": "x"}\n')
    with pytest.raises(ConfigError, match="no usable text.*'text'"):
        read_documents(str(tmp_path / "c.jsonl"), "text")


# --- model config ----------------------------------------------------------------------------
def test_max_positions_by_architecture() -> None:
    assert max_positions(build_config({"model_type": "llama", "max_position_embeddings": 512})) == 512
    assert max_positions(build_config({"model_type": "gpt2", "n_positions": 256})) == 256
    assert max_positions(build_config({"model_type": "bloom"})) is None  # ALiBi: no limit
    check_seq_len(build_config({"model_type": "bloom"}), 100_000)
    with pytest.raises(ConfigError, match="seq_len=513 .* 512"):
        check_seq_len(build_config({"model_type": "llama", "max_position_embeddings": 512}), 513)


def test_unknown_model_type_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        build_config({"model_type": "no-such-model"})


def test_precision_plan() -> None:
    assert precision_plan("32-true", "ddp", "cpu").model_dtype == "float32"
    assert precision_plan("bf16-true", "ddp", "cpu").model_dtype == "bfloat16"
    mixed = precision_plan("bf16-mixed", "ddp", "cpu")
    assert (mixed.model_dtype, mixed.autocast_dtype) == ("float32", "bfloat16")
    assert precision_plan("16-mixed", "ddp", "cuda").grad_scaler
    assert not precision_plan("16-mixed", "ddp", "cpu").grad_scaler
    ds = precision_plan("bf16-mixed", "deepspeed", "cpu")  # built as the ds_config casts it: no fp32 copy
    assert (ds.model_dtype, ds.autocast_dtype) == ("bfloat16", None)
    assert precision_plan("32-true", "deepspeed", "cpu").model_dtype == "float32"
    with pytest.raises(ConfigError):
        precision_plan("fp8", "ddp", "cpu")


# --- backends --------------------------------------------------------------------------------
def _spec(**kw) -> SimpleNamespace:
    base = dict(framework_config={}, micro_batch_size=2, grad_accum_steps=3, precision="32-true", max_grad_norm=1.0)
    base.update(kw)
    return SimpleNamespace(**base)


def test_deepspeed_config_filled_from_spec() -> None:
    config = deepspeed_config(_spec(framework_config={"zero_optimization": {"stage": 2}}), world_size=4)
    assert config["train_batch_size"] == 2 * 3 * 4
    assert config["gradient_accumulation_steps"] == 3 and config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_clipping"] == 1.0 and config["zero_allow_untested_optimizer"] is True


def test_deepspeed_config_disagreements_all_reported() -> None:
    spec = _spec(precision="bf16-mixed", framework_config={"train_batch_size": 7, "optimizer": {"type": "Adam"}})
    with pytest.raises(ConfigError) as err:
        deepspeed_config(spec, world_size=2)
    assert len(err.value.problems) == 3  # batch size, optimizer section, bf16 not enabled


def test_lr_warmup_then_constant() -> None:
    assert [lr_factor(s, 3) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_factor(0, 0) == 1.0


# --- checkpoints -----------------------------------------------------------------------------
def _fake_checkpoint(root: Path, step: int) -> Path:
    path = root / f"step-{step}"
    path.mkdir(parents=True)
    (path / "model.pt").write_bytes(b"x" * 100)
    (path / checkpoint.TRAINER_FILE).write_text(json.dumps({"step": step, "data_position": 4 * step, "world_size": 2}))
    checkpoint.write_marker(path, step)
    return path


def test_marker_detects_truncation_and_missing_files(tmp_path: Path) -> None:
    path = _fake_checkpoint(tmp_path, 5)
    assert checkpoint.verify(path) is None
    (path / "model.pt").write_bytes(b"x" * 99)
    assert "model.pt has 99 bytes, expected 100" in checkpoint.verify(path)
    (path / "model.pt").unlink()
    assert "model.pt is missing" in checkpoint.verify(path)
    (path / checkpoint.MARKER).unlink()
    assert checkpoint.verify(path) == "no COMPLETE marker"


def test_resume_skips_corrupt_latest_and_refuses_explicit_corrupt(tmp_path: Path, capsys) -> None:
    root = checkpoint.checkpoint_root(tmp_path)
    _fake_checkpoint(root, 5)
    latest = _fake_checkpoint(root, 10)
    (latest / checkpoint.MARKER).unlink()
    assert checkpoint.find_resume_dir(tmp_path, True, warn=True) == root / "step-5"
    assert "skipping corrupt checkpoint" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="step-10 is corrupt: no COMPLETE marker"):
        checkpoint.find_resume_dir(tmp_path, "step-10", warn=True)
    assert checkpoint.find_resume_dir(tmp_path, "step-5", warn=True) == root / "step-5"
    assert checkpoint.find_resume_dir(tmp_path, False, warn=True) is None


def test_prune_keeps_newest(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20):
        _fake_checkpoint(tmp_path, step)
    checkpoint.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-15", "step-20"]


# --- memory ----------------------------------------------------------------------------------
def test_storage_tracker_counts_live_and_peak_bytes() -> None:
    import torch

    from launcher.worker.storage_tracker import StorageTracker

    with StorageTracker() as tracker:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B
        b = torch.empty(500, dtype=torch.bfloat16)  # 1000 B
        view = a[10:20]  # same storage: no new bytes
        assert tracker.live_bytes == 5000
        del a, view
        assert tracker.live_bytes == 1000 and tracker.peak_bytes == 5000
        tracker.reset_peak()
        c = torch.empty(0, dtype=torch.uint8)
        c.untyped_storage().resize_(300)
        assert tracker.live_bytes == 1300 and tracker.peak_bytes == 1300
        del b, c
        assert tracker.live_bytes == 0


def test_memory_meter_reports_phase_of_peak() -> None:
    import torch

    from launcher.worker.memory import MemoryMeter

    with MemoryMeter("cpu") as meter:
        with meter.phase("forward"):
            x = torch.empty(2000, dtype=torch.float32)
        with meter.phase("backward"):
            y = torch.empty(1000, dtype=torch.float32)
            del y
        peak = meter.take_step()
    assert (peak.phase, peak.allocated_bytes) == ("backward", 12000)
    del x


# --- summary ---------------------------------------------------------------------------------
def test_summary_compares_estimate_with_measured() -> None:
    records = [{"step": s, "loss": 5.0 - s, "tokens_per_s": 100.0 * s} for s in (1, 2, 3)]
    peaks = [{"allocated_bytes": 1000, "phase": "backward", "breakdown": {}},
             {"allocated_bytes": 800, "phase": "optimizer", "breakdown": {}}]
    summary = metrics.build_summary(records, peaks, {"peak_allocated_bytes": 900}, world_size=2)
    assert summary["first_loss"] == 4.0 and summary["last_loss"] == 2.0
    assert summary["mean_tokens_per_s"] == 250.0  # the first (warm-up) step is left out
    assert summary["error_percent"] == pytest.approx([-10.0, 12.5])
    assert "optimizer" in metrics.summary_table(summary)


def test_main_reports_missing_spec_in_one_line(capsys) -> None:
    from launcher.worker.__main__ import main

    assert main(["/nonexistent/run.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: run spec /nonexistent/run.json does not exist"]


def test_unsupported_backend_and_bad_framework_config() -> None:
    from launcher.worker.backends import check_backend

    with pytest.raises(ConfigError, match="backend='jax' is not supported by the worker yet"):
        check_backend(_spec(backend="jax", optimizer="adamw_torch"), 2)
    with pytest.raises(ConfigError, match=r"\['bucket_size'\] are not DistributedDataParallel arguments"):
        check_backend(_spec(backend="ddp", optimizer="adamw_torch", framework_config={"bucket_size": 1}), 2)
    with pytest.raises(ConfigError, match="optimizer='lion'"):
        check_backend(_spec(backend="ddp", optimizer="lion"), 2)
    with pytest.raises(ConfigError, match="strategy=single runs one process, not 2"):
        check_backend(_spec(backend="ddp", strategy="single", optimizer="adamw_torch"), 2)
    with pytest.raises(ConfigError, match="GPTQ base is planned only"):
        check_backend(_spec(backend="ddp", optimizer="adamw_torch", device="cuda",
                            peft={"quant_type": "gptq_int4"}), 1)
    with pytest.raises(ConfigError, match="torchao NF4 base is planned only"):
        check_backend(_spec(backend="ddp", optimizer="adamw_torch", device="cuda",
                            peft={"quant_type": "torchao_nf4"}), 1)


def test_check_validates_a_good_spec_without_training(tmp_path: Path) -> None:
    from launcher.runspec import RunSpec
    from launcher.worker import train

    hf = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 512}
    spec = RunSpec(run_dir=str(tmp_path), backend="ddp", strategy="ddp", model_name="tiny", hf_config=hf)
    train.check(spec)
    spec.seq_len, spec.micro_batch_size = 0, 0
    with pytest.raises(ConfigError) as err:
        train.check(spec)
    assert len(err.value.problems) == 2


def test_summary_compares_each_rank_with_its_own_estimate() -> None:
    from launcher.worker.metrics import estimated_per_rank

    per_rank = {"peak_allocated_bytes": 400, "per_rank_peak_allocated_bytes": [326, 400]}
    assert estimated_per_rank(per_rank, 2) == [326, 400]
    assert estimated_per_rank({"peak_allocated_bytes": 400, "per_rank_peak_allocated_bytes": []}, 2) == [400, 400]
    # a per-rank list that does not cover the world (tensor-parallel ranks) falls back to the headline
    assert estimated_per_rank({"peak_allocated_bytes": 400, "per_rank_peak_allocated_bytes": [326, 400]}, 4) == [400] * 4

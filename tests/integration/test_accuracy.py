"""A fast subset of the accuracy matrix (scripts/accuracy_matrix.py): `mode=measure` through the
CLI on 2 CPU processes; the estimated per-rank peak must be within 1% of the peak of live tensor
bytes the allocation tracker measures in the real run, and measure.json must carry the step time
measured without the tracker."""
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SMALL_BUCKETS = ("deepspeed.reduce_bucket_size=200000", "deepspeed.allgather_bucket_size=200000",
                 "deepspeed.stage3_prefetch_bucket_size=200000")
# (strategy, precision, gradient checkpointing, timing pass): one cell also runs the timing pass
# (a third torchrun per cell; the others skip it to keep the test short). Strategies at fp32 are
# checked to 1% by test_launch_runs.py (ZeRO-0/1/2 under `-m long`); these cells add mixed precision
# and checkpointing.
CELLS = [("ddp", "bf16-mixed", False, True), ("zero2", "bf16-mixed", False, False),
         ("zero1", "32-true", True, False)]
# per-op selective checkpointing (training.checkpoint_policy=selective_op), under the `long` marker
SELECTIVE = [pytest.param("fsdp2", "bf16-mixed", "selective_op", False, marks=pytest.mark.long, id="fsdp2-selective_op"),
             pytest.param("ddp", "32-true", "selective_op", False, marks=pytest.mark.long, id="ddp-32-selective_op")]
# reentrant checkpointing (training.checkpoint_policy=reentrant): ZeRO-3's hooks gather and release the
# parameters of each recomputed layer inside the nested backward
REENTRANT = [pytest.param("zero3", "bf16-mixed", "reentrant", False, id="zero3-reentrant"),
             pytest.param("fsdp2", "bf16-mixed", "reentrant", False, marks=pytest.mark.long, id="fsdp2-reentrant")]
BOUND_PERCENT = 1.0


@pytest.mark.parametrize("strategy,precision,ckpt,timing",
                         [pytest.param(*c, id=f"{c[0]}-{c[1]}-ckpt{c[2]}") for c in CELLS] + SELECTIVE + REENTRANT)
def test_measured_peak_matches_estimate(cli, strategy, precision, ckpt, timing):
    run_dir = cli.cwd / "run"
    policy = ckpt if isinstance(ckpt, str) else "full"
    r = cli("model=tiny-llama", "hardware=cpu", "gpus=2", f"strategy={strategy}", "mode=measure", "report=json",
            "training.seq_len=128", "training.micro_batch_size=2", f"training.precision={precision}",
            f"training.gradient_checkpointing={str(bool(ckpt)).lower()}", f"training.checkpoint_policy={policy}",
            "measure.memory_steps=2",
            f"measure.timing_steps={2 if timing else 0}", "measure.warmup_steps=1", *SMALL_BUCKETS, f"hydra.run.dir={run_dir}",
            timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    result = _within_bound(run_dir)
    assert ("time" in result) == timing
    if not timing:
        return
    t = result["time"]
    assert len(t["step_s"]) == 3 and t["measured_step_s"] > 0
    assert t["measured_step_s"] == pytest.approx(sorted(t["step_s"][1:])[0] / 2 + sorted(t["step_s"][1:])[1] / 2)
    assert not (run_dir / "memory" / "checkpoints").exists()


def test_zero3_lora_with_checkpointing_holds_the_embedding(cli):
    """ZeRO-3 LoRA with checkpointing: transformers makes the frozen embedding's output require
    grad (enable_input_require_grads), so DeepSpeed hooks its backward and keeps it gathered to the
    end of backward (zero3.py `forward_only_params`). small-llama's 32k-token embedding is 16 MB
    in bf16, 10% of the step's peak: released after forward, the estimate read -10.4%."""
    run_dir = _measure(cli, "model=small-llama", "gpus=2", "strategy=zero3", "peft=lora",
                       "training.gradient_checkpointing=true", "training.seq_len=128", "training.micro_batch_size=2",
                       "training.precision=bf16-mixed", *SMALL_BUCKETS, timeout=240)
    _within_bound(run_dir)


@pytest.mark.parametrize("strategy", ["zero3", pytest.param("zero2", marks=pytest.mark.long)])
def test_deepspeed_qlora_measured_peak_matches_estimate(cli, strategy):
    """ZeRO-3 QLoRA as PEFT's DeepSpeed guide runs it: the 4-bit weights stored as bf16 and
    partitioned like any frozen bf16 parameter, their quantization states whole on every rank, and
    the frozen embedding released after its forward (its module runs no backward). small-llama's
    32k-token embedding and its 4-bit Linears are large enough to show either: with the 4-bit
    weights partitioned as 16-bit ones the estimate read +4.5%, with the embedding held gathered to
    the end of backward +11.4%. ZeRO-2 holds the 4-bit base whole, in bitsandbytes' uint8 storage."""
    run_dir = _measure(cli, "model=small-llama", "gpus=2", f"strategy={strategy}", "peft=qlora",
                       "training.seq_len=128", "training.micro_batch_size=2", "training.precision=bf16-mixed",
                       *SMALL_BUCKETS, timeout=240)
    _within_bound(run_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    chosen = plan["candidates"][plan["chosen"]]
    assert chosen["strategy"] == strategy and chosen["peft"]["quant_type"] == "nf4"
    assert chosen["peft"]["upcast_non_quantized"] is False
    assert chosen["peft"]["quant_storage"] == ("bfloat16" if strategy == "zero3" else None)


@pytest.mark.parametrize("max_live", [40_000, pytest.param(1_000_000_000, marks=pytest.mark.long)])
def test_zero3_prefetch_window_measured_peak_matches_estimate(cli, max_live):
    """ZeRO-3 with every parameter released after its module (stage3_max_reuse_distance=0) and a
    prefetch bucket smaller than any parameter: each module fetch, parameter-less modules
    included, prefetches one more parameter while fewer than stage3_max_live_parameters elements
    are gathered, so the gathered set grows to that limit (tiny-llama: 133,120 gatherable
    elements). With the limit counted as one prefetch bucket the estimate read -2.1% (limit 40,000)
    and -9.8% (DeepSpeed's default 10**9, where the whole model ends up gathered)."""
    run_dir = _measure(cli, "model=tiny-llama", "gpus=2", "strategy=zero3", "training.seq_len=64",
                       "training.micro_batch_size=2", "training.precision=32-true",
                       "deepspeed.reduce_bucket_size=200000", "deepspeed.stage3_prefetch_bucket_size=1000",
                       "deepspeed.stage3_param_persistence_threshold=100",
                       "deepspeed.stage3_max_reuse_distance=0",
                       f"deepspeed.stage3_max_live_parameters={max_live}", timeout=240)
    _within_bound(run_dir)


def test_lora_with_the_base_trained_measured_peak_matches_estimate(cli):
    """peft.train_base=true (DeepSpeed-Chat's LoRA layers without --only_optimize_lora): the
    adapters and every base parameter train, so the base gets gradients and optimizer states."""
    run_dir = _measure(cli, "model=tiny-llama", "gpus=2", "strategy=ddp", "peft=lora", "peft.train_base=true",
                       "training.seq_len=128", "training.micro_batch_size=2", "training.precision=bf16-mixed",
                       timeout=240)
    _within_bound(run_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    chosen = plan["candidates"][plan["chosen"]]
    assert chosen["num_trainable_params"] == plan["model"]["num_params"] and chosen["peft"]["train_base"] is True


def _needs_shardformer():
    from launcher.environment import SHARDFORMER, detect
    return pytest.mark.skipif(SHARDFORMER not in detect().installed,
                              reason="no ColossalAI environment (scripts/setup builds .venv-colossalai)")


# (strategy, precision, optimizer): the optimizer steps whose memory the backends model rather than
# trace, each checked where its own temporaries are the peak (small-llama at 32 tokens); under
# `-m long` the cells whose mechanism a default cell shares: ZeRO-0's buckets (zero0 at bf16-mixed),
# the 32-true gradient norm of stage_1_and_2.py (zero1), Adafactor's factored states (cai_pp's masters)
STEP_CELLS = [
    ("zero0", "bf16-mixed", "sgd_plain"), pytest.param("zero0", "32-true", "sgd_plain", marks=pytest.mark.long),
    ("zero2", "bf16-mixed", "sgd_plain"), pytest.param("zero2", "32-true", "sgd_plain", marks=pytest.mark.long),
    ("zero1", "32-true", "sgd_plain"), pytest.param("zero0", "bf16-mixed", "adafactor", marks=pytest.mark.long),
    ("zero2", "bf16-true", "adafactor"),
    pytest.param("cai_zero2", "bf16-mixed", "sgd_plain", marks=pytest.mark.long),
    pytest.param("cai_pp", "bf16-mixed", "adafactor", marks=_needs_shardformer())]


@pytest.mark.parametrize("strategy,precision,optimizer", STEP_CELLS)
def test_optimizer_step_measured_peak_matches_estimate(cli, strategy, precision, optimizer):
    """small-llama at 32 tokens peaks in the optimizer step, where AdamW's temporaries no longer hide
    the frameworks' own. Each cell once read far off:
    - plain SGD (training.sgd_momentum=0, no state) where DeepSpeed's and ColossalAI's layouts laid
      out momentum buffers: +19%;
    - ZeRO-1/2's gradient norm converts the partition's largest piece (here the 32k x 256 embedding)
      to fp64: without it -4.7% at bf16-mixed, -12.3% at 32-true; at 32-true `.to(fp32)` returns the
      flat gradient partition as is: +5.3% with a second copy;
    - ZeRO-0 at bf16 wraps the torch optimizer in FP16_UnfusedOptimizer (per-parameter fp32 masters
      and gradients, the bf16 gradients kept through the step): +33% laid out as the flat
      FP16_Optimizer, which only wraps FusedAdam;
    - ZeRO-0's all-reduce buckets hold up to 500M elements whatever `reduce_bucket_size` says: its
      small value here capped the full-depth bucket, -1.3% at 32-true;
    - Adafactor's states are factored per 2-D parameter where the optimizer steps parameters (ZeRO-0,
      the pipeline stages' masters): +26% and +59% as one flat tensor's; they are fp32 and it steps a
      bf16 partition through fp32 copies of it and its gradient (bf16-true): -40% in the master dtype;
    - ColossalAI's mixed-precision optimizer drops each bf16 gradient as it makes the fp32 one, before
      the gradient norm: +12% with the bf16 gradients kept to the norm;
    - ZeRO-1's reduce walk (no overlap_comm) moves each small gradient into the bucket before rank 1's
      partition is allocated (its peak, in backward): +2.6% with every gradient still held (now
      +0.3-0.7%; the rest is not found)."""
    run_dir = cli.cwd / "run"
    optim = ("training.optimizer=sgd", "training.sgd_momentum=0") if optimizer == "sgd_plain" else (
        f"training.optimizer={optimizer}",)
    r = cli("model=small-llama", "hardware=cpu", "gpus=2", f"strategy={strategy}", "mode=measure", "report=json",
            f"training.precision={precision}", "training.seq_len=32", "training.micro_batch_size=1", *optim,
            "measure.memory_steps=2", "measure.timing_steps=0", "measure.warmup_steps=1", *SMALL_BUCKETS,
            f"hydra.run.dir={run_dir}", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    _ranks_within_bound(run_dir)


def test_deepspeed_lora_at_16_bits_is_built_in_16_bits(cli):
    """DeepSpeed casts the module to bf16 itself; a worker that built it in fp32 held the fp32 model
    first, which on CPU processes (host = device) was the run's peak: small-llama LoRA at ZeRO-0
    measured 89.3 MiB in setup against a 50.0 MiB step (-44%). Built in the dtype the engine casts
    to, as from_pretrained(dtype=...) loads it, the step is the peak again."""
    run_dir = _measure(cli, "model=small-llama", "gpus=2", "strategy=zero0", "peft=lora",
                       "training.precision=bf16-mixed", "training.seq_len=32", "training.micro_batch_size=1",
                       "training.optimizer=sgd")
    for row in json.loads((run_dir / "measure.json").read_text())["memory"]:
        assert row["measured_peak_phase"] != "setup", row
        assert abs(row["error_percent"]) <= BOUND_PERCENT, row


@pytest.mark.parametrize("peft", ["lora", pytest.param("qlora", marks=pytest.mark.long)])
def test_ddp_construction_broadcast_measured_peak_matches_estimate(cli, peft):
    """DDP's constructor broadcasts the module state from rank 0 through flat buckets
    (`_broadcast_coalesced`: a copy of up to 250 MiB per bucket, two in flight). Under a bf16 LoRA
    step at 32 tokens that copy is the run's peak: small-llama read -31.8% (setup 73.8 MiB against
    a 50.3 MiB step) before the setup phase was laid out. Under QLoRA the 4-bit weights are
    broadcast as their packed bytes (counted at their traced bf16 size: +6.4%)."""
    run_dir = _measure(cli, "model=small-llama", "gpus=2", "strategy=ddp", f"peft={peft}",
                       "training.precision=bf16-true", "training.seq_len=32", "training.micro_batch_size=1")
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["candidates"][plan["chosen"]]["memory"]["peak_phase"] == "setup"
    rows = _within_bound(run_dir)["memory"]
    assert all(row["measured_peak_phase"] == "setup" for row in rows), rows


def test_host_build_measured_peak_matches_estimate(cli):
    """On CPU processes the worker builds the whole model on the host, which is the device: a
    LoRA step at 8 tokens on small-bloom (an LM head tied to a 32000-token embedding, whose own
    weight the construction allocates before `tie_weights` drops it) holds less than that build.
    Without the build's `setup` phase the estimate read -32.5% (40.8 MiB against 60.4)."""
    run_dir = _measure(cli, "model=small-bloom", "gpus=1", "strategy=single", "peft=lora",
                       "training.precision=bf16-true", "training.seq_len=8", "training.micro_batch_size=1")
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["candidates"][plan["chosen"]]["memory"]["peak_phase"] == "setup"
    rows = _within_bound(run_dir, world=1)["memory"]
    assert all(row["measured_peak_phase"] == "setup" for row in rows), rows


def test_fsdp2_forward_all_gather_measured_peak_matches_estimate(cli):
    """A LoRA step at 32 tokens peaks in the forward, at the first block's all-gather copy-out,
    while the root's all-gather output is still alive: `wait_for_unshard` releases the previous
    group's result only when it returns. Freed before the copy-out, small-llama read -1.7% (one
    layer's gathered parameters)."""
    run_dir = _measure(cli, "model=small-llama", "gpus=2", "strategy=fsdp2", "peft=lora",
                       "training.precision=32-true", "training.seq_len=32", "training.micro_batch_size=1")
    rows = _within_bound(run_dir)["memory"]
    assert all(row["measured_peak_phase"] == "forward" for row in rows), rows


# (strategy, model, seq_len, micro_batch_size, more overrides): small-llama's step peaks where its
# gradients are, the tiny one's in backward under its activations, where the ZeRO optimizers' buffers
# show; FSDP2 at 8 layers, where the full-depth rebuild must hold each block's accumulated gradients
DEEPER = ("model.hf_config.num_hidden_layers=8",)
ACCUMULATION_CELLS = [("ddp", "small-llama", 32, 1, ()), ("fsdp2", "small-llama", 32, 1, DEEPER),
                      ("zero0", "tiny-llama", 256, 4, ()), ("zero1", "tiny-llama", 256, 4, ()),
                      pytest.param("zero2", "tiny-llama", 256, 4, (), marks=pytest.mark.long),
                      pytest.param("cai_zero1", "tiny-llama", 256, 4, (), marks=pytest.mark.long),
                      pytest.param("cai_zero2", "tiny-llama", 256, 4, (), marks=pytest.mark.long)]


@pytest.mark.parametrize("strategy,model,seq_len,micro,more", ACCUMULATION_CELLS)
def test_gradient_accumulation_measured_peak_matches_estimate(cli, strategy, model, seq_len, micro, more):
    """Two micro-batches per optimizer step (training.global_batch_size): the step laid out is the
    last micro-batch's, with what the earlier ones leave alive from its start. Laid out as a single
    micro-batch these read: DDP -21% (the accumulated gradients outside the buckets under
    `no_sync`), FSDP2 -14% (the accumulated sharded gradients; -2.9% at 8 layers with one block's
    rebuilt at the real depth), ZeRO-0 -5.7% and ZeRO-1 -5.5% (autograd's summed gradients, and at
    ZeRO-1 the first micro-batch's ipg bucket, released only at the boundary), ZeRO-2 and
    ColossalAI's -1.2% to -2.3% (the partition every micro-batch reduces into; stage 1's no_sync
    gradients)."""
    run_dir = _measure(cli, f"model={model}", *more, "gpus=2", f"strategy={strategy}",
                       "training.precision=bf16-mixed", f"training.seq_len={seq_len}",
                       f"training.micro_batch_size={micro}", f"training.global_batch_size={4 * micro}",
                       "training.optimizer=sgd", *SMALL_BUCKETS)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["candidates"][plan["chosen"]]["grad_accum_steps"] == 2
    _ranks_within_bound(run_dir)


# (strategy, gpus, more overrides): DDP's gradients copied into its buckets, and one unwrapped process
# (their gradients kept beside the activations), DDP's bucket views with two micro-batches per step
# (the zeroed views stay the gradients: nothing is kept outside them), FSDP2's and FSDP1's sharded
# gradients (FSDP2 at 8 layers too, where the full-depth rebuild holds each block's)
KEPT_GRADIENT_CELLS = [("ddp", 2, ("ddp.gradient_as_bucket_view=false",)), ("single", 1, ()),
                       ("ddp", 2, ("training.global_batch_size=16",)), ("fsdp2", 2, ()), ("fsdp1", 2, ()),
                       ("fsdp2", 2, DEEPER)]


@pytest.mark.parametrize("strategy,gpus,more", KEPT_GRADIENT_CELLS)
def test_kept_gradients_measured_peak_matches_estimate(cli, strategy, gpus, more):
    """`zero_grad(set_to_none=False)`, torch 1.x's default (training.zero_grad_set_to_none=false):
    the gradients are zeroed in place and stay allocated through the next step's forward, where
    tiny-llama's step peaks under its activations. Laid out with the gradients dropped, as
    set_to_none=True runs, these read: DDP without bucket views -3.6%, single -3.8%, FSDP2 and
    FSDP1 -2.3%, FSDP2 at 8 layers -2.6%; with kept gradients added beside DDP's bucket views, +3.8%."""
    run_dir = _measure(cli, "model=tiny-llama", f"gpus={gpus}", f"strategy={strategy}", *more,
                       "training.precision=bf16-mixed", "training.seq_len=256", "training.micro_batch_size=4",
                       "training.zero_grad_set_to_none=false", *SMALL_BUCKETS)
    _ranks_within_bound(run_dir, world=gpus)


@_needs_shardformer()
@pytest.mark.long
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_pipeline_accumulation_over_two_schedules_measured_peak_matches_estimate(cli, zero_stage):
    """cai_pp with 4 micro-batches per optimizer step and num_microbatches = pp = 2: the worker runs
    two 1F1B schedules, and the second one's forwards run with the first one's gradients alive (in
    autograd's .grad, or with ZeRO-1 in LowLevelZero's gradient store). Laid out as one schedule,
    stage 0 read -1.3% (zero_stage 0), the last stage -1.7% (zero_stage 1)."""
    run_dir = _measure(cli, "model=tiny-llama", "gpus=2", "strategy=cai_pp",
                       f"colossalai.zero_stage={zero_stage}", "training.precision=bf16-mixed",
                       "training.seq_len=256", "training.micro_batch_size=4", "training.global_batch_size=16",
                       "training.optimizer=sgd")
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["candidates"][plan["chosen"]]["grad_accum_steps"] == 4
    _ranks_within_bound(run_dir)


@_needs_shardformer()
@pytest.mark.long
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_hybrid_zero_accumulation_measured_peak_matches_estimate(cli, zero_stage):
    """cai_tp at tp 2 x dp 2 with ZeRO and 4 micro-batches per step: the worker uses no_sync only
    for LowLevelZeroPlugin, so HybridParallel's ZeRO reduces every micro-batch, stage 1 adding into
    the store the first one filled (alive from the step's start), stage 2 into its partitions.
    Laid out as one micro-batch: -1.8% (stage 1), -0.9% (stage 2). Four processes."""
    run_dir = _measure(cli, "model=tiny-llama", "gpus=4", "strategy=cai_tp", "colossalai.tp_size=2",
                       f"colossalai.zero_stage={zero_stage}", "training.precision=bf16-mixed",
                       "training.seq_len=256", "training.micro_batch_size=4", "training.global_batch_size=16",
                       "training.optimizer=sgd", timeout=400)
    _ranks_within_bound(run_dir, world=4)


@_needs_shardformer()
def test_pipeline_zero1_measured_peak_matches_estimate(cli):
    """cai_pp with colossalai.zero_stage=1: LowLevelZero holds each stage's own parameters, and
    `execute_pipeline` reduces after the schedule. Bounded by the whole model's ZeRO-1 layout plus
    the in-flight micro-batches, small-llama read +65%."""
    run_dir = _measure(cli, "model=small-llama", "gpus=2", "strategy=cai_pp", "colossalai.zero_stage=1",
                       "training.precision=bf16-mixed", "training.seq_len=32", "training.micro_batch_size=1")
    _ranks_within_bound(run_dir)


def _ranks_within_bound(run_dir, world: int = 2) -> None:
    """Each of the `world` ranks' measured peak within BOUND_PERCENT of its own estimate (ranks
    differ: ZeRO-1/2 gradient partitions, pipeline stages)."""
    rows = json.loads((run_dir / "measure.json").read_text())["memory"]
    assert [row["rank"] for row in rows] == list(range(world))
    for row in rows:
        err = 100 * (row["estimated_peak_bytes"] - row["measured_peak_bytes"]) / row["measured_peak_bytes"]
        assert abs(err) <= BOUND_PERCENT, (row, err)


def _measure(cli, *overrides, timeout: int = 300) -> Path:
    """A `mode=measure` run on CPU processes (one warm-up step, two with the memory tracker, no
    timing) with `overrides`; its run directory."""
    run_dir = cli.cwd / "run"
    r = cli(*overrides, "hardware=cpu", "mode=measure", "report=json", "measure.memory_steps=2",
            "measure.timing_steps=0", "measure.warmup_steps=1", f"hydra.run.dir={run_dir}", timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return run_dir


def _within_bound(run_dir, world: int = 2) -> dict:
    """measure.json, after checking each of the `world` ranks' estimated peak is the plan's and
    within BOUND_PERCENT of its measured peak."""
    result = json.loads((run_dir / "measure.json").read_text())
    assert [row["rank"] for row in result["memory"]] == list(range(world))
    plan = json.loads((run_dir / "plan.json").read_text())
    estimated = plan["candidates"][plan["chosen"]]["memory"]["peak_allocated_bytes"]
    for row in result["memory"]:
        assert row["estimated_peak_bytes"] == estimated
        err = 100 * (estimated - row["measured_peak_bytes"]) / row["measured_peak_bytes"]
        assert abs(err) <= BOUND_PERCENT, (row, err)
        assert row["error_percent"] == pytest.approx(err)
    return result

"""The plan as a user reads it: JSON contract, ranking, the chosen candidate, what fits."""
import json
import re

import pytest

from launcher import planner, report
from launcher.app import model_spec
from launcher.cli import compose
from launcher.hardware import cluster_from


def make_plan(tmp_path, *overrides):
    config = compose(["model=tiny-llama", "hardware=a100-80g", "training.seq_len=128", f"cache_dir={tmp_path}",
                      *overrides])
    spec = model_spec(config)
    cluster = cluster_from(config.hardware, config.gpus, config.nodes)
    return planner.plan(config, spec, cluster), cluster


def test_single_is_a_candidate_on_one_gpu_only(tmp_path):
    one, _ = make_plan(tmp_path, "gpus=1", "training.micro_batch_size=1")
    two, _ = make_plan(tmp_path, "gpus=2", "training.micro_batch_size=1")
    assert "single" in {c.strategy.name for c in one.candidates}
    assert "single" not in {c.strategy.name for c in two.candidates}
    assert not [n for n in two.notes if n.startswith("single")]  # not a missing candidate worth a note


def test_json_contract(tmp_path):
    plan, cluster = make_plan(tmp_path, "gpus=2", "training.seq_len=128")
    d = json.loads(json.dumps(report.plan_to_dict(plan, cluster.memory_bytes)))
    assert {"model", "hardware", "gpus", "nodes", "candidates", "chosen"} <= set(d)
    assert d["model"]["num_params"] > 0 and d["gpus"] == 2 and d["nodes"] == 1
    assert isinstance(d["chosen"], int)
    for c in d["candidates"]:
        assert {"strategy", "backend", "micro_batch_size", "grad_accum_steps", "fits", "reason", "memory",
                "speed"} <= set(c)
        m = c["memory"]
        assert {"peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "capacity_bytes",
                "host_bytes", "breakdown"} <= set(m)
        assert set(m["breakdown"]) == {"parameters", "gradients", "optimizer_states", "activations",
                                       "buffers", "runtime"}
        # the three views are ordered: allocated <= reserved <= device total
        assert m["peak_allocated_bytes"] <= m["peak_reserved_bytes"] <= m["device_total_bytes"]
        assert m["capacity_bytes"] == cluster.memory_bytes
        assert {"step_s", "tokens_per_s"} <= set(c["speed"]) and c["speed"]["step_s"] > 0


def test_chosen_is_the_fastest_that_fits(tmp_path):
    plan, _ = make_plan(tmp_path, "gpus=4", "training.seq_len=256")
    best = plan.candidates[plan.chosen]
    assert best.fits
    assert all(c.speed.tokens_per_s <= best.speed.tokens_per_s for c in plan.candidates if c.fits)
    assert {c.strategy.name for c in plan.candidates} >= {"ddp", "zero1", "zero2", "zero3"}
    for c in plan.candidates:
        if c is not best:
            assert c.reason.startswith("OOM") or "slower" in c.reason or "not launchable" in c.reason \
                or "as fast as the chosen" in c.reason or "ties with the chosen" in c.reason, c.reason
            if "as fast as the chosen" in c.reason:  # a tie goes to the smaller device total
                assert c.memory.device_total_bytes >= best.memory.device_total_bytes


def test_exact_configuration_when_strategy_and_micro_batch_given(tmp_path):
    plan, _ = make_plan(tmp_path, "gpus=2", "strategy=zero2", "training.micro_batch_size=3",
                        "training.global_batch_size=12")
    (c,) = plan.candidates
    assert (c.strategy.name, c.micro_batch_size, c.grad_accum_steps) == ("zero2", 3, 2)


def test_nothing_fits_says_what_would(tmp_path):
    plan, _ = make_plan(tmp_path, "gpus=2", "hardware.memory_bytes=1000000")
    assert plan.chosen is None and not any(c.fits for c in plan.candidates)
    assert any("nothing fits" in n and "gpus=4" in n for n in plan.notes)
    assert all(c.reason.startswith("OOM") for c in plan.candidates)
    # stepping in backward with a paged optimizer is a one-GPU way out (strategy=single only)
    assert not any("optimizer_in_backward" in n for n in plan.notes)
    one, _ = make_plan(tmp_path, "gpus=1", "hardware.memory_bytes=1000000")
    assert any("nothing fits" in n and "training.optimizer_in_backward=true" in n for n in one.notes)


def test_more_gpus_never_need_more_memory_per_gpu_under_zero3(tmp_path):
    peaks = []
    for gpus in (2, 4, 8):
        plan, _ = make_plan(tmp_path, f"gpus={gpus}", "strategy=zero3", "training.micro_batch_size=1")
        peaks.append(plan.candidates[0].memory.peak_allocated_bytes)
    assert peaks[0] >= peaks[1] >= peaks[2]


@pytest.mark.parametrize("model,published", [("bloom-1b1", 1_065_314_304), ("llama-2-7b", 6_738_415_616)])
def test_cli_json_plan_counts_the_published_parameters(cli, model, published):
    """The parameter count is extrapolated from the shallow traced models; the published count
    comes from the model card."""
    r = cli(f"model={model}", "gpus=4", "report=json", "strategy=zero3", "training.micro_batch_size=1")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["model"]["num_params"] == published
    assert (cli.cwd / "runs").exists() and len(list((cli.cwd / "runs").glob("*/*/plan.json"))) == 1


@pytest.mark.parametrize("model,published,strategy", [("bloom-1b1", 1_065_314_304, "cai_tp"),
                                                      ("llama-2-7b", 6_738_415_616, "fsdp2_tp")])
def test_tensor_parallel_plan_counts_the_whole_model(cli, model, published, strategy):
    """A tensor-parallel trace holds one rank's shard; the plan still names the whole model's
    parameters, and its candidate trains all of them (full fine-tuning)."""
    r = cli(f"model={model}", "gpus=2", "report=json", f"strategy={strategy}", "training.micro_batch_size=1")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["model"]["num_params"] == published
    chosen = d["candidates"][d["chosen"]]
    assert chosen["layout"]["tp_size"] == 2 and chosen["num_trainable_params"] == published


def test_every_rank_building_the_whole_model_on_the_host_is_checked_against_host_ram(cli):
    """Each of a node's ranks builds the whole model on the host before its backend moves or
    shards it: 8 ranks of Llama-2-7B (6,738,415,616 parameters, model card) built in fp32 (torch
    backends under bf16-mixed autocast) need 8 x 4 bytes each, over a 150 GiB host; DeepSpeed
    builds in bf16, half of that, and fits."""
    r = cli("model=llama-2-7b", "gpus=8", "hardware=a100-80g", "hardware.host_memory_bytes=161061273600",
            "report=json", "training.micro_batch_size=1")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    fp32_build = 8 * 6_738_415_616 * 4 / 2**30
    builds = [c for c in d["candidates"] if c["reason"].startswith("host RAM: building the whole model")]
    assert {c["backend"] for c in builds} >= {"fsdp2", "colossalai"}
    for c in builds:
        need = float(re.search(r"needs ([\d.]+) GiB per node", c["reason"]).group(1))
        assert fp32_build - 0.01 <= need <= 1.02 * fp32_build, c["reason"]  # the reason rounds to 0.01 GiB
    chosen = d["candidates"][d["chosen"]]
    assert chosen["backend"] == "deepspeed" and chosen["fits"]


def test_a_global_batch_one_pipeline_layout_cannot_step_leaves_the_others_planned(cli):
    """With training.global_batch_size=8 on 4 GPUs, a 2-stage pipeline at micro-batch 4 would
    accumulate 1 micro-batch where its 1F1B schedule runs 2: those sizes are left out with one
    note, and every other strategy and size is planned (the whole plan used to stop with the
    pipeline's error)."""
    r = cli("model=tiny-llama", "gpus=4", "hardware=a100-80g", "training.global_batch_size=8",
            "training.seq_len=64", "report=json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    left = [n for n in d["notes"] if n.startswith("cai_pp not planned at micro-batch")]
    assert len(left) == 1 and "colossalai.num_microbatches=2" in left[0], d["notes"]
    assert len(d["notes"]) == len(set(d["notes"]))
    pipelines = [c for c in d["candidates"] if c["strategy"] == "cai_pp"]
    assert pipelines and all(c["micro_batch_size"] * c["grad_accum_steps"] * 4 // (c["layout"]["tp_size"] * 2) == 8
                             for c in pipelines)


def test_offloading_never_needs_more_gpu_memory_and_no_term_is_negative(cli):
    """CPU offload moves sharded parameters, gradients and optimizer states off the GPU: at the
    same micro-batch it needs no more device memory than the strategy without it, and every term
    of its breakdown is a size. Offload layouts were extrapolated per segment from depths 2 and 3,
    whose backward peaks fall at different moments: Llama-2-7B's fsdp2_offload read 11.8 GiB of
    parameters (the whole bf16 model) and -1.8 GiB of gradients at micro-batch 1."""
    plans = {}
    for strategy in ("fsdp2", "fsdp2_offload", "zero3", "zero3_offload"):
        r = cli("model=llama-2-7b", "gpus=8", "hardware=a100-80g", f"strategy={strategy}",
                "training.micro_batch_size=1", "report=json")
        assert r.returncode == 0, r.stderr
        plans[strategy] = json.loads(r.stdout)["candidates"][0]["memory"]
    for strategy, m in plans.items():
        assert all(v >= 0 for v in m["breakdown"].values()), (strategy, m["breakdown"])
    for base in ("fsdp2", "zero3"):
        assert plans[f"{base}_offload"]["peak_allocated_bytes"] < plans[base]["peak_allocated_bytes"]


@pytest.mark.parametrize("hardware,noted", [("v100-16g", True), ("a100-80g", False)])
def test_bf16_before_ampere_is_noted_with_the_fp16_alternative(cli, hardware, noted):
    """Volta and Turing have no bf16 tensor cores: a bf16 plan there says so and names
    training.precision=16-mixed; an Ampere plan does not."""
    r = cli("model=gpt2", "gpus=1", f"hardware={hardware}", "strategy=single", "training.micro_batch_size=1",
            "training.seq_len=128", "report=json")
    assert r.returncode == 0, r.stderr
    notes = [n for n in json.loads(r.stdout)["notes"] if "no bf16 tensor cores" in n]
    assert bool(notes) is noted and all("training.precision=16-mixed" in n for n in notes)

"""FSDP2 backend (launcher/backends/fsdp2/): shards against torch's own FSDP2, the emitted plan and
Accelerate config through their consumers (the worker's check, Accelerate's loader and plugin),
and the 8-GPU plan that carries FSDP2 candidates."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.backends.fsdp2.emit import accelerate_config, plan_config
from launcher.backends.fsdp2.layout import chunk_numels, groups
from launcher.backends.base import Ask
from launcher.backends.fsdp2 import BACKEND
from launcher.backends.fsdp2.rules import STRATEGIES
from launcher.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("shape,world", [((320, 64), 2), ((321, 64), 2), ((5,), 4), ((3, 7), 8), ((176, 64), 3)])
def test_chunks_are_torch_chunk_padded_to_the_first(shape, world):
    """What each rank's optimizer states hold (the unpadded chunk) and its sharded parameter's
    storage (the first chunk's size): torch.chunk itself, with empty chunks for missing ranks."""
    import torch

    t = torch.empty(shape)
    chunks = list(torch.chunk(t, world, dim=0))
    chunks += [t.new_empty(0)] * (world - len(chunks))
    padded, local = chunk_numels(shape, world)
    assert local == [c.numel() for c in chunks]
    assert padded == chunks[0].numel()
    assert sum(local) == math.prod(shape)


FSDP_SHARDS = r"""
import json, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import LlamaConfig, LlamaForCausalLM
out = []
for rank in range(2):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=175, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=321))
    for layer in m.model.layers:
        fully_shard(layer)
    fully_shard(m)
    padded = local = 0
    for module in [*m.model.layers, m]:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for p in group.fsdp_params:
                padded += p._sharded_param_data.numel()
                local += p.sharded_param.to_local().numel()
    out.append([padded, local])
    dist.destroy_process_group()
print(json.dumps(out))
"""


def test_shards_match_fully_shard_on_an_uneven_model():
    """Every rank's sharded storage (padded) and unpadded chunk numel, summed over the groups, as
    torch's fully_shard makes them on a fake 2-rank process group (vocabulary 321 and
    intermediate 175: rows that 2 does not divide)."""
    from launcher import trace

    real = json.loads(subprocess.run([sys.executable, "-c", FSDP_SHARDS], capture_output=True, text=True, check=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.splitlines()[-1])
    key = trace.TraceKey(hf_config_json=trace.canonical_config_json(dict(
        model_type="llama", hidden_size=64, intermediate_size=175, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=321, max_position_embeddings=512)), num_layers=2, micro_batch_size=1,
        seq_len=8, optimizer="none")
    t = trace.trace_step(key)
    assert t.num_layers == 2
    gs = groups(t, 2).values()
    estimated = [[sum(g.padded_shard for g in gs), sum(g.local[r] for g in gs)] for r in range(2)]
    assert estimated == real
    assert real[0][1] != real[1][1]  # the ranks differ


QLORA_SHARDS = r"""
import json, torch, torch.distributed as dist, warnings
warnings.filterwarnings("ignore")
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import LlamaConfig, LlamaForCausalLM
from launcher.peft import LoraSettings, apply_lora, quantize_base_4bit
out = []
for rank in range(2):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=321)).to(torch.bfloat16)
    lora = LoraSettings(r=4, alpha=8, dropout=0.0, quant_type="nf4", double_quant=True, compute_dtype="bfloat16",
                        upcast_non_quantized=False, quant_storage="bfloat16")
    m = apply_lora(quantize_base_4bit(m, lora, "cpu"), lora)
    state, seen = 0, set()
    for mod in m.modules():  # peft's LoRA wrapper shows its base layer's weight again: count each once
        qs = getattr(getattr(mod, "weight", None), "quant_state", None)
        if qs is not None and id(qs) not in seen:
            seen.add(id(qs))
            state += qs.absmax.nbytes + qs.code.nbytes
            if qs.nested:
                state += qs.state2.absmax.nbytes + qs.state2.code.nbytes + qs.offset.nbytes
    layers = m.base_model.model.model.layers
    for layer in layers:
        fully_shard(layer)
    fully_shard(m)
    sharded = 0
    for module in [*layers, m]:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for p in group.fsdp_params:
                sharded += p._sharded_param_data.numel() * p._sharded_param_data.element_size()
    out.append([sharded, state])
    dist.destroy_process_group()
print(json.dumps(out))
"""


def test_sharded_qlora_matches_fully_shard():
    """Sharded QLoRA: what fully_shard keeps per rank (the padded shards of the bf16-stored 4-bit
    weights, of the bf16 base and of the fp32 adapters) and what bitsandbytes keeps outside them
    (each weight's QuantState), on a fake 2-rank process group, against the FSDP2 layout's
    `sharded_params` and `quant_state` terms on the traced QLoRA step."""
    from launcher import trace
    from launcher.backends.fsdp2.layout import fsdp2_layout, setup
    from launcher.memory.common import four_bit_params
    from launcher.types import Workload

    real = json.loads(subprocess.run([sys.executable, "-c", QLORA_SHARDS], capture_output=True, text=True, check=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.splitlines()[-1])
    key = trace.TraceKey(hf_config_json=trace.canonical_config_json(dict(
        model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=321, max_position_embeddings=512)), num_layers=2, micro_batch_size=1,
        seq_len=8, param_dtype="bfloat16", optimizer="none", trainable="lora", lora_r=4, lora_alpha=8,
        quant_type="nf4", double_quant=True, adapter_autocast=False)
    t = trace.trace_step(key)
    assert four_bit_params(t)
    wl = Workload(seq_len=8, micro_batch_size=1, precision="bf16-mixed", optimizer="adamw_torch",
                  gradient_checkpointing=False, attn_implementation="sdpa")
    for rank, (sharded, state) in enumerate(real):
        terms = {term.name: term.nbytes for term in fsdp2_layout(t, setup(STRATEGIES["fsdp2"], wl, 2, rank, 2)).terms}
        assert (terms["sharded_params"], terms["quant_state"]) == (sharded, state)


def _spec(strategy: str, precision: str, world: int, **kw):
    return SimpleNamespace(framework_config=plan_config(STRATEGIES[strategy], precision, world), backend="fsdp2",
                           strategy=strategy, precision=precision, optimizer=kw.get("optimizer", "adamw_torch"),
                           device="cpu", hf_config={"model_type": kw.get("model_type", "llama")}, peft={})


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp2_grad_op", "fsdp2_tp"])
def test_plan_json_is_what_the_worker_accepts(strategy):
    """The worker's own check (the capability table, then the plan against the processes)."""
    from launcher.worker.backends import check_backend

    check_backend(_spec(strategy, "bf16-mixed", 2), 2)
    with pytest.raises(ConfigError, match="does not cover the 4 processes"):
        check_backend(_spec(strategy, "bf16-mixed", 2), 4)
    with pytest.raises(ConfigError, match="precision=16-mixed"):
        check_backend(_spec(strategy, "16-mixed", 2), 2)
    if strategy == "fsdp2_tp":
        with pytest.raises(ConfigError, match="model_type=bloom"):
            check_backend(_spec(strategy, "bf16-mixed", 2, model_type="bloom"), 2)


def test_plan_json_fields():
    plan = plan_config(STRATEGIES["fsdp2_tp"], "bf16-mixed", 8)
    assert plan["mesh"] == {"dp": 4, "tp": 2}
    assert plan["mp_policy"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert plan["tp_plan"]["layer_plan"]["self_attn.o_proj"] == "rowwise"
    assert plan_config(STRATEGIES["fsdp2_grad_op"], "32-true", 2)["reshard_after_forward"] is False
    # torchtitan's policy: every block but the last reshards after forward
    full = plan_config(STRATEGIES["fsdp2"], "bf16-mixed", 2)
    assert full["reshard_after_forward"] is True and full["last_block_reshard_after_forward"] is False


def test_rules_name_the_problem():
    refusal = lambda name, **kw: BACKEND.refusal(STRATEGIES[name], Ask(**{  # noqa: E731
        "precision": "bf16-mixed", "optimizer": "adamw_torch", "device": "cuda", "num_processes": 8, **kw}))
    assert "scaler" in refusal("fsdp2", precision="16-mixed")
    assert "same memory" in refusal("fsdp2_offload", device="cpu")
    assert "tensor-parallel plan" in refusal("fsdp2_tp", peft="lora")
    assert "does not divide 5" in refusal("fsdp2_tp", num_processes=5)
    assert "QLoRA" in refusal("fsdp2_tp", peft="qlora")
    # QLoRA with CPU offload is planned (an estimate), and the worker refuses to run it
    assert refusal("fsdp2_offload", peft="qlora") == ""
    run_ask = Ask(precision="bf16-mixed", optimizer="adamw_torch", device="cuda", num_processes=8, peft="qlora")
    assert "estimate only" in BACKEND.run_refusal(STRATEGIES["fsdp2_offload"], run_ask)
    assert refusal("fsdp2_tp") == "" and refusal("fsdp2", peft="lora") == ""
    assert refusal("fsdp2", peft="qlora") == "" and refusal("fsdp2", peft="qlora", device="cpu") == ""
    assert refusal("fsdp2", peft="qlora", precision="bf16-true") == ""
    assert refusal("fsdp2", peft="qlora", precision="32-true") == ""


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp2_tp"])
def test_accelerate_reads_the_fsdp2_config(tmp_path, strategy):
    """Accelerate's loader accepts the file, `accelerate launch` turns it into its FSDP
    environment, and its FullyShardedDataParallelPlugin built from that environment is FSDP2
    with the planned resharding and wrapping."""
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = tmp_path / "accelerate_fsdp2_config.yaml"
    path.write_text(yaml.safe_dump(accelerate_config(STRATEGIES[strategy], "bf16-mixed", 4, 1, "cuda",
                                                     "LlamaDecoderLayer", True)))
    cfg = load_config_from_file(str(path))
    assert cfg.distributed_type == DistributedType.FSDP and cfg.fsdp_config["fsdp_version"] == 2
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, *_ = _validate_launch_command(args) if isinstance(_validate_launch_command(args), tuple) else (args,)
    env = prepare_multi_gpu_env(args)
    old = dict(os.environ)
    try:
        os.environ.update(env)
        plugin = FullyShardedDataParallelPlugin()
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert plugin.activation_checkpointing is True
    if strategy == "fsdp2_tp":
        assert env.get("PARALLELISM_CONFIG_TP_SIZE") == "2" and env.get("PARALLELISM_CONFIG_DP_SHARD_SIZE") == "2"


def test_eight_gpus_plan_fsdp2_next_to_deepspeed_and_colossalai(cli):
    r = cli("model=llama-3.1-8b", "gpus=8", "hardware=h100-80g", "training.micro_batch_size=4", "mode=plan",
            "report=json", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(r.stdout)
    names = {c["strategy"] for c in plan["candidates"]}
    assert {"fsdp2", "fsdp2_grad_op", "fsdp2_tp", "zero3", "cai_zero2"} <= names
    fits = {c["strategy"] for c in plan["candidates"] if c["fits"]}
    assert {"fsdp2", "fsdp2_grad_op"} <= fits
    tp = {c["layout"]["tp_size"] for c in plan["candidates"] if c["strategy"] == "fsdp2_tp"}
    assert tp == {2, 4, 8}  # 32 heads / 8 key-value heads: every divisor of 8 GPUs
    # FSDP2 full sharding keeps less per GPU than reshard_after_forward=False at the same micro-batch
    by = {(c["strategy"], c["micro_batch_size"]): c["memory"]["peak_allocated_bytes"]
          for c in plan["candidates"]}
    assert by[("fsdp2", 4)] < by[("fsdp2_grad_op", 4)]


def _bf16_mixed_llama(hidden, intermediate, layers, heads, vocab, positions, micro, seq):
    """A Llama step traced in bf16 (FSDP2's bf16-mixed compute dtype, no optimizer) and its
    bf16-mixed AdamW workload."""
    from launcher import trace
    from launcher.types import Workload

    key = trace.TraceKey(hf_config_json=trace.canonical_config_json(dict(
        model_type="llama", hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
        max_position_embeddings=positions)),
        num_layers=layers, micro_batch_size=micro, seq_len=seq, param_dtype="bfloat16", optimizer="none")
    wl = Workload(seq_len=seq, micro_batch_size=micro, precision="bf16-mixed", optimizer="adamw_torch",
                  gradient_checkpointing=False, attn_implementation="sdpa")
    return key, wl


def test_side_stream_buffers_hold_their_own_cache():
    """GPU reserved: FSDP2's all-gather buffers (copy-in stream) and reduce-scatter outputs
    (reduce-scatter stream) are cached apart from the default stream's blocks, so the replay holds
    more than with every storage on one stream (here 4.8 MiB more: 38.7 against 33.9 MiB). How much
    more depends on how the lifetimes interleave: with each forward all-gather output held until the
    next block's copy-out is done, a single stream reuses part of its blocks as well."""
    import dataclasses

    from launcher import trace
    from launcher.backends.fsdp2.layout import fsdp2_layout, setup
    from launcher.memory.allocator import replay
    from launcher.memory.replay import allocation_events

    key, wl = _bf16_mixed_llama(hidden=512, intermediate=1408, layers=2, heads=8, vocab=1024, positions=512,
                                micro=1, seq=128)
    lay = fsdp2_layout(trace.trace_step(key), setup(STRATEGIES["fsdp2"], wl, 2, 0))
    streams = {t.name: t.stream for t in lay.terms}
    assert streams["all_gather_output"] == 1 and streams["sharded_grads"] == 2
    assert streams["reduce_scatter_input"] == 0 and streams["unsharded_params"] == 0
    held = lambda lay: (lambda a: a.peak_reserved - a.peak_allocated)(replay(allocation_events(lay, 80)))  # noqa: E731
    one = dataclasses.replace(lay, terms=[dataclasses.replace(t, stream=0) for t in lay.terms])
    assert held(lay) > held(one)


def test_the_last_block_kept_unsharded_or_not():
    """fsdp2.keep_last_block (torchtitan's policy, the default) against false (Accelerate's): the
    plan JSON the worker applies, the all-gathers gathered again in backward, and the layout, where
    the kept block's unsharded parameters are alive from its forward through the LM head and the
    loss, and no all-gather output is made for it in backward."""
    from types import SimpleNamespace

    import numpy as np

    from launcher import trace
    from launcher.backends.fsdp2.comm import resharded_blocks
    from launcher.backends.fsdp2.layout import block_events, fsdp2_layout, setup
    from launcher.backends.fsdp2.rules import keep_last_block
    from launcher.memory.common import category_curves

    keep, drop = SimpleNamespace(keep_last_block=True), SimpleNamespace(keep_last_block=False)
    s = STRATEGIES["fsdp2"]
    assert plan_config(s, "bf16-mixed", 2, keep)["last_block_reshard_after_forward"] is False
    assert plan_config(s, "bf16-mixed", 2, drop)["last_block_reshard_after_forward"] is True
    assert resharded_blocks(s, 32, keep_last_block(s, keep)) == 31
    assert resharded_blocks(s, 32, keep_last_block(s, drop)) == 32
    assert resharded_blocks(STRATEGIES["fsdp2_grad_op"], 32) == 0

    key, wl = _bf16_mixed_llama(hidden=64, intermediate=128, layers=3, heads=4, vocab=4096, positions=128,
                                micro=2, seq=64)
    t = trace.trace_step(key)
    lays = {k: fsdp2_layout(t, setup(s, wl, 2, 0, knobs=v)) for k, v in (("keep", keep), ("drop", drop))}
    F, _ = block_events(t)
    # the last block's parameters in bf16 (every dimension even: no padding on 2 ranks)
    block = 2 * int(t.params.numel[t.params.layer == 2].sum())
    total = {k: sum(category_curves(lay).values()) for k, lay in lays.items()}
    head = slice(lays["keep"].start(F[3]), lays["keep"].start(t.phases["backward"][0]))  # LM head and loss
    assert np.all(total["keep"][head] - total["drop"][head] == block)
    assert sum(tm.name == "all_gather_output" for tm in lays["keep"].terms) == sum(
        tm.name == "all_gather_output" for tm in lays["drop"].terms) - 1


def test_qlora_with_cpu_offload_is_planned_never_chosen(trace_cache):
    """fsdp2_offload plans a QLoRA candidate (its table's estimate_only) that the planner never
    chooses to launch: its verdict says why."""
    from launcher import planner
    from launcher.app import model_spec
    from launcher.cli import compose
    from launcher.hardware import cluster_from

    config = compose([trace_cache, "model=tiny-llama", "hardware=a100-80g", "gpus=2", "strategy=fsdp2_offload",
                      "peft=qlora", "training.seq_len=64", "training.micro_batch_size=1"])
    plan = planner.plan(config, model_spec(config), cluster_from(config.hardware, config.gpus, config.nodes))
    (cand,) = plan.candidates
    assert cand.fits and plan.chosen is None
    assert "estimate only" in cand.reason and cand.memory.host_bytes > 0


@pytest.mark.parametrize("strategy,keep", [("fsdp2", True), ("fsdp2", False), ("fsdp2_grad_op", True)])
def test_exposed_communication_is_at_most_what_is_sent_and_all_of_it_without_compute(strategy, keep):
    """FSDP2's exposed communication time counts each collective of the step at most once: with no
    compute to hide behind, every all-gather and reduce-scatter is exposed, and no more; with
    compute, less. (The backward windows once charged a prefetch in every block's window, one
    more all-gather than the backward makes: block 0 has no block before it to prefetch.)"""
    from types import SimpleNamespace

    from launcher.backends.fsdp2.comm import fsdp2_comm

    cluster = SimpleNamespace(num_nodes=1, intra_node_bandwidth_gbps=100.0, collective_latency_s=2e-5,
                              device="cuda")
    kw = dict(num_params=7_000_000_000, num_trainable_params=7_000_000_000, num_layers=32, dp=8, accum=2,
              param_bytes=2, reduce_bytes=4, keep_last=keep)
    idle = fsdp2_comm(STRATEGIES[strategy], cluster, forward_s=0.0, backward_s=0.0, **kw)
    assert idle.exposed_s == pytest.approx(idle.raw_s, rel=1e-12)
    busy = fsdp2_comm(STRATEGIES[strategy], cluster, forward_s=0.5, backward_s=1.0, **kw)
    assert busy.raw_s == idle.raw_s and busy.exposed_s < busy.raw_s


@pytest.mark.parametrize("backend", ["fsdp2", "fsdp1"])
def test_accelerate_fsdp_checkpointing_only_under_the_full_policy(cli, backend):
    """Accelerate's fsdp_activation_checkpointing wraps every layer in non-reentrant full
    checkpointing: the exported file turns it on under `full` only, and under `reentrant` leaves it
    off and says in launch_commands.sh where the planned checkpointing is set."""
    import yaml

    lines = {}
    for policy in ("full", "reentrant"):
        run_dir = cli.cwd / policy
        r = cli("model=tiny-llama", "hardware=cpu", "gpus=2", f"strategy={backend}", "training.seq_len=128",
                "training.gradient_checkpointing=true", f"training.checkpoint_policy={policy}", "mode=plan",
                f"hydra.run.dir={run_dir}")
        assert r.returncode == 0, r.stderr[-2000:]
        acc = yaml.safe_load((run_dir / f"accelerate_{backend}_config.yaml").read_text())
        assert acc["fsdp_config"]["fsdp_activation_checkpointing"] is (policy == "full")
        lines[policy] = (run_dir / "launch_commands.sh").read_text()
    assert "use_reentrant" not in lines["full"]
    assert "gradient_checkpointing_kwargs={'use_reentrant': True}" in lines["reentrant"]

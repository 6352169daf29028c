"""mode=infer_plan through the real command line, against per-GPU numbers derived by hand from the
models' published config.json values (catalogue files conf/model/*.yaml)."""
from __future__ import annotations

import json

import pytest


def four_bit_bytes(numel: int, blocksize: int = 64) -> int:
    """bitsandbytes 4-bit without double quantization: two codes per byte, one fp32 absmax per
    block of 64, the 16-entry fp32 code table (bitsandbytes/functional.py quantize_4bit)."""
    return numel // 2 + 4 * (-(-numel // blocksize)) + 16 * 4


def run_json(cli, *args):
    r = cli(*args, "mode=infer_plan", "report=json", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout[r.stdout.index("{"):])


def test_llama_3_1_8b_at_nf4(cli):
    out = run_json(cli, "model=llama-3.1-8b", "hardware=a10g", "inference.precision=nf4",
                   "inference.batch_size=2", "inference.prompt_len=1000", "inference.gen_len=200")
    hidden, inter, vocab, layers, kv_heads, head_dim = 4096, 14336, 128256, 32, 8, 128
    per_layer = [hidden * hidden, kv_heads * head_dim * hidden, kv_heads * head_dim * hidden,
                 hidden * hidden, inter * hidden, inter * hidden, hidden * inter]
    linear = layers * sum(four_bit_bytes(n) for n in per_layer)
    sixteen_bit = 2 * (2 * vocab * hidden + (2 * layers + 1) * hidden)  # embed, lm_head, norms
    g = out["per_gpu"]
    assert g["weight_bytes"] == linear + sixteen_bit
    # KV cache with GQA: 2 (K, V) x layers x batch x tokens x KV heads x head_dim x 2 bytes
    assert g["kv_cache_bytes"] == 2 * layers * 2 * 1200 * kv_heads * head_dim * 2
    assert out["kv_cache_bytes_per_token"] == 2 * layers * kv_heads * head_dim * 2
    assert 0 < g["activation_bytes"] < g["weight_bytes"]
    assert g["peak_allocated_bytes"] >= g["weight_bytes"] + g["kv_cache_bytes"]
    assert out["fits"] and 5.0 < g["weight_bytes"] / 2**30 < 6.0  # ~4.5 bits/param + 16-bit embeddings


def test_llama_2_70b_split_over_two_gpus(cli):
    two = run_json(cli, "model=llama-2-70b", "gpus=2", "inference.tp_size=2")
    hidden, inter, vocab, layers, kv_heads, head_dim, tokens = 8192, 28672, 32000, 80, 8, 128, 1024 + 256
    # KV heads split over the 2 GPUs: 4 per GPU
    assert two["per_gpu"]["kv_cache_bytes"] == 2 * layers * tokens * (kv_heads // 2) * head_dim * 2
    # bf16: every Linear of the layers and the untied lm_head split in two; embedding and norms replicated
    linear = layers * (2 * hidden * hidden + 2 * kv_heads * head_dim * hidden + 3 * inter * hidden)
    split = linear + vocab * hidden
    replicated = vocab * hidden + (2 * layers + 1) * hidden
    assert two["model"]["num_params"] == split + replicated
    assert two["per_gpu"]["weight_bytes"] == 2 * (split // 2 + replicated)
    assert two["fits"] and two["per_gpu"]["runtime_bytes"] > 0  # CUDA context + NCCL for TP


def test_table_and_one_line_errors(cli):
    r = cli("model=llama-3.1-8b", "mode=infer_plan", "inference.precision=int8", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for word in ("weights", "KV cache", "activations", "device total"):
        assert word in r.stdout
    bad = cli("model=llama-2-70b", "mode=infer_plan", "gpus=3", "inference.tp_size=3", timeout=300)
    assert bad.returncode == 2
    assert "inference.tp_size=3" in bad.stderr


def test_a_serving_plan_does_not_check_the_training_length():
    """infer_plan's lengths are inference.prompt_len + gen_len (checked against the positions); the
    default training.seq_len (1024) above a small model's 512 positions refused the serving plan
    with a training key to change."""
    from launcher.app import model_spec
    from launcher.cli import compose
    from launcher.errors import ConfigError

    serve = compose(["model=tiny-llama", "hardware=cpu", "gpus=1", "mode=infer_plan", "inference.prompt_len=10",
                     "inference.gen_len=10"])
    assert model_spec(serve).max_positions == 512 < serve.training.seq_len
    with pytest.raises(ConfigError, match="training.seq_len=1024"):  # a training plan of it still is refused
        model_spec(compose(["model=tiny-llama", "hardware=cpu", "gpus=1", "mode=plan"]))


def test_the_default_prompt_fits_the_model():
    """inference.prompt_len=null asks 1024 prompt tokens, or fewer when the model's positions
    cannot hold them with gen_len: gpt2 (1024 positions) served with its defaults planned a
    1024 + 256 token request and refused it. A prompt length that is asked is kept, and refused
    when it does not fit."""
    from launcher.app import model_spec
    from launcher.cli import compose
    from launcher.errors import ConfigError
    from launcher.infer_plan import infer_plan

    def plan(model, *more):
        config = compose([f"model={model}", "hardware=a100-80g", "mode=infer_plan", *more])
        return infer_plan(config, model_spec(config))

    gpt2 = plan("gpt2")
    assert (gpt2["request"]["prompt_len"], gpt2["request"]["gen_len"]) == (1024 - 256, 256)  # config.json n_positions 1024
    assert any("inference.prompt_len=null" in n for n in gpt2["notes"])
    assert plan("gpt2", "inference.gen_len=24")["request"]["prompt_len"] == 1000
    assert plan("llama-2-7b")["request"]["prompt_len"] == 1024  # 4096 positions
    assert plan("gpt2", "inference.prompt_len=500")["request"]["prompt_len"] == 500
    with pytest.raises(ConfigError, match="inference.prompt_len \\+ gen_len = 1280"):
        plan("gpt2", "inference.prompt_len=1024")
    with pytest.raises(ConfigError, match="gen_len = 1025"):  # gen_len alone too long: the prompt is one token
        plan("gpt2", "inference.gen_len=1024")


def test_eager_attention_is_planned_when_asked():
    """inference.attn_implementation reaches the estimate: eager holds the largest forward's
    attention scores (a prompt's q x k per head), sdpa does not."""
    from launcher.app import model_spec
    from launcher.cli import compose
    from launcher.infer_plan import infer_plan

    def plan(attn):
        config = compose(["model=llama-3.1-8b", "hardware=a100-80g", "mode=plan", "inference.prompt_len=4096",
                          "inference.gen_len=16", f"inference.attn_implementation={attn}"])
        return infer_plan(config, model_spec(config))

    sdpa, eager = plan("sdpa"), plan("eager")
    assert eager["request"]["attn_implementation"] == "eager"
    scores = 32 * 4096 * 4096 * 2  # one layer's 16-bit scores over the prompt, 32 heads
    assert eager["per_gpu"]["activation_bytes"] > sdpa["per_gpu"]["activation_bytes"] + scores
    assert eager["per_gpu"]["weight_bytes"] == sdpa["per_gpu"]["weight_bytes"]


def _plan_in_process(*overrides):
    from launcher.app import model_spec
    from launcher.cli import compose
    from launcher.infer_plan import infer_plan

    config = compose([*overrides, "mode=plan"])
    return infer_plan(config, model_spec(config))


def test_opt_30b_offloaded_over_two_titan_rtx():
    """device_map=sequential over two 24 GB cards, against the placement rule worked out by hand from
    OPT-30B's config.json: whole decoder layers fill GPU 0 (which keeps room for one more layer once
    anything is offloaded) and then GPU 1; the rest goes to the CPU and runs on GPU 0."""
    out = _plan_in_process("model=opt-30b", "hardware=titan-rtx", "gpus=2", "inference.device_map=sequential",
                           "inference.precision=fp16", "inference.prompt_len=8", "inference.gen_len=12")
    h, f, vocab, positions, layers = 7168, 28672, 50272, 2048 + 2, 48  # OPT's positions are offset by 2
    fc1 = 2 * (h * f + f)
    layer = 2 * (4 * h * h + 4 * h) + fc1 + 2 * (f * h + h) + 2 * 2 * (2 * h)  # attention, fc1, fc2, 2 norms
    head_side = 2 * (vocab * h + positions * h + 2 * h)  # embeddings (lm_head tied) and the final norm
    free = 25395462144 - 768 * 2**20  # titan-rtx: capacity - CUDA context
    on0 = (free - layer - head_side) // layer
    on1 = free // layer
    cpu = layers - on0 - on1
    gpu0, gpu1 = out["devices"]
    assert (gpu0["layers"], gpu1["layers"], out["offload"]["layers"]) == (on0, on1, cpu) == (18, 19, 11)
    assert gpu0["weight_bytes"] == head_side + on0 * layer and gpu1["weight_bytes"] == on1 * layer
    assert out["offload"]["cpu_bytes"] == cpu * layer
    # the offloaded layers run on GPU 0: their KV cache is there, and fc1's weight (the largest
    # submodule) is copied in while it runs
    kv_layer = 2 * 1 * 20 * h * 2
    assert gpu0["layers_run"] == on0 + cpu and gpu0["kv_cache_bytes"] == (on0 + cpu) * kv_layer
    assert gpu1["kv_cache_bytes"] == on1 * kv_layer
    assert gpu0["offload_transient_bytes"] == fc1 and gpu1["offload_transient_bytes"] == 0
    assert out["fits"]
    # GPU 1 is the fuller one: its headroom is weighed against the published underestimates
    headroom = 1 - gpu1["device_total_bytes"] / 25395462144
    assert any(f"headroom {headroom:.0%} of the GPU" in n for n in out["notes"]), out["notes"]


def test_auto_balances_a_model_that_fits_and_sequential_fills_gpu_0():
    def shares(mode):
        out = _plan_in_process("model=opt-6.7b", "hardware=a100-80g", "gpus=2", f"inference.device_map={mode}")
        w = [d["weight_bytes"] for d in out["devices"]]
        return [x / sum(w) for x in w], out

    auto, out = shares("auto")
    assert 0.4 < auto[0] < 0.6 and out["offload"]["cpu_bytes"] == 0
    sequential, out = shares("sequential")
    assert sequential == [1.0, 0.0]
    # a cap per GPU (from_pretrained's max_memory) pushes the rest to the CPU
    capped = _plan_in_process("model=opt-6.7b", "hardware=a100-80g", "gpus=2", "inference.device_map=sequential",
                              "inference.max_memory_gib=4")
    assert all(d["weight_bytes"] <= 4 * 2**30 for d in capped["devices"])
    assert capped["offload"]["cpu_bytes"] > 0


@pytest.mark.parametrize("precision", ["nf4", "int8"])
def test_a_bitsandbytes_model_split_by_device_map_holds_the_same_weights(precision):
    """The device map is computed on transformers' bitsandbytes-converted meta model; the weights it
    places, counted tensor by tensor, add up to what the whole-model arithmetic gives on one GPU
    (two independent counts: which Linears are converted, the quantization states, the 16-bit rest),
    plus the model's buffers, which a device map places too (the rotary inverse frequencies)."""
    from launcher.app import model_spec
    from launcher.cli import compose
    from launcher.infer import meta_model

    common = ("model=llama-3.1-8b", "hardware=a10g", f"inference.precision={precision}")
    whole = _plan_in_process(*common, "gpus=1")["per_gpu"]["weight_bytes"]
    split = _plan_in_process(*common, "gpus=2", "inference.device_map=auto")
    model = meta_model(model_spec(compose([*common, "mode=plan"])).hf_config, "bfloat16")
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert 0 < buffers < 4096
    assert sum(d["weight_bytes"] for d in split["devices"]) == whole + buffers
    assert all(d["layers"] > 0 for d in split["devices"]) and split["offload"]["cpu_bytes"] == 0


def test_a_bitsandbytes_model_that_would_offload_is_refused_in_one_line():
    from launcher.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        _plan_in_process("model=llama-2-70b", "hardware=a10g", "gpus=1", "inference.precision=nf4",
                         "inference.device_map=auto")
    assert "llm_int8_enable_fp32_cpu_offload" in str(err.value) and "gpus=1" in str(err.value)


@pytest.mark.parametrize("overrides, key", [
    (["inference.device_map=auto", "inference.tp_size=2"], "inference.device_map=auto"),
    (["inference.device_map=auto", "inference.precision=gptq_int4"], "inference.precision=gptq_int4"),
    (["inference.max_memory_gib=10"], "inference.max_memory_gib=10"),
    (["inference.device_map=auto", "inference.max_memory_gib=0"], "inference.max_memory_gib=0"),
    (["inference.device_map=auto", "hardware=cpu"], "inference.device_map=auto"),
])
def test_device_map_bad_input_names_the_key(overrides, key):
    from launcher.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        _plan_in_process("model=opt-1.3b", "gpus=2", *overrides)
    assert key in str(err.value)


def test_the_exllama_kernel_is_refused_for_8_bit_gptq():
    from launcher.app import model_spec
    from launcher.cli import compose
    from launcher.infer_plan import check

    config = compose(["model=qwen-7b", "mode=infer_plan", "inference.precision=gptq_int8",
                      "inference.gptq_kernel=exllama"])
    problems = check(config, model_spec(config))
    assert problems == ["inference.gptq_kernel=exllama is AutoGPTQ's 4-bit kernel, not for inference.precision="
                        "gptq_int8; use inference.precision=gptq_int4 or inference.gptq_kernel=cuda_old"]


def test_tensor_parallel_serving_on_nvswitch_gpus_holds_nvls_buffers(cli):
    """A tp=4 serving plan on H100s (NVLink SHARP) holds the NVLS buffers of its one communicator of
    4 GPUs (runtime.py nvls_bytes) outside the allocator; with NCCL 2.19.3 NCCL bound 1 GiB for 4
    GPUs (NVIDIA/nccl-tests issue 216), and each of its 16 NVLS channels allocates its device peers
    in one 2 MiB cuMem allocation (channel.cc initNvlsChannel); hardware.nvls=false drops them."""
    args = ("model=llama-2-70b", "hardware=h100-80g", "gpus=4", "inference.tp_size=4", "hardware.nccl_version=2.19.3")
    with_nvls = run_json(cli, *args)
    without = run_json(cli, *args, "hardware.nvls=false")
    assert with_nvls["per_gpu"]["device_total_bytes"] - without["per_gpu"]["device_total_bytes"] == 2**30 + 16 * 2**21
    assert with_nvls["per_gpu"]["peak_allocated_bytes"] == without["per_gpu"]["peak_allocated_bytes"]


def test_the_nccl_version_defaults_to_the_installed_nccl_wheel(monkeypatch):
    """hardware.nccl_version=null reads the nvidia-nccl wheel torch's CUDA builds load, without
    importing torch; with none installed (CPU torch), the stated default."""
    from importlib import metadata

    from launcher import hardware

    def version(name):
        if name == "nvidia-nccl-cu12":
            return "2.19.3"
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", version)
    assert hardware.installed_nccl_version() == "2.19.3"
    monkeypatch.setattr(metadata, "version", lambda name: "2.26.2.post1")  # a post release: its release part
    assert hardware.installed_nccl_version() == "2.26.2"
    monkeypatch.setattr(metadata, "version", lambda name: (_ for _ in ()).throw(metadata.PackageNotFoundError(name)))
    assert hardware.installed_nccl_version() == hardware.DEFAULT_NCCL_VERSION

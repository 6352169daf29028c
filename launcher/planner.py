"""The plan: every candidate (strategy x micro-batch x gradient accumulation), whether it fits and
why, ranked fastest first; the chosen one is the fastest that fits with the safety margin.

Pure: given the config, the model and the cluster, returns a Plan. The expensive part (tracing a
step under fake tensors) is memoised per trace key inside launcher.trace; allocator replays
(launcher/memory/replay.py) and whole candidates (launcher/candidate_memo.py) are kept on disk
under keys that cover every input and the code.
"""
from __future__ import annotations

from dataclasses import replace

from launcher import host_time, lengths, liger, speed, trace
from launcher.backends import registry
from launcher.backends.base import Ask, peft_kind
from launcher.backends.registry import backend_of
from launcher.candidate_memo import CandidateMemo
from launcher.config import LauncherConfig
from launcher.environment import Env, detect
from launcher.errors import ConfigError
from launcher.lengths import VarlenRun
from launcher.margin import confidence_note
from launcher.memory import estimate as memory_model
from launcher.memory import host_build, torchao_build
from launcher.memory.replay import ReplayMemo
from launcher.memory.runtime import flash_attention_backward_bytes
from launcher.model import ModelSpec, effective_attention
from launcher.parallel import tp_degrees, tp_sizes
from launcher.peft import TrainingVariant, trace_fields, training_variants
from launcher.precision import model_dtype
from launcher.types import Candidate, Cluster, Plan, Strategy, Workload

STRATEGIES = registry.STRATEGIES  # name -> template, derived from the backend registry


def strategies_for(config: LauncherConfig, spec: ModelSpec | None = None) -> list[Strategy]:
    """The strategies to plan; with a model spec, templates with tensor or pipeline parallelism
    expand into their valid layouts (Backend.expand). `auto` on several GPUs leaves out `single`, a
    one-process strategy (asked for by name there, `unsupported` says why), and the strategies of a
    backend planned by name only (Backend.auto)."""
    name = config.strategy.name
    chosen = ([s for s in STRATEGIES.values()
               if (config.gpus == 1 or not backend_of(s).rules(s).single_process) and backend_of(s).auto]
              if name == "auto" else [STRATEGIES[name]])
    if spec is None:
        return chosen
    out: list[Strategy] = []
    for s in chosen:
        expand = backend_of(s).expand
        out += expand(s, config, spec) if expand else [s]
    return out


def unexpanded_notes(config: LauncherConfig, spec: ModelSpec, noted: list[str]) -> list[str]:
    """Under strategy=auto, a line for each tensor- or pipeline-parallel template that has no
    valid layout on this cluster (Backend.expand gave none) and no line in `noted` yet: the reason
    its backend gives when the strategy is asked for by name, with the GPU counts that would allow
    one."""
    if config.strategy.name != "auto":
        return []
    notes = []
    for template in STRATEGIES.values():
        expand = backend_of(template).expand
        if expand is None or expand(template, config, spec) or any(n.startswith(f"{template.name} ") for n in noted):
            continue
        by_name = replace(config, strategy=type(config.strategy)[template.name])
        try:
            expand(template, by_name, spec)
        except ConfigError as err:
            why = str(err).removeprefix(f"strategy={template.name}: ").removesuffix("; or strategy=auto")
            notes.append(f"{template.name} not planned: {why}")
    return notes


def micro_batch_sizes(config: LauncherConfig, dp: int) -> list[int]:
    """Micro-batches to try: the given one, else powers of two up to the limit that divide the
    global batch (when one is given); with training.optimizer_in_backward, only those that make the
    global batch in one micro-batch (every backward is an optimizer step)."""
    t = config.training
    if t.micro_batch_size is not None:
        return [t.micro_batch_size]
    out, m = [], 1
    while m <= config.planner.max_micro_batch_size:
        if t.global_batch_size is None or t.global_batch_size % (m * dp) == 0:
            if not (t.optimizer_in_backward and t.global_batch_size not in (None, m * dp)):
                out.append(m)
        m *= 2
    return out


def grad_accum(config: LauncherConfig, micro: int, dp: int) -> int:
    g = config.training.global_batch_size
    if g is None:
        return 1
    if g % (micro * dp):
        k = max(1, g // (micro * dp))
        raise ConfigError(f"training.global_batch_size={g} is not divisible by micro_batch_size x data-parallel "
                          f"size = {micro} x {dp}; try training.global_batch_size={micro * dp * k}")
    if config.training.optimizer_in_backward and g != micro * dp:
        raise ConfigError(f"training.global_batch_size={g}: training.optimizer_in_backward=true steps at every "
                          f"micro-batch (no accumulation); use training.global_batch_size={micro * dp} or null")
    return g // (micro * dp)


def workload(config: LauncherConfig, spec: ModelSpec, micro: int) -> Workload:

    t = config.training
    seq_len = (lengths.load(t.length_profile).peak_length(t.seq_len, t.length_multiple_of) if t.length_profile
               else t.seq_len)
    return Workload(seq_len=seq_len, micro_batch_size=micro, precision=t.precision.name,
                    optimizer=t.optimizer.name, gradient_checkpointing=t.gradient_checkpointing,
                    attn_implementation=effective_attention(spec, t.attn_implementation.name)[0],
                    checkpoint_policy=t.checkpoint_policy.name,
                    kernels=liger.trace_name(t.liger_kernels) if t.liger_kernel else "torch",
                    causal_lm_loss=t.causal_lm_loss.name, optimizer_in_backward=t.optimizer_in_backward,
                    zero_grad_set_to_none=t.zero_grad_set_to_none,
                    sgd_momentum=float(t.sgd_momentum), built_on_device=t.built_on_device,
                    keep_outputs=t.keep_outputs, use_cache=t.use_cache, rotary_cache=t.rotary_cache,
                    cuda=config.hardware.device == "cuda")


def ask(config: LauncherConfig, cluster: Cluster, env: Env, peft: str = "none") -> Ask:
    """What this run asks of a strategy's capability table."""
    return Ask(config.training.precision.name, config.training.optimizer.name, peft, cluster.device,
               cluster.num_gpus, env.installed, config.training.optimizer_in_backward,
               config.training.zero_grad_set_to_none)


def unsupported(strategy: Strategy, config: LauncherConfig, cluster: Cluster, spec: ModelSpec | None = None,
                env: Env | None = None, peft: str = "none") -> str:
    """Why this strategy cannot be a candidate here, or '': no sharding rule for its TP degree, or
    its backend's capability table (launcher/backends/<name>/rules.py, the one the worker checks)."""
    if strategy.tp_size > 1 and spec is not None and not trace.tp_traceable(spec.model_type):
        return f"no tensor-parallel sharding rule for model type {spec.model_type} yet (launcher/tp_shard.py)"
    if strategy.tp_size > 1 and config.training.liger_kernel:
        return ("training.liger_kernel: Liger's fused linear cross-entropy needs the whole LM head on each rank, "
                "and tensor-parallel ranks hold a slice of it; use training.liger_kernel=false for tensor parallelism")
    return backend_of(strategy).refusal(strategy, ask(config, cluster, env or detect(), peft))


def variant_problem(variant: TrainingVariant, strategy, device: str) -> str:
    """Why this strategy cannot train this variant here, or '' (its backend's capability table,
    launcher/backends/<name>/rules.py)."""
    return backend_of(strategy).rules(strategy).peft_problem(strategy.name, variant.peft, device)


def quant_problem(strategy: Strategy, variant: TrainingVariant) -> str:
    """Why this strategy cannot train this variant's quantized base, or '' (its capability table's
    `Rules.quant`), naming the strategies that can. A torchao NF4 base is modelled as torchtune's
    single-device recipe builds it (launcher/torchao_nf4.py): one unsharded model per process. A
    GPTQ base is modelled where its recipes run it."""
    quant = variant.lora.quant_type if variant.lora is not None else None
    why = backend_of(strategy).rules(strategy).quant_problem(quant)
    if not why:
        return ""
    able = [name for name, s in STRATEGIES.items()
            if not backend_of(s).rules(s).quant_problem(quant) and not backend_of(s).rules(s).peft_problem(name, "qlora", "cuda")]
    return f"{why}; use strategy={', '.join(able)}"


def kernels_problem(config: LauncherConfig, device: str, env: Env) -> str:
    """Why the kernels a config asks for cannot run here, or ''. Liger's are Triton kernels: GPUs
    only, and the liger-kernel package (launcher/liger.py). Another transformers version's loss
    (training.causal_lm_loss), another loop's kept outputs (training.keep_outputs), transformers
    4's training cache (training.use_cache) and its per-layer rotary tables (training.rotary_cache)
    are planned, never run."""
    t = config.training
    planned_only = (  # (set, what it plans and why the worker does not run it)
        (t.causal_lm_loss.name != "model", f"training.causal_lm_loss={t.causal_lm_loss.name} plans another "
                                           "transformers version's loss; the worker runs the installed one"),
        (t.keep_outputs, "training.keep_outputs=true plans a loop that keeps each step's outputs; the worker "
                         "runs the launcher's own loop"),
        (t.use_cache, "training.use_cache=true plans transformers 4's cache of keys and values in training; "
                      "the worker builds the model without it"),
        (config.peft.bnb_keeps_input, "peft.bnb_keeps_input=true plans bitsandbytes before 0.43.2; the worker "
                                      "runs the installed bitsandbytes"),
        (t.rotary_cache, "training.rotary_cache=true plans transformers 4's per-layer rotary tables; the worker "
                         "runs the installed transformers"))
    why = next((why for given, why in planned_only if given), "")
    if why:
        return why + ": estimate only"
    if not config.training.liger_kernel:
        return ""
    if device != "cuda":
        return "Liger's kernels are Triton GPU kernels: estimate only on CPU processes"
    if "liger_kernel" not in env.installed:
        return "training.liger_kernel needs the liger-kernel package (pip install liger-kernel): estimate only"
    return ""


def launch_problem(strategy: Strategy, spec: ModelSpec, peft: dict | None = None, env: Env | None = None) -> str:
    """Why a candidate that fits cannot be launched with the installed libraries, or ''. QLoRA of a
    mixture of experts whose experts are 3D parameters: the estimate quantizes them per expert
    (launcher/peft.py `expert_parameters`), the worker's bitsandbytes conversion covers nn.Linear only. It stays in
    the plan as an estimate but is never chosen. Then the backend's own reasons: its capability
    table's estimate-only PEFT methods and its `launch_problem` hook, which reads the installed
    libraries (e.g. ColossalAI's shardformer forwards need transformers 4.51,
    launcher/backends/colossalai/runtime.py)."""
    if str((peft or {}).get("quant_type")).startswith("gptq"):
        return ("a GPTQ base is a pre-quantized checkpoint; the worker builds models from config.json and "
                "quantizes with bitsandbytes only: estimate only")
    if (peft or {}).get("quant_type") == "torchao_nf4":
        return "a torchao NF4 base: the worker quantizes with bitsandbytes only (peft.quant_type=nf4): estimate only"
    if (peft or {}).get("quant_type") and any(spec.hf_config.get(k) for k in ("num_local_experts", "num_experts")):
        return ("QLoRA of 3D expert parameters: estimated 4-bit per expert, but the worker's bitsandbytes "
                "conversion quantizes nn.Linear only: estimate only")
    estimate_only = backend_of(strategy).rules(strategy).estimate_only.get(peft_kind(peft))
    if estimate_only:
        return estimate_only
    hook = backend_of(strategy).launch_problem
    return hook(strategy, spec, env or detect()) if hook else ""


def traced(config: LauncherConfig, spec: ModelSpec, strategy: Strategy, wl: Workload, lora=None):
    """The TraceSet this strategy's memory model needs (memoised and cached on disk by trace);
    `lora` (launcher.peft.LoraSettings): trace the peft model that trains adapters."""
    key = trace_key(spec, strategy, wl, lora)
    return trace.trace_set(key, spec.num_layers, cache_dir=config.cache_dir)


def trace_key(spec: ModelSpec, strategy: Strategy, wl: Workload, lora=None):
    """The `TraceKey` of the step this strategy's memory model needs."""
    request = memory_model.trace_request(strategy, wl)
    request.update(trace_fields(lora, backend_of(strategy).adapter_autocast_of(wl.precision), request))
    config_json = trace.canonical_config_json(spec.hf_config)
    attn = backend_of(strategy).attention_of(strategy, spec.model_type, wl.attn_implementation)
    if wl.cuda:
        request.update(trace.cuda_fields(config_json, attn, request.get("param_dtype", "float32"),
                                         request.get("autocast_dtype"), request.get("lora_dropout", 0.0)))
    return trace.TraceKey(hf_config_json=config_json,
                          num_layers=spec.num_layers, micro_batch_size=wl.micro_batch_size,
                          seq_len=wl.seq_len,
                          attn_implementation=attn,
                          gradient_checkpointing=wl.gradient_checkpointing,
                          checkpoint_policy=wl.checkpoint_policy if wl.gradient_checkpointing else "full",
                          kernels=wl.kernels, loss=wl.causal_lm_loss,
                          optimizer_in_backward=wl.optimizer_in_backward, keep_outputs=wl.keep_outputs,
                          use_cache=wl.use_cache, rotary_cache=wl.rotary_cache, **request)


def model_numbers(traces) -> dict:
    """Parameter counts of the traced model at full depth, extrapolated from the traced shallow
    models (tied weights counted once): one tensor-parallel rank's shard for a tensor-parallel
    trace (what the speed model reads), the whole model otherwise (`whole_model_traces`)."""
    def count(t, trainable_only=False):
        rows = t.params.tied_to < 0
        if trainable_only:
            rows &= t.params.trainable
        return int(t.params.numel[rows].sum())
    return {"num_params": round(traces.at_depth(count)),
            "num_trainable_params": round(traces.at_depth(lambda t: count(t, True)))}


def whole_model_traces(config: LauncherConfig, spec: ModelSpec, key, traces):
    """The traced step of the whole model a candidate trains, whatever its tensor-parallel degree
    (`key`, `traces`: the candidate's own): a tensor-parallel trace holds one rank's shard
    (launcher/tp_shard.py), so the whole model is the same step traced unsharded (pipeline traces
    hold every layer)."""
    if key.tp_size == 1:
        return traces
    return trace.trace_set(replace(key, tp_size=1), spec.num_layers, cache_dir=config.cache_dir)


HOST_BUILD_NOTE = ("host RAM: each of a node's {ranks} ranks builds the whole model on the host ({dtype}, "
                   "{each} with its construction temporaries, traced) before its backend moves or shards it: "
                   "{node} per node at setup (the host copy goes as the model is moved or sharded, so the "
                   "larger of that and the offloaded states is checked against the {host} of "
                   "hardware.host_memory_bytes).")


def evaluate(config: LauncherConfig, spec: ModelSpec, cluster: Cluster, strategy: Strategy,
             micro: int, variant=None, replay_memo=None) -> tuple[Candidate, dict]:
    """Estimate one candidate's memory and speed from the traced step; `variant`
    (launcher.peft.TrainingVariant): what it trains (default: what the config asks);
    `replay_memo` (launcher/memory/replay.py `ReplayMemo`): allocator replays kept on disk
    (default: this process's memo of the config's cache directory)."""
    dp = cluster.num_gpus // (strategy.tp_size * strategy.pp_size)
    variant = variant or TrainingVariant("full", None, config.training.gradient_checkpointing)
    accum = grad_accum(config, micro, dp)
    if backend_of(strategy).grad_accum:  # e.g. a pipeline's micro-batches
        accum = backend_of(strategy).grad_accum(strategy, config, accum)
    # the layouts lay out the last of `accum` micro-batches (a trace does not depend on it)
    wl = replace(workload(config, spec, micro), gradient_checkpointing=variant.gradient_checkpointing,
                 grad_accum_steps=accum)
    lora = backend_of(strategy).peft_of(strategy, variant.lora)
    key = trace_key(spec, strategy, wl, lora)
    traces = trace.trace_set(key, spec.num_layers, cache_dir=config.cache_dir)  # `traced`
    replay_memo = replay_memo if replay_memo is not None else ReplayMemo.shared(config.cache_dir)
    numbers = model_numbers(traces)
    whole_traces = whole_model_traces(config, spec, key, traces)
    whole = numbers if whole_traces is traces else model_numbers(whole_traces)
    knobs = registry.knobs(config)
    varlen = varlen_run(config, spec, cluster, strategy, wl, lora)
    mem = memory_model.estimate(traces, strategy, wl, cluster, knobs, dp, attention_workspace(spec, strategy, wl),
                                replay_memo=replay_memo, varlen=varlen)
    mem = replace(mem, notes=tuple(mem.notes) + trace.trace_notes(key))
    build = host_build.host_build_bytes(whole_traces, strategy, wl, key.param_dtype,
                                        quantized=lora is not None and lora.quant_type is not None)
    if cluster.device == "cpu":  # the host, where the worker builds the whole model, is the device
        mem = host_build.with_host_build(mem, build, model_dtype(wl.precision, strategy.backend))
        build = 0  # checked as the device's own memory
    if cluster.device == "cuda" and lora is not None and lora.quant_type == "torchao_nf4":
        mem = torchao_build.with_build(mem, traces, config.peft.nf4_quantize_chunk, replay_memo)
    flops = step_flops(traces)
    speed_wl = wl
    if varlen is not None:  # the run's batches are shorter than its longest on average
        flops, speed_wl = mean_length_flops(flops, step_flops(varlen.short_traces), wl, varlen)
    spd = speed.estimate_speed(flops, strategy, speed_wl, cluster, num_params=numbers["num_params"],
                               num_trainable_params=numbers["num_trainable_params"], grad_accum_steps=accum,
                               dp_size=dp, knobs=knobs, spec=spec, counts=step_counts(traces, config))
    usable = int(cluster.memory_bytes * (1 - config.planner.safety_margin))
    fits_device = mem.oom_bytes <= usable
    host_need = max(mem.host_bytes, build) * cluster.gpus_per_node
    fits_host = host_need <= cluster.host_memory_bytes
    if build:
        mem = replace(mem, notes=tuple(mem.notes) + (HOST_BUILD_NOTE.format(
            dtype=model_dtype(wl.precision, strategy.backend), each=gib(build), ranks=cluster.gpus_per_node,
            node=gib(build * cluster.gpus_per_node), host=gib(cluster.host_memory_bytes)),))
    if not fits_device:
        reason = (f"OOM: {gib(mem.oom_bytes)} > {gib(usable)} usable "
                  f"({config.planner.safety_margin:.1%} margin); largest term: {largest_term(mem.breakdown)}")
    elif not fits_host:
        why = "building the whole model on each rank" if build > mem.host_bytes else "offload"
        reason = f"host RAM: {why} needs {gib(host_need)} per node > {gib(cluster.host_memory_bytes)}"
    else:
        reason = "fits"
    return Candidate(strategy, micro, accum, mem, spd, fits_device and fits_host, reason, trains=variant.trains,
                     peft=lora.to_dict() if lora else None,
                     gradient_checkpointing=variant.gradient_checkpointing,
                     num_trainable_params=whole["num_trainable_params"]), whole


def step_batches(config: LauncherConfig, strategy: Strategy, micros: list[int],
                 dp: int) -> tuple[list[int], list[int], str]:
    """The micro-batch sizes whose optimizer step the strategy's backend can make of the global
    batch (its `grad_accum` rule), the sizes it cannot, and the backend's first reason."""
    rule = backend_of(strategy).grad_accum
    kept, left, reason = [], [], ""
    for micro in micros:
        try:
            if rule:
                rule(strategy, config, grad_accum(config, micro, dp))
            kept.append(micro)
        except ConfigError as err:
            left.append(micro)
            reason = reason or str(err).removeprefix(f"strategy={strategy.name}: ")
    return kept, left, reason


def varlen_run(config: LauncherConfig, spec: ModelSpec, cluster: Cluster, strategy: Strategy, wl: Workload,
               lora=None) -> VarlenRun | None:
    """With a length profile on a GPU: the step traced again at half the peak length, and the
    sampled lengths of `training.length_replay_batches` micro-batches, then one at the peak
    (the longest batch a run meets), for the allocator replay over batches of varying length
    (launcher/memory/replay.py `varlen_held_cache`)."""
    t = config.training
    if not t.length_profile or cluster.device != "cuda" or wl.seq_len < 2:
        return None
    profile = lengths.load(t.length_profile)
    short = replace(wl, seq_len=wl.seq_len // 2)
    batches = profile.batch_lengths(wl.seq_len, wl.micro_batch_size, t.length_replay_batches, t.seed,
                                    t.length_multiple_of)
    return VarlenRun(traced(config, spec, strategy, short, lora), short, (*batches, wl.seq_len), profile.name,
                     attention_workspace(spec, strategy, short))


def step_flops(traces) -> dict:
    """FLOPs of one step at the model's depth: forward, backward and their fused-attention parts."""
    return {k: traces.at_depth(lambda t, k=k: t.flops.get(k, 0.0))
            for k in ("forward", "backward", "attention_forward", "attention_backward")}


def mean_length_flops(flops: dict, short_flops: dict, wl: Workload, varlen: VarlenRun) -> tuple[dict, Workload]:
    """A step's FLOPs averaged over the run's batch lengths (`varlen.batches`), and the workload at
    their mean length, from the steps traced at the peak length and at `varlen.short.seq_len`:
    fused attention grows with the square of the length (its score and value matmuls), the rest
    linearly between the two traced lengths."""
    n = len(varlen.batches)
    mean = sum(varlen.batches) / n
    mean_sq = sum(x * x for x in varlen.batches) / n
    long_len, short_len = wl.seq_len, varlen.short.seq_len
    out = {}
    for phase in ("forward", "backward"):
        attn = flops[f"attention_{phase}"] * mean_sq / long_len**2
        rest, rest_short = (f[phase] - f[f"attention_{phase}"] for f in (flops, short_flops))
        out[phase] = rest_short + (rest - rest_short) * (mean - short_len) / (long_len - short_len) + attn
        out[f"attention_{phase}"] = attn
    return out, replace(wl, seq_len=max(1, round(mean)))


def attention_workspace(spec: ModelSpec, strategy: Strategy, wl: Workload) -> int:
    """FlashAttention-2's backward workspace of one layer on a GPU (memory/runtime.py
    `flash_attention_backward_bytes`) for 16-bit flash_attention_2 and sdpa (whose flash backend
    serves 16-bit causal attention without a mask); 0 for eager and fp32 attention. Before sm80
    SDPA has no flash backend and runs the memory-efficient one, whose backward also keeps fp32
    accumulators per batch and head (mem_eff_attention/kernel_backward.h `workspace_size`); its
    size is taken as FlashAttention-2's (an approximation, not modelled separately)."""
    if wl.attn_implementation not in ("sdpa", "flash_attention_2") or wl.precision == "32-true":
        return 0
    tp = strategy.tp_size
    head_dim = spec.hf_config.get("head_dim") or spec.hidden_size // spec.num_attention_heads
    return flash_attention_backward_bytes(wl.micro_batch_size, wl.seq_len, spec.num_attention_heads // tp,
                                          max(1, spec.num_key_value_heads // tp), head_dim)


def step_counts(traces, config: LauncherConfig):
    """Op counts and bytes of the traced step for the host-time terms (launcher/host_time.py)."""
    return host_time.step_counts(traces, config.deepspeed.stage3_param_persistence_threshold)


def largest_term(breakdown: dict) -> str:
    name = max(("parameters", "gradients", "optimizer_states", "activations", "buffers", "runtime"),
               key=lambda k: breakdown.get(k, 0))
    return f"{name} {gib(breakdown.get(name, 0))}"


def plan(config: LauncherConfig, spec: ModelSpec, cluster: Cluster, env: Env | None = None) -> Plan:
    """All candidates; per strategy (and training variant: full or adapters, gradient checkpointing,
    launcher.peft.training_variants) the micro-batch search stops at the first one that does not fit.
    Candidates that train what was asked (full fine-tuning unless a peft method is chosen) rank
    before those that would train something else, whatever their speed."""
    env = env or detect()
    candidates: list[Candidate] = []
    notes: list[str] = []
    unplanned: dict[str, tuple[set, str]] = {}  # label -> (micro-batch sizes some layout cannot step, a reason)
    numbers: dict = {}
    memo, done = ReplayMemo.shared(config.cache_dir), CandidateMemo(config, spec, cluster)
    variants = training_variants(config, cluster.device)
    pairs = []
    for v in variants:
        for s in strategies_for(config, spec):
            why = quant_problem(s, v)
            if why and config.strategy.name != "auto":
                raise ConfigError(f"strategy={s.name}: {why}")
            if why:
                notes.append(f"{s.name}{'' if len(variants) == 1 else ' (' + v.label + ')'} not planned: {why}")
            else:
                pairs.append((s, v))
    for name in [n for n, t in STRATEGIES.items() if t.tp_size > 1 and config.strategy.name in ("auto", n)]:
        # an invalid tensor-parallel degree is a line, not a missing row
        notes += [f"{name} tp={t} not planned: {why}" for t, why in tp_degrees(config, spec).items() if why]
        if not trace.tp_traceable(spec.model_type) and tp_sizes(config, spec):
            notes.append(f"{name} not planned: no tensor-parallel sharding rule for model type {spec.model_type} "
                         "yet (launcher/tp_shard.py)")
    notes += unexpanded_notes(config, spec, notes)
    prefetch(config, spec, cluster, env, pairs)
    try:
        for strategy, variant in pairs:
            why = unsupported(strategy, config, cluster, spec, env, peft=variant.peft)
            if why:
                if config.strategy.name != "auto":
                    raise ConfigError(why if why.startswith(f"strategy={strategy.name} ") else f"strategy={strategy.name}: {why}")
                notes.append(f"{strategy.name}{'' if len(variants) == 1 else ' (' + variant.label + ')'} "
                             f"not planned: {why.removeprefix(f'strategy={strategy.name} ')}")
                continue
            dp = cluster.num_gpus // (strategy.tp_size * strategy.pp_size)
            micros = micro_batch_sizes(config, dp)
            if not micros:
                raise ConfigError(f"training.global_batch_size={config.training.global_batch_size} is not divisible by "
                                  f"any micro-batch x data-parallel size {dp}; use a multiple of {dp}")
            label = f"{strategy.name}{'' if len(variants) == 1 else ' (' + variant.label + ')'}"
            if config.strategy.name == "auto":  # e.g. a pipeline's accumulation against its 1F1B micro-batches
                micros, left, why = step_batches(config, strategy, micros, dp)
                if left:
                    sizes, _ = unplanned.setdefault(label, (set(), why))
                    sizes.update(left)
            for micro in micros:
                try:
                    hit = done.get(strategy, micro, variant)
                    if hit is None:
                        hit = evaluate(config, spec, cluster, strategy, micro, variant)
                        done.put(strategy, micro, variant, hit)
                    cand, numbers = hit
                except (RuntimeError, NotImplementedError) as err:  # the model's own step fails as this strategy runs it
                    why = f"the traced step fails at micro-batch {micro}: {str(err).splitlines()[0]}"
                    if config.strategy.name != "auto":
                        raise ConfigError(f"strategy={strategy.name}: {why}") from None
                    notes.append(f"{label} not planned: {why}")
                    break
                candidates.append(cand)
                if not cand.fits:
                    break
    finally:
        trace.stop_prefetch()
    notes += [f"{label} not planned at micro-batch {', '.join(map(str, sorted(sizes)))} (for some layouts): {why}"
              for label, (sizes, why) in unplanned.items()]
    memo.save()
    done.save()
    asked = variants[0].trains
    ranked = sorted(candidates, key=lambda c: (not c.fits, c.trains != asked, -c.speed.tokens_per_s,
                                               c.memory.device_total_bytes))
    kernels_why = kernels_problem(config, cluster.device, env)
    chosen = next((i for i, c in enumerate(ranked)
                   if c.fits and not kernels_why and not launch_problem(c.strategy, spec, c.peft, env)), None)
    ranked = [explain_loss(c, ranked[chosen] if chosen is not None else None, spec, env, kernels_why)
              if i != chosen else c for i, c in enumerate(ranked)]
    notes += plan_notes(config, cluster, chosen, any(c.fits for c in ranked))

    attn_note = effective_attention(spec, config.training.attn_implementation.name)[1]
    notes += [attn_note] if attn_note else []
    if chosen is not None:  # the trainable count of what the chosen candidate trains
        numbers = {**numbers, "num_trainable_params": ranked[chosen].num_trainable_params}
        if cluster.device == "cuda":  # how sure its "fits" is (launcher/margin.py)
            sure = confidence_note(ranked[chosen].memory.oom_bytes, cluster.memory_bytes)
            notes += [f"chosen candidate's {sure}"] if sure else []
        if ranked[chosen].trains != asked:
            notes.append(f"no candidate that trains {asked} fits: the chosen one trains "
                         f"{ranked[chosen].trains} ({ranked[chosen].num_trainable_params:,} parameters), "
                         "allowed by training.allow_peft")
    model = {"name": spec.name, "model_type": spec.model_type, **numbers,
             "num_layers": spec.num_layers, "hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size}
    return Plan(model=model, hardware=cluster.hardware, gpus=cluster.num_gpus, nodes=cluster.num_nodes,
                candidates=tuple(ranked), chosen=chosen, notes=tuple(dict.fromkeys(notes)))  # each note once


def prefetch(config: LauncherConfig, spec: ModelSpec, cluster: Cluster, env: Env, pairs) -> None:
    """Name to launcher.trace the steps the first three micro-batch sizes of every plannable
    strategy and variant trace, so a second process traces them alongside (`trace.prefetch`)."""
    keys = []
    for strategy, variant in pairs:
        if unsupported(strategy, config, cluster, spec, env, peft=variant.peft):
            continue
        for micro in micro_batch_sizes(config, cluster.num_gpus // (strategy.tp_size * strategy.pp_size))[:3]:
            wl = replace(workload(config, spec, micro), gradient_checkpointing=variant.gradient_checkpointing)
            lora = backend_of(strategy).peft_of(strategy, variant.lora)
            keys.append(trace_key(spec, strategy, wl, lora))
            if strategy.tp_size > 1:  # the whole model's step (`whole_model_traces`)
                keys.append(replace(keys[-1], tp_size=1))
            if config.training.length_profile and cluster.device == "cuda" and wl.seq_len >= 2:  # `varlen_run`
                keys.append(trace_key(spec, strategy, replace(wl, seq_len=wl.seq_len // 2), lora))
    trace.prefetch(keys, spec.num_layers, config.cache_dir)


SPEED_TIE = 5e-4  # tokens/s equal to the verdict's three decimals: a tie, ranked by device total


def explain_loss(c: Candidate, best: Candidate | None, spec: ModelSpec, env: Env | None = None,
                 kernels_why: str = "") -> Candidate:
    """Say why a fitting candidate lost against the chosen one."""
    if not c.fits:
        return c
    why = kernels_why or launch_problem(c.strategy, spec, c.peft, env)
    if why:
        return replace(c, reason=f"fits; not launchable: {why}")
    if best is None:
        return c
    ratio = best.speed.tokens_per_s / max(c.speed.tokens_per_s, 1e-12)
    if c.trains != best.trains:
        return replace(c, reason=f"fits; trains {c.trains} instead of {best.trains} "
                                 f"({'faster' if ratio < 1 else 'slower'}: {1 / ratio:.3f}x the chosen's tokens/s)")
    if ratio < 1 + SPEED_TIE:  # the ranking's next key decided: the device total, then the strategy list
        mine, chosen = gib(c.memory.device_total_bytes), gib(best.memory.device_total_bytes)
        if mine == chosen:
            return replace(c, reason=f"fits; ties with the chosen on speed and memory ({mine} device total): "
                                     "the chosen comes first in the strategy list")
        return replace(c, reason=f"fits; as fast as the chosen (the same estimated tokens/s), more memory: "
                                 f"{mine} > {chosen} device total")
    return replace(c, reason=f"fits; lost on speed: {ratio:.3f}x slower than the chosen")


def plan_notes(config: LauncherConfig, cluster: Cluster, chosen: int | None, any_fits: bool) -> list[str]:
    notes = []
    if config.training.global_batch_size is None:
        notes.append("training.global_batch_size not set: each candidate uses micro_batch_size x data-parallel "
                     "size with no gradient accumulation, so candidates train with different global batches")
    if chosen is None and any_fits:
        notes.append("every candidate that fits is not launchable here (see its verdict); choose another "
                     "strategy (strategy=auto) or install what the verdict names")
    elif chosen is None:
        notes.append("nothing fits; what would: " + "; ".join(suggestions(config, cluster)))
    t = config.training
    precision = getattr(t.precision, "value", t.precision)
    if cluster.device == "cuda" and 0 < cluster.sm_arch < 80 and precision.startswith("bf16"):
        notes.append(f"training.precision={precision} on hardware={cluster.hardware} (sm{cluster.sm_arch}): GPUs before "
                     "Ampere (sm80) have no bf16 tensor cores, so bf16 matmuls are planned at the profile's "
                     f"peak_tflops.bf16 ({cluster.peak_tflops.get('bf16', 0):g}) against fp16's "
                     f"{cluster.peak_tflops.get('fp16', 0):g}; training.precision=16-mixed uses the tensor cores")
    if t.length_profile:
        profile = lengths.load(t.length_profile)
        peak = profile.peak_length(t.seq_len, t.length_multiple_of)
        where = ("the cache is replayed over a run of sampled lengths and speed is estimated at their mean "
                 "(tokens/s counts padded tokens)" if cluster.device == "cuda" else "speed is estimated there")
        notes.append(f"training.length_profile={t.length_profile}: micro-batches padded to their longest example, "
                     f"the longest {peak} tokens ({'the seq_len cap' if peak == t.seq_len else 'the longest example'}"
                     f"), where memory peaks; {where} (lengths: {profile.source})")
    return notes


def suggestions(config: LauncherConfig, cluster: Cluster) -> list[str]:
    out = [f"more GPUs (gpus={cluster.num_gpus * 2})"]
    offload = next((n for n, s in STRATEGIES.items() if s.offload_params and backend_of(s).auto), None)
    if offload and config.strategy.name not in ("auto", offload):
        out.append(f"offload (strategy={offload})")
    if not config.training.gradient_checkpointing:
        out.append("gradient checkpointing (training.gradient_checkpointing=true)")
    if config.peft.method.name == "none" and not config.training.allow_peft:
        out.append("LoRA adapters instead of full fine-tuning (peft=lora, or training.allow_peft=true "
                   "to plan both)")
    if (cluster.num_gpus == 1 and cluster.device == "cuda" and config.peft.method.name == "none"
            and not config.training.optimizer_in_backward):
        bf16 = "" if config.training.precision.name == "bf16-true" else " training.precision=bf16-true"
        out.append("torchtune's low-memory recipe: bf16 weights, each gradient freed as its parameter is "
                   "stepped, the optimizer states paged out (strategy=single training.optimizer_in_backward=true "
                   f"training.max_grad_norm=0 training.optimizer=paged_adamw_8bit{bf16})")
    if config.training.seq_len > 256:
        out.append(f"shorter sequences (training.seq_len={config.training.seq_len // 2})")
    return out


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"

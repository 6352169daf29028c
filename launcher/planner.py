"""The plan: every candidate (strategy x micro-batch x gradient accumulation), whether it fits and
why, ranked fastest first; the chosen one is the fastest that fits with the safety margin.

Pure: given the config, the model and the cluster, returns a Plan. The expensive part (tracing a
step under fake tensors) is memoised per trace key inside launcher.trace.
"""
from __future__ import annotations

from dataclasses import replace

from launcher.config import LauncherConfig
from launcher.errors import ConfigError
from launcher.model import ModelSpec
from launcher.types import Candidate, Cluster, Plan, Strategy, Workload

# The catalogue of strategies this planner enumerates (name -> layout).
STRATEGIES: dict[str, Strategy] = {
    "ddp": Strategy("ddp", "ddp"),
    "zero0": Strategy("zero0", "deepspeed", zero_stage=0),
    "zero1": Strategy("zero1", "deepspeed", zero_stage=1),
    "zero2": Strategy("zero2", "deepspeed", zero_stage=2),
    "zero3": Strategy("zero3", "deepspeed", zero_stage=3),
    "zero2_offload": Strategy("zero2_offload", "deepspeed", zero_stage=2, offload_optimizer=True),
    "zero3_offload": Strategy("zero3_offload", "deepspeed", zero_stage=3, offload_optimizer=True,
                              offload_params=True),
}


def strategies_for(config: LauncherConfig) -> list[Strategy]:
    name = config.strategy.name
    return list(STRATEGIES.values()) if name == "auto" else [STRATEGIES[name]]


def micro_batch_sizes(config: LauncherConfig, dp: int) -> list[int]:
    """Micro-batches to try: the given one, else powers of two up to the limit that divide the
    global batch (when one is given)."""
    t = config.training
    if t.micro_batch_size is not None:
        return [t.micro_batch_size]
    out, m = [], 1
    while m <= config.planner.max_micro_batch_size:
        if t.global_batch_size is None or t.global_batch_size % (m * dp) == 0:
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
    return g // (micro * dp)


def workload(config: LauncherConfig, spec: ModelSpec, micro: int) -> Workload:
    from launcher.model import effective_attention

    t = config.training
    return Workload(seq_len=t.seq_len, micro_batch_size=micro, precision=t.precision.name,
                    optimizer=t.optimizer.name, gradient_checkpointing=t.gradient_checkpointing,
                    attn_implementation=effective_attention(spec, t.attn_implementation.name)[0])


def unsupported(strategy: Strategy, config: LauncherConfig, cluster: Cluster) -> str:
    """Why this strategy cannot be a candidate here, or ''."""
    from launcher.memory import deepspeed_support_problem

    if cluster.device == "cpu" and (strategy.offload_optimizer or strategy.offload_params):
        return "offload moves states to host memory, which on CPU processes is the same memory"
    if strategy.backend == "deepspeed":
        return deepspeed_support_problem(strategy, config.training.precision.name)
    return ""


def traced(config: LauncherConfig, spec: ModelSpec, strategy: Strategy, wl: Workload):
    """The TraceSet this strategy's memory model needs (memoised and cached on disk by trace)."""
    from launcher import memory, trace

    key = trace.TraceKey(hf_config_json=trace.canonical_config_json(spec.hf_config),
                         num_layers=spec.num_layers, micro_batch_size=wl.micro_batch_size,
                         seq_len=wl.seq_len, attn_implementation=wl.attn_implementation,
                         gradient_checkpointing=wl.gradient_checkpointing,
                         **memory.trace_request(strategy, wl))
    return trace.trace_set(key, spec.num_layers, cache_dir=config.cache_dir)


def model_numbers(traces) -> dict:
    """Parameter counts of the full-depth model, extrapolated from the traced shallow models
    (tied weights counted once)."""
    def count(t, trainable_only=False):
        rows = t.params.tied_to < 0
        if trainable_only:
            rows &= t.params.trainable
        return int(t.params.numel[rows].sum())
    return {"num_params": round(traces.at_depth(count)),
            "num_trainable_params": round(traces.at_depth(lambda t: count(t, True)))}


def evaluate(config: LauncherConfig, spec: ModelSpec, cluster: Cluster, strategy: Strategy,
             micro: int) -> tuple[Candidate, dict]:
    """Estimate one candidate's memory and speed from the traced step."""
    from launcher import memory, speed

    dp = cluster.num_gpus // (strategy.tp_size * strategy.pp_size)
    wl = workload(config, spec, micro)
    traces = traced(config, spec, strategy, wl)
    numbers = model_numbers(traces)
    accum = grad_accum(config, micro, dp)
    mem = memory.estimate_memory(traces, strategy, wl, cluster, config.deepspeed, config.ddp, dp)
    flops = {k: traces.at_depth(lambda t, k=k: t.flops[k]) for k in ("forward", "backward")}
    spd = speed.estimate_speed(flops, strategy, wl, cluster, num_params=numbers["num_params"],
                               num_trainable_params=numbers["num_trainable_params"], grad_accum_steps=accum,
                               dp_size=dp, ds=config.deepspeed, ddp=config.ddp)
    usable = int(cluster.memory_bytes * (1 - config.planner.safety_margin))
    fits_device = mem.device_total_bytes <= usable
    host_need = mem.host_bytes * cluster.gpus_per_node
    fits_host = host_need <= cluster.host_memory_bytes
    if not fits_device:
        reason = (f"OOM: {gib(mem.device_total_bytes)} > {gib(usable)} usable "
                  f"({config.planner.safety_margin:.0%} margin); largest term: {largest_term(mem.breakdown)}")
    elif not fits_host:
        reason = f"host RAM: offload needs {gib(host_need)} per node > {gib(cluster.host_memory_bytes)}"
    else:
        reason = "fits"
    return Candidate(strategy, micro, accum, mem, spd, fits_device and fits_host, reason), numbers


def largest_term(breakdown: dict) -> str:
    name = max(("parameters", "gradients", "optimizer_states", "activations", "buffers", "runtime"),
               key=lambda k: breakdown.get(k, 0))
    return f"{name} {gib(breakdown.get(name, 0))}"


def plan(config: LauncherConfig, spec: ModelSpec, cluster: Cluster) -> Plan:
    """All candidates; per strategy the micro-batch search stops at the first one that does not fit."""
    candidates: list[Candidate] = []
    notes: list[str] = []
    numbers: dict = {}
    for strategy in strategies_for(config):
        why = unsupported(strategy, config, cluster)
        if why:
            if config.strategy.name != "auto":
                raise ConfigError(f"strategy={strategy.name}: {why}")
            notes.append(f"{strategy.name} not planned: {why}")
            continue
        dp = cluster.num_gpus // (strategy.tp_size * strategy.pp_size)
        micros = micro_batch_sizes(config, dp)
        if not micros:
            raise ConfigError(f"training.global_batch_size={config.training.global_batch_size} is not divisible by "
                              f"any micro-batch x data-parallel size {dp}; use a multiple of {dp}")
        for micro in micros:
            cand, numbers = evaluate(config, spec, cluster, strategy, micro)
            candidates.append(cand)
            if not cand.fits:
                break
    ranked = sorted(candidates, key=lambda c: (not c.fits, -c.speed.tokens_per_s, c.memory.device_total_bytes))
    chosen = next((i for i, c in enumerate(ranked) if c.fits), None)
    ranked = [explain_loss(c, ranked[chosen]) if chosen is not None and i != chosen else c
              for i, c in enumerate(ranked)]
    notes += plan_notes(config, cluster, chosen)
    from launcher.model import effective_attention

    attn_note = effective_attention(spec, config.training.attn_implementation.name)[1]
    notes += [attn_note] if attn_note else []
    model = {"name": spec.name, "model_type": spec.model_type, **numbers,
             "num_layers": spec.num_layers, "hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size}
    return Plan(model=model, hardware=cluster.hardware, gpus=cluster.num_gpus, nodes=cluster.num_nodes,
                candidates=tuple(ranked), chosen=chosen, notes=tuple(notes))


def explain_loss(c: Candidate, best: Candidate) -> Candidate:
    """Say why a fitting candidate lost against the chosen one."""
    if not c.fits:
        return c
    ratio = best.speed.tokens_per_s / max(c.speed.tokens_per_s, 1e-12)
    return replace(c, reason=f"fits; lost on speed: {ratio:.3f}x slower than the chosen")


def plan_notes(config: LauncherConfig, cluster: Cluster, chosen: int | None) -> list[str]:
    notes = []
    if config.training.global_batch_size is None:
        notes.append("training.global_batch_size not set: each candidate uses micro_batch_size x data-parallel "
                     "size with no gradient accumulation, so candidates train with different global batches")
    if chosen is None:
        notes.append("nothing fits; what would: " + "; ".join(suggestions(config, cluster)))
    return notes


def suggestions(config: LauncherConfig, cluster: Cluster) -> list[str]:
    out = [f"more GPUs (gpus={cluster.num_gpus * 2})"]
    if config.strategy.name not in ("auto", "zero3_offload"):
        out.append("offload (strategy=zero3_offload)")
    if not config.training.gradient_checkpointing:
        out.append("gradient checkpointing (training.gradient_checkpointing=true)")
    if config.training.seq_len > 256:
        out.append(f"shorter sequences (training.seq_len={config.training.seq_len // 2})")
    return out


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"

"""What a backend is: its strategies, one capability table, and the functions the planner, the
tracer, the emitter and the worker call. Pure values; no torch, no Hydra.

A backend folder (`launcher/backends/<name>/`) defines one `Backend` in its `__init__.py` and is
listed once in `launcher/backends/registry.py`. The planner refuses at plan time what the
backend's `Rules` refuse, and the worker checks the same `Rules` before it starts, so a plan is
never chosen that the worker then refuses (tests/unit/test_backend_agreement.py walks the whole
surface through the worker's own checks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from launcher.types import Strategy

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true")  # Lightning's names
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_torch_foreach", "sgd", "adamw_bnb_8bit",
              "paged_adamw_8bit", "paged_adamw_32bit", "adafactor")  # HF TrainingArguments `optim` names
PEFT_METHODS = ("none", "lora", "qlora")
DEVICES = ("cuda", "cpu")
QUANT_MODELLED = {
    "torchao": "is modelled for unsharded models (torchtune's single-device build)",
    "gptq": "is modelled under torch DDP and DeepSpeed (as GPTQ's LoRA recipes run it)",
}
"""Quantized-base families other than bitsandbytes' (`quant_family`) -> where their memory model
applies, for a strategy whose table (`Rules.quant`) leaves them out."""


def quant_family(quant_type: str | None) -> str | None:
    """The family of a peft.quant_type: 'bitsandbytes' (nf4, fp4), 'torchao' (torchao_nf4), 'gptq'
    (gptq_*); None without one."""
    if quant_type is None:
        return None
    if quant_type == "torchao_nf4":
        return "torchao"
    return "gptq" if str(quant_type).startswith("gptq") else "bitsandbytes"


@dataclass(frozen=True)
class Ask:
    """What a run asks of a strategy: the values its capability table is checked against."""

    precision: str
    optimizer: str
    peft: str = "none"  # none | lora | qlora
    device: str = "cuda"
    num_processes: int = 2
    installed: frozenset = frozenset()  # optional packages and flags present where it runs (launcher/environment.py)
    optimizer_in_backward: bool = False  # training.optimizer_in_backward
    zero_grad_set_to_none: bool = True  # training.zero_grad_set_to_none


def peft_kind(peft: dict | None) -> str:
    """'none', 'lora' or 'qlora' (a quantized base) of a run's peft settings (LoraSettings.to_dict())."""
    if not peft:
        return "none"
    return "qlora" if peft.get("quant_type") else "lora"


def in_backward_problem(max_grad_norm: float, precision: str, grad_accum_steps: int) -> str:
    """Why a run cannot step its optimizer in the backward pass (training.optimizer_in_backward), or
    '': each parameter is stepped as its gradient arrives, so nothing may need all gradients first
    (torchtune's full_finetune_single_device recipe refuses the same three)."""
    if max_grad_norm > 0:
        return (f"training.max_grad_norm={max_grad_norm}: clipping needs every gradient before the step, and "
                "training.optimizer_in_backward=true steps each parameter as its gradient arrives; set training.max_grad_norm=0")
    if precision == "16-mixed":
        return ("training.precision=16-mixed: fp16 loss scaling unscales every gradient before the step, so "
                "training.optimizer_in_backward=true cannot run with it; use bf16-mixed, bf16-true or 32-true")
    if grad_accum_steps > 1:
        return (f"{grad_accum_steps} micro-batches per step: training.optimizer_in_backward=true steps at every "
                "micro-batch; leave training.global_batch_size null")
    return ""


@dataclass(frozen=True)
class Rules:
    """One strategy's capability table: the values its worker runs. `why` gives the reason a value
    is missing (keyed by the value), so a refusal names its cause and the fix."""

    precisions: Mapping[str, frozenset]  # device -> Lightning precision names that run there
    optimizers: frozenset = frozenset(OPTIMIZERS)
    peft: frozenset = frozenset({"none", "lora"})
    peft_devices: Mapping[str, frozenset] = field(default_factory=lambda: {"qlora": frozenset({"cuda"})})
    # peft kind -> why it is planned but never run: the estimate models it, the worker does not train it
    estimate_only: Mapping[str, str] = field(default_factory=dict)
    single_process: bool = False  # True: exactly one process (no data-parallel wrapper)
    optimizer_in_backward: bool = False  # steps each parameter in its gradient hook (training.optimizer_in_backward)
    kept_gradients: bool = False  # zeroes the gradients in place and keeps them (training.zero_grad_set_to_none=false)
    quant: frozenset = frozenset({"bitsandbytes"})  # quantized-base families planned under QLoRA (`quant_family`)
    min_processes: int = 1
    why: Mapping[str, str] = field(default_factory=dict)

    def problem(self, strategy: str, ask: Ask) -> str:
        """Why `strategy` cannot run what `ask` asks, or ''."""
        if ask.device not in self.precisions:
            return self.why.get(ask.device) or f"strategy={strategy} does not run on {ask.device}"
        if ask.precision not in self.precisions[ask.device]:
            ok = [p for p in PRECISIONS if p in self.precisions[ask.device]]
            return self._no(strategy, f"training.precision={ask.precision}", ask.precision, ok,
                            f" on {ask.device}" if any(ask.precision in v for v in self.precisions.values()) else "")
        if ask.optimizer not in self.optimizers:
            ok = [o for o in OPTIMIZERS if o in self.optimizers]
            return self._no(strategy, f"training.optimizer={ask.optimizer}", ask.optimizer, ok)
        peft = self.peft_problem(strategy, ask.peft, ask.device)
        if peft:
            return peft
        if ask.optimizer_in_backward and not self.optimizer_in_backward:
            return (f"strategy={strategy} does not run training.optimizer_in_backward=true: "
                    + self.why.get("optimizer_in_backward", "use strategy=single"))
        if not ask.zero_grad_set_to_none and not self.kept_gradients:
            return (f"strategy={strategy} does not run training.zero_grad_set_to_none=false: its layout and worker "
                    "drop the gradients after each step; plan it with training.zero_grad_set_to_none=true")
        if self.single_process and ask.num_processes != 1:
            return (f"strategy={strategy} runs one process, not {ask.num_processes}, without a data-parallel "
                    "wrapper; use strategy=ddp (or auto) for several")
        if ask.num_processes < self.min_processes:
            return self.why.get("processes", f"strategy={strategy} needs at least {self.min_processes} processes")
        return ""

    def quant_problem(self, quant_type: str | None) -> str:
        """Why this table's strategy does not plan a base quantized as `quant_type`, or ''."""
        family = quant_family(quant_type)
        if family is None or family in self.quant:
            return ""
        return f"peft.quant_type={quant_type} {QUANT_MODELLED.get(family, 'is not modelled here')}"

    def peft_problem(self, strategy: str, peft: str, device: str) -> str:
        """Why `strategy` cannot train (or plan, for `estimate_only`) `peft` adapters on `device`, or ''."""
        if peft in self.estimate_only:
            return ""
        if peft not in self.peft:
            return self._no(strategy, f"peft={peft}", peft, [p for p in PEFT_METHODS if p in self.peft])
        if device not in self.peft_devices.get(peft, (device,)):
            return self.why.get(f"{peft}:{device}") or f"peft={peft} does not run on {device}"
        return ""

    def _no(self, strategy: str, what: str, value: str, ok: list, where: str = "") -> str:
        reason = self.why.get(value)
        return (f"strategy={strategy} does not run {what}{where}: "
                + (reason if reason else f"use one of {', '.join(ok) or 'none'}"))


def default_group(strategy: Strategy, dp: int) -> int:
    """Ranks of the default process group: every rank of the run (dp x tp x pp)."""
    return dp * strategy.tp_size * strategy.pp_size


@dataclass(frozen=True)
class Backend:
    """One backend: its strategies (name -> template) and what each layer calls.

    - `rules(strategy)`: the strategy's capability table.
    - `problem(strategy, ask)`: backend-specific refusals beyond the table ('' when it runs).
    - `trace_request(strategy, workload)`: the TraceKey fields the memory model needs.
    - `memory(traces, strategy, workload, knobs, dp, device)`: the strategy's `LayoutSet`.
    - `comm(x)`: (compute_s, raw comm_s, exposed comm_s, bytes per element) of a `CommInput`.
    - `host_equivalent(x)`: the `HostEquivalent` of a `CommInput` whose host terms it shares
      (launcher/host_time.py), or None when it has no host-time model.
    - `emit_file`, `emit(x)`: the framework config file of an `EmitInput`.
    - `worker`: 'module:callable' building the worker hook (imported by the worker only).
    - `check_worker_config`: 'module:callable' checking a run's framework config in the worker.
    - `join`: 'module:function' the worker calls with (seed, device) to join the process group the
      framework's way (DeepSpeed's `init_distributed`, ColossalAI's `launch_from_torch`); None:
      torch's `init_process_group`, gloo on CPU processes and nccl on GPUs.
    - `knobs`: the LauncherConfig groups this backend reads (adapted once, at the edge).
    - `expand(template, config, spec)`: the template's layouts over the valid tensor/pipeline
      degrees (launcher/parallel.py); None: the template is the strategy.
    - `grad_accum(strategy, config, accum)`: the step's micro-batches when the backend decides
      them (pipeline schedules); None: the planner's accumulation.
    - `launch_problem(strategy, spec, env)`: why a candidate that fits cannot be launched with the
      installed libraries (`env`, launcher/environment.py `Env`) ('' when it can); such a candidate
      stays in the plan as an estimate and is never chosen.
    - `to_neutral`: 'module:function' converting its checkpoint to torch's layout-neutral form
      (launcher/worker/layout.py), run by the launcher; None when it writes that form already.
    - `interpreter(strategy)`: the Python torchrun and the ranks run with (a path), or None for the
      launcher's own (launcher/launch.py `worker_python`).
    - `attention(strategy, model_type, planned)`: the attention implementation its ranks run when
      the framework replaces the model's attention (None: the planned one).
    - `peft_settings(strategy, lora)`: the `launcher.peft.LoraSettings` its ranks run for the asked
      ones, traced and written to run.json (None: as asked).
    - `exports(plan, config)`: the configs for the tools users already run that it writes next to
      the plan (launcher/exports.py), as an `Exported`.
    - `accelerate(strategy, device, run_dir)`: the keys of Accelerate's `ClusterConfig` that launch
      `strategy` (`distributed_type` and its section; launcher/emit/accelerate.py adds the rest)
      when `accelerate_config.yaml` describes one of its candidates; a backend that exports files
      describes the candidate it exported, whose files the keys may name (in `run_dir`). None: its
      candidates get no accelerate_config.yaml (FSDP writes its own through `exports`).
    - `launch_commands(per_node, num_machines, run_json, master_port)`: launchers of its own that
      start the job besides torchrun ({name: argv}, written to launch_commands.sh).
    - `communicators(strategy, dp)`: the rank counts of the NCCL communicators one rank holds in
      training, each costing launcher/memory/runtime.py `nccl_bytes` on a GPU; default: the
      default process group alone, which the worker's per-step collectives use.
    """

    name: str
    strategies: Mapping[str, Strategy]
    rules: Callable[[Strategy], Rules]
    trace_request: Callable[..., dict]
    memory: Callable[..., Any]
    comm: Callable[..., tuple]
    emit_file: str
    emit: Callable[..., dict]
    worker: str
    check_worker_config: str
    join: Optional[str] = None  # 'module:function' (seed, device) joining the process group; None: torch's
    problem: Callable[[Strategy, Ask], str] = lambda strategy, ask: ""
    host_equivalent: Optional[Callable[..., Optional[tuple]]] = None
    knobs: tuple = ()
    expand: Optional[Callable[..., list]] = None  # (template, config, spec) -> its layouts over TP/PP degrees
    grad_accum: Optional[Callable[..., int]] = None
    # LoRA adapters stay fp32 under peft's autocast; False: the framework casts them; or precision -> either
    adapter_autocast: Any = True
    launch_problem: Optional[Callable[..., str]] = None
    exports: Optional[Callable[..., "Exported"]] = None  # (plan, config) -> the files it writes next to the plan
    accelerate: Optional[Callable[..., dict]] = None  # (strategy, device, run_dir) -> accelerate_config.yaml's keys
    launch_commands: Optional[Callable[..., dict]] = None  # (per_node, num_machines, run_json, port) -> {name: argv}
    to_neutral: Optional[str] = None  # 'module:function' writing its checkpoint in torch's form; None: it is already
    interpreter: Optional[Callable[[Strategy], Optional[str]]] = None  # the ranks' Python; None: the launcher's
    attention: Optional[Callable[[Strategy, str, str], str]] = None  # (strategy, model_type, planned) -> what runs
    peft_settings: Optional[Callable[[Strategy, Any], Any]] = None  # (strategy, LoraSettings) -> what its ranks run
    auto: bool = True  # planned under strategy=auto; False: only when one of its strategies is asked for by name
    builds_on: tuple = ()  # backends whose modules this one's folder imports (shared rules, layout machinery)
    communicators: Callable[[Strategy, int], tuple] = lambda strategy, dp: (default_group(strategy, dp),)

    def attention_of(self, strategy: Strategy, model_type: str, planned: str) -> str:
        """The attention implementation `strategy`'s ranks run for `planned` (what the estimate traces)."""
        return self.attention(strategy, model_type, planned) if self.attention else planned

    def adapter_autocast_of(self, precision: str) -> bool:
        """Whether peft's fp32 adapters (on a 16-bit base) compute in fp32 under `precision`."""
        a = self.adapter_autocast
        return bool(a(precision) if callable(a) else a)

    def peft_of(self, strategy: Strategy, lora):
        """The LoRA/QLoRA settings `strategy`'s ranks run for the asked `lora` (None: full fine-tuning)."""
        return self.peft_settings(strategy, lora) if self.peft_settings and lora is not None else lora

    def refusal(self, strategy: Strategy, ask: Ask) -> str:
        """Why `strategy` cannot plan `ask`: the capability table first, then the backend's own rule."""
        return self.rules(strategy).problem(strategy.name, ask) or self.problem(strategy, ask)

    def run_refusal(self, strategy: Strategy, ask: Ask) -> str:
        """Why `strategy` cannot run `ask` (what the worker refuses): `refusal`, or what the table
        plans as an estimate only."""
        why = self.rules(strategy).estimate_only.get(ask.peft, "")
        return self.refusal(strategy, ask) or (f"strategy={strategy.name}: {why}" if why else "")


@dataclass(frozen=True)
class LayoutSet:
    """A backend's memory layout of one strategy, from a TraceSet.

    groups: ((ranks, (layout at depth 1, layout at depth 2)), ...), one entry per set of
    data-parallel ranks holding the same bytes; ranks=() means every rank.
    traces: the TraceSet the layouts extrapolate over (a pipeline stage has fewer layers).
    gathered: ZeRO-3 gathered-parameter bytes (bytes, kept on the per-depth curve) or None.
    extra: {phase: {category: bytes}} added at full depth.
    """

    groups: tuple
    traces: Any
    notes: tuple = ()
    gathered: Optional[tuple] = None
    extra: Mapping = field(default_factory=dict)


@dataclass(frozen=True)
class CommInput:
    """What a backend's communication model reads (launcher/speed.py `estimate_speed`)."""

    strategy: Strategy
    workload: Any  # launcher.types.Workload
    cluster: Any  # launcher.types.Cluster
    compute_s: float  # FLOP time of the optimizer step, all micro-batches
    forward_s: float  # FLOP time of one micro-batch's forward
    backward_s: float
    trainable: int  # trainable parameters
    num_params: int
    dp: int
    accum: int
    knobs: Mapping  # config group name -> its dataclass
    spec: Any = None  # launcher.model.ModelSpec


@dataclass(frozen=True)
class HostEquivalent:
    """The data-parallel mechanics whose CPU host terms a strategy pays (`style`: a
    launcher/host_time.py `HostStyle`, with its bucket sizes) on the traced parameters (one
    tensor-parallel shard's under tensor parallelism), and the communication it adds on top. A
    pipeline stage runs `stage_share` of the layers, holds that share of the parameters and does
    that share of each micro-batch's host work, which the pipeline's idle time stretches by
    `idle_factor` (as its FLOP time)."""

    style: Any  # launcher.host_time.HostStyle
    extra_comm_s: float = 0.0
    stage_share: float = 1.0
    idle_factor: float = 1.0


@dataclass(frozen=True)
class Exported:
    """What a backend's `exports` writes: `files` ((name, text) pairs) for the candidate at index
    `candidate` of the plan, or none and why (`why`; '' says nothing). `label` names the backend in
    launch_commands.sh ("DeepSpeed", "FSDP2"); `note`, a line it prints under the files' line (what
    the files leave to the training script)."""

    label: str
    files: tuple = ()
    candidate: Optional[int] = None
    why: str = ""
    note: str = ""


def export_candidate(plan, backends, accept: Callable[[Any], bool] = lambda c: True) -> Optional[int]:
    """The index of the candidate an export describes: the chosen one when it is of `backends` (a
    backend's name or several) and `accept`ed, else the fastest such candidate that fits and can
    be launched; None."""
    names = {backends} if isinstance(backends, str) else set(backends)
    ok = [i for i, c in enumerate(plan.candidates)
          if c.strategy.backend in names and c.fits and "not launchable" not in c.reason and accept(c)]
    return plan.chosen if plan.chosen in ok else (ok[0] if ok else None)


@dataclass(frozen=True)
class EmitInput:
    """Everything an emitter may read about the chosen candidate."""

    strategy: Strategy
    training: Any  # launcher.config.TrainingConfig
    knobs: Mapping  # config group name -> its dataclass
    micro_batch_size: int
    grad_accum_steps: int
    dp_size: int
    device: str = "cuda"
    vocab_size: int = 0  # the model's vocabulary (ColossalAI TP picks its padding multiple from it)

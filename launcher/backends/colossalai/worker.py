"""ColossalAI training backend: `colossalai.launch_from_torch` + `Booster(plugin=...)`.

framework_config is the emitted colossalai_plugin.json: {"plugin": <class name in
colossalai.booster.plugin>, "kwargs": {...}} (launcher/backends/colossalai/emit.py).

- The optimizer is a torch optimizer (`make_optimizer`): ColossalAI's HybridAdam / CPUAdam are
  kernels built with CUDA headers (colossalai/kernel/kernel_loader.py), and a torch optimizer
  keeps the update identical to the other backends. GeminiPlugin is the exception: its
  GeminiOptimizer steps only FusedAdam, CPUAdam or HybridAdam (zero/gemini/gemini_optimizer.py
  `_AVAIL_OPTIM_LIST`), so Gemini gets HybridAdam in AdamW mode (`gemini_optimizer`).
- TorchDDPPlugin keeps fp32 parameters; mixed precision is torch autocast around the forward, as
  in the DDP backend. LowLevelZeroPlugin, GeminiPlugin and HybridParallelPlugin cast the model
  to their `precision` themselves and keep fp32 master weights, so no autocast there.
- Gradient accumulation: `booster.no_sync` on the micro-batches before the last for TorchDDP and
  LowLevelZero stage 1; ZeRO-2 and Gemini reduce every micro-batch (`no_sync` is not supported
  with partitioned gradients, low_level_optim.py `backward`).
- Pipeline parallelism (pp_size > 1): each micro_step runs the whole 1F1B schedule over this
  rank's micro-batch, split by the plugin into `num_microbatches`
  (`booster.execute_pipeline`, colossalai/pipeline/schedule/one_f_one_b.py).

- On CPU processes `launch` first applies the CPU shim (launcher/backends/colossalai/cpu.py),
  which makes ColossalAI's CPU accelerator usable for LowLevelZero and HybridParallel.
- TP and PP (HybridParallelPlugin) run ColossalAI's shardformer forwards, written for
  transformers 4.51: the launcher starts their ranks in the environment that has it
  (launcher/backends/colossalai/runtime.py).
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from launcher.backends.colossalai import cpu
from launcher.backends.colossalai.rules import ADAMW
from launcher.errors import ConfigError
from launcher.worker import layout
from launcher.worker.model import quantized_base
from launcher.worker.optim import make_optimizer, make_scheduler

PLUGINS = ("TorchDDPPlugin", "LowLevelZeroPlugin", "GeminiPlugin", "HybridParallelPlugin")
# Shardformer forwards that read the attention mask unconditionally (ColossalAI 0.5.0
# colossalai/shardformer/modeling/gpt2.py `_get_attention_mask`: `attention_mask.size(-1)`):
# the worker passes an all-ones mask, which is what the model assumes without one.
MASK_REQUIRED = frozenset({"gpt2"})


def check_plugin_config(framework_config: dict) -> None:
    """{'plugin': one of PLUGINS, 'kwargs': dict} whose keys the plugin's __init__ accepts."""
    name = framework_config.get("plugin")
    if name not in PLUGINS:
        raise ConfigError(f"colossalai_plugin.json plugin={name!r}; use one of {', '.join(PLUGINS)}")
    kwargs = framework_config.get("kwargs", {})
    if not isinstance(kwargs, dict):
        raise ConfigError("colossalai_plugin.json kwargs must be an object")
    try:
        import inspect

        cls = plugin_class(name)
    except ImportError as err:
        raise ConfigError(f"ColossalAI is not installed ({err}); run scripts/setup (without LAUNCHER_SKIP_COLOSSALAI=1)") from None
    allowed = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ConfigError(f"colossalai_plugin.json kwargs {unknown} are not {name} arguments")


def plugin_class(name: str):
    import colossalai.booster.plugin as plugins

    return getattr(plugins, name)


def launch(seed: int, device: str) -> None:
    """Join the process group through ColossalAI (it picks gloo on its CPU accelerator, nccl on
    CUDA: colossalai/initialize.py `launch`), after the CPU shim on CPU processes."""
    import colossalai

    if device == "cpu":
        cpu.apply()

    colossalai.launch_from_torch(seed=seed, verbose=False)


def _loss_of(outputs, batch):
    return outputs.loss


def gemini_optimizer(name: str, params, learning_rate: float, weight_decay: float):
    """ColossalAI's HybridAdam with decoupled weight decay (adamw_mode=True, AdamW's update) for
    GeminiPlugin, which refuses torch optimizers; its fused CUDA kernel is loaded, or built, by
    ColossalAI's kernel loader on first use. Only the AdamW names reach here
    (launcher/backends/colossalai/rules.py GEMINI_RULES)."""
    if name not in ADAMW:
        raise ConfigError(f"training.optimizer={name}: GeminiPlugin runs HybridAdam only; use adamw_torch")
    from colossalai.nn.optimizer import HybridAdam

    return HybridAdam([p for p in params if p.requires_grad], lr=learning_rate, weight_decay=weight_decay,
                      adamw_mode=True)


def plugin_moves_model(spec) -> bool:
    """GeminiPlugin and HybridParallelPlugin take the model as built on the host. Gemini copies
    each parameter into its chunks on the device and moves the buffers itself
    (colossalai/zero/gemini/gemini_ddp.py `_init_chunks`, `_cast_buffers`); the hybrid plugin
    shards the model, and drops the layers of other pipeline stages, before it moves what is left
    (booster/plugin/hybrid_parallel_plugin.py HybridParallelModule: `shardformer.optimize`, then
    `module.to(device)`). Moved whole first, a model larger than one GPU would not survive the
    setup of a plan that holds a shard of it. TorchDDPPlugin and LowLevelZeroPlugin keep the whole
    model on each GPU, and a QLoRA base arrives on the device whole (`quantized_base`): the worker
    moves those whole."""
    return (spec.framework_config.get("plugin") in ("GeminiPlugin", "HybridParallelPlugin")
            and not quantized_base(spec))


class ColossalAIBackend:
    MOVES_MODEL = staticmethod(plugin_moves_model)  # launcher/worker/backends.py `moves_model`

    def __init__(self, model, spec, env, plan, meter) -> None:
        import torch
        from colossalai.booster import Booster

        check_plugin_config(spec.framework_config)
        name, kwargs = spec.framework_config["plugin"], dict(spec.framework_config.get("kwargs", {}))
        self.plugin = plugin_class(name)(**kwargs)
        self.booster = Booster(plugin=self.plugin)
        optimizer = (gemini_optimizer(spec.optimizer, model.parameters(), spec.learning_rate, spec.weight_decay)
                     if name == "GeminiPlugin" else
                     make_optimizer(spec.optimizer, model.parameters(), spec.learning_rate, spec.weight_decay,
                                    spec.sgd_momentum))
        self.model, self.optimizer, *_ = self.booster.boost(model, optimizer)
        self._torch_optimizer = optimizer
        self.scheduler = make_scheduler(optimizer, spec.warmup_steps)
        self._ddp_like = ddp_like = name == "TorchDDPPlugin"
        self._autocast_dtype = getattr(torch, plan.autocast_dtype) if ddp_like and plan.autocast_dtype else None
        self._no_sync = ddp_like or (name == "LowLevelZeroPlugin" and kwargs.get("stage", 1) == 1)
        self._pipeline = kwargs.get("pp_size", 1) > 1
        self._mask = name == "HybridParallelPlugin" and getattr(model.config, "model_type", "") in MASK_REQUIRED
        self._num_microbatches = kwargs.get("num_microbatches") or 1
        self._buffer: list = []
        self._placeholders: list = []
        self._device_type, self._spec, self._meter = env.device, spec, meter

    def _autocast(self):
        import torch

        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=self._autocast_dtype)

    def micro_step(self, input_ids, last: bool):
        if self._pipeline:
            return self._pipeline_micro_step(input_ids)
        sync = self.booster.no_sync(self.model, self.optimizer) if (self._no_sync and not last) \
            else contextlib.nullcontext()
        with sync:
            with self._meter.phase("forward"), self._autocast():
                loss = self.model(**self._inputs(input_ids)).loss
            with self._meter.phase("backward"):
                self.booster.backward(loss / self._spec.grad_accum_steps, self.optimizer)
        return loss.detach().float()

    def _inputs(self, input_ids) -> dict:
        import torch

        out = {"input_ids": input_ids, "labels": input_ids}
        if self._mask:
            out["attention_mask"] = torch.ones_like(input_ids)
        return out

    def _pipeline_micro_step(self, input_ids):
        """Buffer micro-batches; every `num_microbatches` of them run one 1F1B schedule over their
        concatenation (the plugin splits it back). Every buffered micro-step's loss is the
        schedule's mean loss (last stage; other stages report 0)."""
        import torch

        self._buffer.append(input_ids)
        placeholder = torch.zeros((), dtype=torch.float32)
        self._placeholders.append(placeholder)
        if len(self._buffer) == self._num_microbatches:
            batch = torch.cat(self._buffer)
            with self._meter.phase("forward"):
                out = self.booster.execute_pipeline(iter([self._inputs(batch)]),
                                                    self.model, _loss_of, self.optimizer, return_loss=True)
            loss = out.get("loss")
            for p in self._placeholders:
                p.fill_(float(loss) if loss is not None else 0.0)
            self._buffer, self._placeholders = [], []
        return placeholder

    def optimizer_step(self) -> None:
        import torch

        with self._meter.phase("optimizer"):
            if self._ddp_like and self._spec.max_grad_norm > 0:  # the other plugins clip (max_norm)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self._spec.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def save(self, directory: Path, rank: int) -> None:
        """Unsharded: the booster gathers ZeRO and tensor-parallel shards into the layout-neutral
        form (launcher/worker/layout.py), which every plugin and backend can read. ColossalAI's
        root-logger advice against unsharded checkpoints of large models
        (checkpoint_io/hybrid_parallel_checkpoint_io.py) is dropped: the form is chosen."""
        import torch

        root, drop = logging.getLogger(), _DropMessage("unsharded checkpointing methods")
        root.addFilter(drop)
        try:
            self.booster.save_model(self.model, str(directory / layout.MODEL), shard=False)
            self.booster.save_optimizer(self.optimizer, str(directory / layout.OPTIMIZER), shard=False)
        finally:
            root.removeFilter(drop)
        if rank == 0:
            torch.save(self.scheduler.state_dict(), directory / layout.SCHEDULER)

    def load(self, directory: Path) -> None:
        self.booster.load_model(self.model, str(directory / layout.MODEL))
        self.load_neutral(directory)

    def load_neutral(self, directory: Path) -> None:
        self.booster.load_optimizer(self.optimizer, str(directory / layout.OPTIMIZER))
        self.scheduler.load_state_dict(layout.neutral_scheduler(directory))


def check_config(spec, world_size: int) -> None:
    """The run's colossalai_plugin.json (`check_plugin_config`)."""
    check_plugin_config(spec.framework_config)


class _DropMessage(logging.Filter):
    """Drops the log records whose message contains `text`."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()

"""Trace one real training step of a transformers model under fake tensors, as a `StepTrace`.

The step (build, forward + loss, backward, optimizer step, zero_grad) runs the real
transformers and torch.optim code under `torch._subclasses.fake_tensor.FakeTensorMode` on the
CPU device, so no memory is allocated and no arithmetic is done. A `TorchDispatchMode` records
every tensor storage that an op returns for the first time (allocation) and, through a weakref
callback on the storage, when it dies (free), the way `MemTracker.__torch_dispatch__` and
`_WeakRefInfo.create_winfo` do in torch/distributed/_tools/mem_tracker.py. FLOPs of matmuls and
attention are counted in the same mode with torch's own formulas
(`torch.utils.flop_counter.flop_registry`, what `FlopCounterMode` uses).

LoRA (`TraceKey.trainable='lora'`): the model is wrapped by `peft.get_peft_model` inside the
fake-tensor trace with the same `peft.LoraConfig` the worker applies (launcher/peft.py), so the
adapters, their dropout, dtype casts and saved activations are traced, not modelled; only the
trainable adapters get gradients and optimizer states. QLoRA (`quant_type`): traced with the frozen
base in the compute dtype, every Linear bitsandbytes would quantize running through a stand-in of
`MatMul4Bit` (dequantize-to-temporary, multiply, free); then the storage bytes of those base
weights are replaced by their 4-bit bitsandbytes layout (launcher/quant.py). What is modelled, not
traced, is therefore only the size of the 4-bit weights; every other storage is traced. With
`kbit_upcast` the other parameters are cast to fp32 first, as peft's prepare_model_for_kbit_training
does. A GPTQ base (`quant_type` gptq_*) is traced with AutoGPTQ's QuantLinear buffers and its
dequantizing forward (launcher/gptq.py); a torchao NF4 base (`torchao_nf4`) with NF4Tensor's
inner tensors and dequantizing forward (launcher/torchao_nf4.py). Under DeepSpeed ZeRO-3 (`zero3_linear`) F.linear is
DeepSpeed's memory-efficient linear, which saves every Linear's input (`_zero3_linear`).

Traces at two depths (`trace_set`) are cached on disk; `at_micro_batch` rebuilds the trace of
any micro-batch size from the traces at two consecutive micro-batch sizes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from launcher.environment import DEFAULT_CACHE_DIR, installed_version
from launcher.gptq import GPTQ_BITS, gptq_stand_in
from launcher import torchao_nf4
from launcher.tp_shard import shard_model, shardable, vocab_multiple
from launcher.steptrace import Kind, OpClass, ParamTable, Role, StepTrace, TraceSet
from launcher.vocab_parallel_loss import vocab_parallel_loss
from launcher import checkpointing
from launcher import liger
from launcher import peft as lp
from launcher.peft import four_bit_storage_bytes
from launcher.peft import LoraSettings

OPTIMIZERS = ("adamw_foreach", "adamw_single", "adamw_fused", "sgd", "sgd_plain", "adafactor", "none")
PARAM_DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
PHASES = ("build", "forward", "backward", "optimizer", "zero_grad")
COPY_OPS = ("_to_copy", "copy", "clone", "cat", "stack", "index_select", "embedding", "gather",
            "slice_backward", "select_backward", "constant_pad_nd", "repeat", "expand_copy",
            "zeros", "zeros_like", "new_zeros", "full", "full_like", "new_full", "ones", "ones_like",
            "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided")
"""aten ops that move or fill memory without arithmetic (OpClass.COPY); an empty allocation counts as
the in-place op that fills it."""
SGD_MOMENTUM = 0.9  # training.sgd_momentum's default; a trace depends only on whether it is zero (sgd / sgd_plain)


@dataclass(frozen=True)
class TraceKey:
    """Everything that determines a traced step. `hf_config_json` is the model's config.json as a
    canonical JSON string (`canonical_config_json`); `num_layers` overrides its depth."""
    hf_config_json: str
    num_layers: int
    micro_batch_size: int
    seq_len: int
    param_dtype: str = "float32"  # float32 | bfloat16 | float16: dtype the model is built in
    autocast_dtype: Optional[str] = None  # None | bfloat16 | float16: autocast on forward+loss
    attn_implementation: str = "sdpa"  # eager | sdpa | flash_attention_2 (traced as sdpa)
    gradient_checkpointing: bool = False
    checkpoint_policy: str = "full"  # with gradient_checkpointing: launcher/checkpointing.py POLICIES
    # torch | liger | liger:<kernel>,...: Liger's Triton kernels (all, or those named), traced as
    # launcher/liger.py's stand-ins
    kernels: str = "torch"
    loss: str = "model"  # model | fp32_shift_copy | shift_copy: older causal-LM losses (`_loss`)
    optimizer: str = "adamw_foreach"  # adamw_foreach | adamw_single | adamw_fused | sgd | none
    optimizer_in_backward: bool = False  # one optimizer per parameter, stepped in its gradient hook (`_run_step`)
    trainable: str = "all"  # 'all' parameters train | 'lora': peft LoRA adapters on a frozen base
    # --- trainable='lora' (launcher/peft.py LoraSettings): the peft.LoraConfig applied in the trace
    lora_r: int = 0
    lora_alpha: int = 0
    lora_dropout: float = 0.0
    lora_target_modules: tuple = ()  # () = PEFT's default for the architecture
    lora_dora: bool = False  # DoRA (LoraConfig use_dora)
    lora_modules_to_save: tuple = ()  # modules peft copies and trains in full (LoraConfig modules_to_save)
    lora_train_base: bool = False  # the base trains next to the adapters (peft.train_base)
    quant_type: Optional[str] = None  # None | 'nf4' | 'fp4': QLoRA 4-bit base (see trace_step)
    double_quant: bool = False
    kbit_upcast: bool = False  # QLoRA: non-4-bit parameters cast to fp32 (peft prepare_model_for_kbit_training)
    gptq_group_size: int = 0  # quant_type gptq_*: group size of the GPTQ base (launcher/gptq.py)
    zero3_linear: bool = False  # F.linear saves input, weight and bias (DeepSpeed ZeRO-3, `_zero3_linear`)
    adapter_autocast: bool = True  # peft autocast_adapter_dtype (fp32 adapters on a 16-bit model)
    tp_size: int = 1  # >1: trace one tensor-parallel rank's shard model (`tp_shard_config`)
    transformers4: bool = False  # the model as transformers 4.51 runs it (`_sdpa_as_transformers4`, `_transformers4_buffers`)
    # FSDP1 (use_orig_params=True): every parameter of a wrapped unit (a decoder layer, or the rest of
    # the model) holding a trainable one gets a gradient too (`_flat_param_grads`)
    flat_param_grads: bool = False
    # the training loop keeps each step's model outputs until the next forward returns
    # (training.keep_outputs, `_previous_outputs`)
    keep_outputs: bool = False
    # the forward returns the cache of keys and values, as transformers 4 filled it in training
    # (training.use_cache, `_transformers4_cache`)
    use_cache: bool = False
    # every attention layer holds cos/sin tables over all positions (training.rotary_cache, `_rotary_caches`)
    rotary_cache: bool = False
    # QLoRA: each 4-bit matmul keeps its input, as bitsandbytes before 0.43.2 (peft.bnb_keeps_input)
    bnb_keeps_input: bool = False
    # dropout as CUDA runs it: the fused kernel's output and 1-byte mask (`_fused_dropout`), SDPA's
    # dropout inside the fused attention kernels (`_cuda_sdpa`); false: the CPU's kernels
    fused_dropout: bool = False
    # the autocast region runs CUDA's autocast op policy, not the CPU's (`_cuda_autocast`)
    cuda_autocast: bool = False
    # SDPA with grouped-query attention on fp32 inputs runs CUDA's math kernel (`_cuda_sdpa`)
    cuda_sdpa_math: bool = False

    def __post_init__(self):
        _check(self.param_dtype, PARAM_DTYPES, "param_dtype")
        _check(self.autocast_dtype, (None, "bfloat16", "float16"), "autocast_dtype")
        _check(self.attn_implementation, ATTN_IMPLEMENTATIONS, "attn_implementation")
        _check(self.optimizer, OPTIMIZERS, "optimizer")
        _check(self.checkpoint_policy, checkpointing.POLICIES, "checkpoint_policy")
        liger.parse(self.kernels)  # raises ValueError on another value
        _check(self.loss, ("model", "fp32_shift_copy", "shift_copy"), "loss")
        _check(self.trainable, ("all", "lora"), "trainable")
        _check(self.quant_type, (None, "nf4", "fp4", "gptq_int4", "gptq_int8", "torchao_nf4"), "quant_type")
        if self.trainable == "lora" and self.lora_r < 1:
            raise ValueError("TraceKey.trainable='lora' needs lora_r >= 1")
        if self.quant_type is not None and self.trainable != "lora":
            raise ValueError("TraceKey.quant_type (QLoRA) needs trainable='lora'")
        if self.trainable == "all" and self.flat_param_grads:  # every parameter has a gradient already
            object.__setattr__(self, "flat_param_grads", False)

    def lora_settings(self):
        """The `launcher.peft.LoraSettings` of this key (None for full fine-tuning)."""
        if self.trainable != "lora":
            return None
        return LoraSettings(r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout,
                            target_modules=tuple(self.lora_target_modules) or None,
                            use_dora=self.lora_dora, modules_to_save=tuple(self.lora_modules_to_save) or None,
                            train_base=self.lora_train_base,
                            quant_type=self.quant_type, double_quant=self.double_quant,
                            compute_dtype=self.param_dtype, upcast_non_quantized=self.kbit_upcast,
                            gptq_group_size=self.gptq_group_size or 128, bnb_keeps_input=self.bnb_keeps_input)


def _check(value, allowed, name):
    if value not in allowed:
        raise ValueError(f"TraceKey.{name}={value!r}; expected one of {allowed}")


def canonical_config_json(config) -> str:
    """config.json values (a dict or a transformers PretrainedConfig) as sorted, compact JSON."""
    d = config if isinstance(config, dict) else config.to_dict()
    return json.dumps(d, sort_keys=True, separators=(",", ":"), default=str)


def cuda_fields(hf_config_json: str, attn_implementation: str, param_dtype: str,
                autocast_dtype: Optional[str], lora_dropout: float = 0.0) -> dict:
    """The TraceKey fields of a GPU plan: where CUDA's kernels or autocast allocate differently from
    the CPU's, the step is traced as CUDA runs it. Each is set only where it changes the step, so
    other steps keep one trace for both devices."""
    return {"fused_dropout": drops_out(hf_config_json, lora_dropout),
            "cuda_autocast": autocast_dtype is not None,
            "cuda_sdpa_math": (attn_implementation == "sdpa" and grouped_query(hf_config_json)
                               and param_dtype == "float32" and autocast_dtype is None)}


def grouped_query(hf_config_json: str) -> bool:
    """Whether the model's attention groups query heads over fewer key/value heads."""
    config = json.loads(hf_config_json)
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    return isinstance(heads, int) and isinstance(kv, int) and 0 < kv < heads


def drops_out(hf_config_json: str, lora_dropout: float = 0.0) -> bool:
    """Whether a step drops anything out: a dropout probability strictly between 0 and 1 in the
    model's config (`*dropout*`, `*pdrop*` keys) or peft's lora_dropout. A GPU plan traces with
    `fused_dropout` only then, so a model without dropout keeps one trace for both devices."""
    config = json.loads(hf_config_json)
    probs = [v for k, v in config.items() if ("dropout" in k or "pdrop" in k) and isinstance(v, (int, float))]
    return 0 < lora_dropout < 1 or any(0 < p < 1 for p in probs)


def trace_notes(key: TraceKey) -> tuple[str, ...]:
    """What the trace did differently from the GPU run it stands for."""
    notes = []
    if key.attn_implementation == "flash_attention_2":
        notes.append("flash_attention_2 traced as sdpa: on CPU sdpa runs the flash-attention "
                     "kernel (_scaled_dot_product_flash_attention_for_cpu), which like FA2 saves "
                     "only the output and logsumexp, never the seq x seq scores")
    if key.fused_dropout:
        notes.append("dropout traced as CUDA runs it: the fused kernel's output and a 1-byte mask "
                     "(aten Dropout.cpp is_fused_kernel_acceptable, native_dropout), not the CPU "
                     "kernel's noise tensor in the input's dtype; SDPA's attention dropout as the "
                     "fused attention kernels take it, keeping no mask or probabilities")
    if key.cuda_sdpa_math:
        notes.append("grouped-query SDPA on fp32 inputs traced as CUDA runs it: the math kernel, which "
                     "repeats the key/value heads and keeps the seq x seq probabilities (FlashAttention, "
                     "the only fused kernel with GQA, takes no fp32); the CPU's flash kernel keeps neither")
    if key.cuda_autocast:
        notes.append("autocast traced with CUDA's op policy (aten/src/ATen/autocast_mode.h): pow, exp, "
                     "rsqrt, layer_norm, losses... in fp32, softmax, log_softmax and sum with an fp32 "
                     "result, einsum and matrix-vector products in the autocast dtype")
    if key.gradient_checkpointing:
        notes.append(checkpointing.DESCRIPTION[key.checkpoint_policy])
    if key.optimizer.startswith("adamw") and key.optimizer != "adamw_fused":
        notes.append("AdamW 'step' tensors (4 B per parameter) are traced on the device; on "
                     "GPU the non-fused AdamW keeps them on the host")
    return tuple(notes)


# ----------------------------------------------------------------------------- recording

class _Recorder:
    """Storage rows and the event counter. Rows are appended on allocation; a weakref callback on
    each storage writes its free event (mem_tracker.py `_WeakRefInfo.create_winfo`)."""
    def __init__(self):
        self.nbytes: list[int] = []
        self.itemsize: list[int] = []  # element size of the tensor the storage was first seen with
        self.op_class: list[int] = []  # OpClass of the op that allocated the storage
        self.alloc: list[int] = []
        self.free: list[int] = []
        self.num_events = 0
        self.row_of: dict[int, int] = {}  # id(storage) -> row, while alive
        self.refs: dict[int, weakref.ref] = {}
        self.flops = 0.0
        self.attention_flops = 0.0  # the part of `flops` in fused attention kernels (sdpa)
        self.derive = False  # while True (the optimizer step): note what each new storage came from
        self.derived: dict[int, int] = {}  # row -> the row of the input it was computed from

    def see(self, storage, itemsize: int, op_class: int = OpClass.ELEMENTWISE) -> None:
        sid = id(storage)
        if sid in self.row_of:
            return
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        row = len(self.nbytes)
        self.nbytes.append(nbytes)
        self.itemsize.append(itemsize)
        self.op_class.append(op_class)
        self.alloc.append(self.num_events)
        self.free.append(-1)
        self.num_events += 1
        self.row_of[sid] = row
        self.refs[sid] = weakref.ref(storage, lambda _r, sid=sid, row=row: self._freed(sid, row))

    def _freed(self, sid: int, row: int) -> None:
        self.free[row] = self.num_events
        self.num_events += 1
        del self.row_of[sid], self.refs[sid]

    def workspace(self) -> None:
        """A row for a GPU kernel's workspace (OpClass.WORKSPACE, 0 bytes here): allocated now,
        freed at the next event."""
        self.nbytes.append(0)
        self.itemsize.append(1)
        self.op_class.append(OpClass.WORKSPACE)
        self.alloc.append(self.num_events)
        self.free.append(self.num_events + 1)
        self.num_events += 2

    def row(self, tensor, create: bool = True) -> int:
        """The row of `tensor`'s storage; a storage first seen here is allocated now."""
        st = tensor.untyped_storage()
        if create:
            self.see(st, tensor.element_size())
        return self.row_of[id(st)]


def grouped_mm_flop(a, b, *args, out_val=None, **kwargs) -> int:
    """FLOPs of `aten._grouped_mm` (torch's registry has none): each output element is a dot
    product of length k = a.shape[-1], except when offsets split that contraction itself (a and b
    both 2D, the weight gradient of an expert layer: out is groups x m x n, and the groups share
    the k rows), where it is 2 m n k in all (torch/_meta_registrations.py `_meta_grouped_mm`)."""
    k = a.shape[-1]
    if a.dim() == 2 and b.dim() == 2:
        return 2 * out_val.shape[-2] * out_val.shape[-1] * k
    return 2 * out_val.numel() * k


# The fused attention backward kernels: the CPU one a trace runs for sdpa (and flash_attention_2,
# traced as sdpa), and the GPU ones should a trace run them. On a GPU FlashAttention-2's backward
# allocates an fp32 dq accumulator and, for grouped-query attention, K/V gradients expanded to
# every head inside the call (launcher/memory/runtime.py `flash_attention_backward_bytes`).
FUSED_ATTENTION_BACKWARD = ("_scaled_dot_product_flash_attention_for_cpu_backward",
                            "_scaled_dot_product_flash_attention_backward",
                            "_scaled_dot_product_efficient_attention_backward",
                            "_flash_attention_backward", "_efficient_attention_backward")


def _dispatch_mode(recorder: _Recorder):
    """A TorchDispatchMode that reports every output storage to `recorder` (with its element size
    and the OpClass of the op) and counts FLOPs."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

    aten = torch.ops.aten
    formulas = dict(flop_registry)
    # torch's registry lacks the CPU flash-attention kernels; their FLOPs are those of sdpa.
    formulas[aten._scaled_dot_product_flash_attention_for_cpu] = sdpa_flop
    formulas[aten._scaled_dot_product_flash_attention_for_cpu_backward] = sdpa_backward_flop
    if hasattr(aten, "_grouped_mm"):  # mixture-of-experts layers (transformers' `grouped_mm` experts)
        formulas[aten._grouped_mm] = grouped_mm_flop
    see, Tensor = recorder.see, torch.Tensor
    copy_ops = {getattr(aten, name) for name in COPY_OPS if hasattr(aten, name)}
    workspace_ops = {getattr(aten, name) for name in FUSED_ATTENTION_BACKWARD if hasattr(aten, name)}

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            formula = formulas.get(func._overloadpacket)
            if formula is not None:
                flops = formula(*args, **(kwargs or {}), out_val=out)
                recorder.flops += flops
                if "scaled_dot_product" in func._overloadpacket.__name__:
                    recorder.attention_flops += flops
            op_class = (OpClass.FLOP if formula is not None else
                        OpClass.COPY if func._overloadpacket in copy_ops else OpClass.ELEMENTWISE)
            first = len(recorder.nbytes)
            if isinstance(out, Tensor):
                see(out.untyped_storage(), out.element_size(), op_class)
            else:
                for t in tree_leaves(out):
                    if isinstance(t, Tensor):
                        see(t.untyped_storage(), t.element_size(), op_class)
            if recorder.derive and len(recorder.nbytes) > first:
                _note_sources(recorder, first, out, args)
            if func._overloadpacket in workspace_ops:
                # a fused attention backward's GPU workspace, allocated after its outputs (above)
                # and freed as the call returns
                recorder.workspace()
            return out

    return _Mode()


def _note_sources(recorder: _Recorder, first: int, out, args) -> None:
    """For the rows an op just created (from `first` on): the row of the input each was computed
    from. A foreach op's i-th output comes from the i-th tensor of its first list argument (one
    per parameter: torch/optim/adamw.py `_multi_tensor_adamw`); any other op's from its first
    tensor argument."""
    import torch
    from torch.utils._pytree import tree_leaves

    Tensor = torch.Tensor
    if isinstance(out, (list, tuple)) and args and isinstance(args[0], (list, tuple)):
        pairs = zip(out, args[0])
    else:
        src = next((a for a in tree_leaves(args) if isinstance(a, Tensor)), None)
        pairs = [(o, src) for o in tree_leaves(out)]
    for o, src in pairs:
        if not (isinstance(o, Tensor) and isinstance(src, Tensor)):
            continue
        ro = recorder.row_of.get(id(o.untyped_storage()))
        rs = recorder.row_of.get(id(src.untyped_storage()))
        if ro is not None and rs is not None and ro >= first and rs != ro:
            recorder.derived.setdefault(ro, rs)


# ----------------------------------------------------------------------------- the step

def build_config(key: TraceKey):
    """The transformers config of `key` at depth `key.num_layers`. Setting `num_hidden_layers`
    goes through the config's `attribute_map` (gpt2/bloom `n_layer`, opt `num_hidden_layers`)."""
    from transformers import AutoConfig

    values = json.loads(key.hf_config_json)
    cfg = AutoConfig.for_model(**values)
    cfg.num_hidden_layers = key.num_layers
    if isinstance(getattr(cfg, "layer_types", None), list):  # per-layer lists follow the depth
        cfg.layer_types = cfg.layer_types[: key.num_layers]
    cfg.use_cache = key.use_cache  # the cache of keys and values, as transformers 4 fills it (`_transformers4_cache`)
    return tp_shard_config(cfg, key.tp_size) if key.tp_size > 1 and cfg.model_type in TP_SHARDABLE else cfg


TP_SHARDABLE = ("llama", "mistral", "qwen2")  # configs whose TP shard is a smaller config of the same kind


def tp_traceable(model_type: str) -> bool:
    """Whether a tensor-parallel shard of this family can be traced: as a smaller config
    (`tp_shard_config`) or by its sharding rule (launcher/tp_shard.py)."""
    return model_type in TP_SHARDABLE or shardable(model_type)


def tp_padded_vocab(vocab_size: int, tp_size: int) -> int:
    """The vocabulary ColossalAI's vocab-parallel embedding and LM head pad to: a multiple of
    `make_vocab_size_divisible_by x tp_size` (colossalai/shardformer/layer/parallel_module.py
    `PaddingParallelModule`; embedding.py `VocabParallelEmbedding1D` and linear.py
    `VocabParallelLMHead1D`: `multiple = make_vocab_size_divisible_by * tp_size`), with the
    multiple the emitter writes (launcher/tp_shard.py `vocab_multiple`)."""
    unit = vocab_multiple(vocab_size, tp_size) * tp_size
    return -(-vocab_size // unit) * unit


def tp_shard_config(cfg, tp_size: int):
    """The config of the model one tensor-parallel rank holds under ColossalAI's 1D TP
    (Megatron-LM, arXiv:1909.08053 sec. 3; colossalai/shardformer/policies/llama.py): q/k/v and
    gate/up are column-parallel (`Linear1D_Col`: output features / tp), o and down are
    row-parallel (`Linear1D_Row`: input features / tp), the embedding and LM head are
    vocab-parallel over the padded vocabulary (`tp_padded_vocab` / tp rows). So the shard is the
    same architecture with num_attention_heads, num_key_value_heads, intermediate_size and
    vocab_size divided by tp and head_dim kept; norms stay whole (replicated). Tracing it gives
    the rank's parameters and the activations of its sharded layers; the communication buffers
    the shard model does not allocate are added by launcher/backends/colossalai/layout.py."""
    if cfg.model_type not in TP_SHARDABLE:
        raise ValueError(f"tensor-parallel shard tracing supports {TP_SHARDABLE}, not {cfg.model_type!r}")
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % tp_size or kv % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide {heads} attention / {kv} KV heads")
    cfg.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    cfg.num_attention_heads, cfg.num_key_value_heads = heads // tp_size, kv // tp_size
    cfg.intermediate_size = cfg.intermediate_size // tp_size
    cfg.vocab_size = tp_padded_vocab(cfg.vocab_size, tp_size) // tp_size
    return cfg


def _make_optimizer(key: TraceKey, params):
    import torch

    if key.optimizer in ("sgd", "sgd_plain"):  # foreach: the default for CUDA tensors (optimizer.py)
        return torch.optim.SGD(params, lr=1e-3, momentum=SGD_MOMENTUM if key.optimizer == "sgd" else 0.0,
                               foreach=True)
    if key.optimizer == "adafactor":  # HF Trainer's optim="adafactor" settings (no data-dependent lr)
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False)
    return torch.optim.AdamW(params, lr=1e-3, foreach=key.optimizer == "adamw_foreach",
                             fused=key.optimizer == "adamw_fused" or None)


class _PerParameter:
    """The optimizers `_step_in_backward` made, as one for `_classify` (their states)."""

    def __init__(self, optimizers: list) -> None:
        self.optimizers = optimizers

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}


def _step_in_backward(key: TraceKey, trainable: list) -> _PerParameter:
    """One optimizer per parameter, stepped and its gradient freed in the parameter's
    post-accumulate-grad hook, after the hook that records the gradient (hooks run in registration
    order), as torch's tutorial "How to save memory by fusing the optimizer step into the backward
    pass" and torchtune's `register_optim_in_bwd_hooks` (training/memory.py) do; the worker runs
    launcher/worker/optim.py `OptimizerInBackward`. bitsandbytes' optimizers (not traced) only free
    the gradient here; their states are modelled by the layout."""
    optimizers = []
    for p in trainable:
        opt = _make_optimizer(key, [p]) if key.optimizer != "none" else None
        optimizers += [opt] if opt is not None else []

        def hook(p, opt=opt):
            if opt is not None:
                opt.step()
            p.grad = None
        p.register_post_accumulate_grad_hook(hook)
    return _PerParameter(optimizers)


def _loss(model, ids, key: TraceKey, kept: list):
    """The model's own causal-LM loss; a tensor-parallel shard computes ColossalAI's
    vocabulary-parallel loss on its logits slice (launcher/vocab_parallel_loss.py), with the
    logits held meanwhile, as ColossalAI's causal-LM forward holds them. With `key.keep_outputs`
    the model's output (its logits and the cache of keys and values it returns) is appended to
    `kept`, as a loop that keeps it does."""
    if key.tp_size > 1:
        out = model(input_ids=ids)
        if key.keep_outputs:
            kept.append(out)
        logits = out.logits
        del out
        return vocab_parallel_loss(logits, ids)
    if key.loss in ("fp32_shift_copy", "shift_copy") and "fused_linear_cross_entropy" not in liger.parse(key.kernels):
        # fp32_shift_copy: transformers 4.37-4.45, LlamaForCausalLM.forward (and Mistral's,
        # Qwen2's...): `logits = logits.float()`, then `shift_logits = logits[..., :-1,
        # :].contiguous()` into CrossEntropyLoss. shift_copy: the same without the upcast
        # (transformers 4.2x-4.3x GPT2LMHeadModel / OPTForCausalLM / BloomForCausalLM, Qwen (v1)'s
        # QWenLMHeadModel: `shift_logits = lm_logits[..., :-1, :].contiguous()`). HF Trainer's
        # compute_loss drops the outputs before backward
        import torch

        # those versions computed the loss inside the forward, so its cache (training.use_cache)
        # is alive through the loss
        out = model(input_ids=ids)
        logits, cache = out.logits, out.past_key_values
        del out
        logits = logits.float() if key.loss == "fp32_shift_copy" else logits
        if key.keep_outputs:  # what those forwards returned: these logits and the cache
            kept.append((logits, cache))
        shift = logits[..., :-1, :].contiguous()
        return torch.nn.functional.cross_entropy(shift.view(-1, shift.shape[-1]), ids[..., 1:].contiguous().view(-1))
    out = model(input_ids=ids, labels=ids)
    if key.keep_outputs:
        kept.append(out)
    return out.loss


def _previous_outputs(model, ids, key: TraceKey, rec: _Recorder, num_layers: int) -> tuple[list, dict]:
    """The previous step's model outputs, alive when this step's forward starts: a loop that
    assigns them to a variable (`outputs = model(**batch)`: transformers' examples/pytorch/
    *_no_trainer.py and accelerate's examples) drops them only when the next forward returns.
    They are what `_loss` keeps of a step: the logits and, with the cache (`key.use_cache`), the
    keys and values every layer returns, which hold their projections' storages (GPT-2's fused
    qkv output, of which they are views). Made by `_loss` without autograd (the same storages a
    step's forward returns; its temporaries are freed before this step starts). Returns them and,
    per storage still alive, the decoder layer that allocated it (the rebuild at the real depth
    repeats a layer's: launcher/memory/replay.py `full_depth_items`)."""
    import torch

    layers = _decoder_layers(model, num_layers)
    starts: list[tuple[int, int]] = []  # (event, layer): allocations from `event` on are that layer's
    hooks = [] if layers is None else [
        h for i, layer in enumerate(layers) for h in (
            layer.register_forward_pre_hook(lambda *_, i=i: starts.append((rec.num_events, i))),
            layer.register_forward_hook(lambda *_: starts.append((rec.num_events, -1))))]
    first, held = len(rec.nbytes), []
    with torch.no_grad():
        _loss(model, ids, key, held)
    for h in hooks:
        h.remove()
    events = np.array([e for e, _ in starts], np.int64)
    owners = np.array([-1] + [i for _, i in starts], np.int64)
    layer_of = {row: int(owners[np.searchsorted(events, rec.alloc[row], side="right")])
                for row in range(first, len(rec.nbytes)) if rec.free[row] < 0}
    return held, layer_of


def _run_step(key: TraceKey, rec: _Recorder, marks: dict, grads: dict):
    """Build the model and run one step; fills `marks` (phase -> first event) and
    `grads` (id(param) -> (ready event, grad row)). Returns (model, optimizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, key.param_dtype)
    marks["build"] = rec.num_events
    model = AutoModelForCausalLM.from_config(
        build_config(key), dtype=dtype, attn_implementation=_traced_attn(key))
    model.train()
    if key.transformers4:
        _transformers4_buffers(model)
    if key.rotary_cache:
        _rotary_caches(model)
    if key.tp_size > 1 and model.config.model_type not in TP_SHARDABLE:  # its family's rule (tp_shard.py)
        shard_model(model, key.tp_size, tp_padded_vocab(model.config.vocab_size, key.tp_size))
    kernels = liger.applied(model, liger.parse(key.kernels)) if key.kernels != "torch" else contextlib.nullcontext()
    with kernels:  # Liger's kernels replace modules and functions for the forward and the backward
        if key.gradient_checkpointing:
            checkpointing.enable(model, key.checkpoint_policy)
        vocab_size = model.config.vocab_size
        if key.trainable == "lora":
            model, marks["quantized"] = _apply_lora(model, key)
        given_grads = _flat_param_grads(model) if key.flat_param_grads else []
        previous, ids, marks["previous_layers"] = None, None, {}
        if key.keep_outputs:  # before the layers are watched: the first forward they see is the step's
            ids = torch.randint(0, vocab_size, (key.micro_batch_size, key.seq_len))
            marks["previous"] = rec.num_events
            with torch.autocast("cpu", dtype=getattr(torch, key.autocast_dtype or "float32"),
                                enabled=key.autocast_dtype is not None):
                previous, marks["previous_layers"] = _previous_outputs(model, ids, key, rec, key.num_layers)
        _watch_layers(model, key.num_layers, rec, marks)
        trainable = [p for p in model.parameters() if p.requires_grad]
        for p in trainable:
            p.register_post_accumulate_grad_hook(
                lambda p: grads.__setitem__(id(p), (rec.num_events, rec.row(p.grad))))
        in_backward = _step_in_backward(key, trainable) if key.optimizer_in_backward else None
        opt = _make_optimizer(key, trainable) if key.optimizer != "none" and in_backward is None else None
        if ids is None:
            ids = torch.randint(0, vocab_size, (key.micro_batch_size, key.seq_len))
        kept: list = []  # this step's outputs, with key.keep_outputs
        marks["forward"], flops0, attn0 = rec.num_events, rec.flops, rec.attention_flops
        with torch.autocast("cpu", dtype=getattr(torch, key.autocast_dtype or "float32"),
                            enabled=key.autocast_dtype is not None):
            loss = _loss(model, ids, key, kept)
        del previous  # this step's outputs replace them as the forward returns
        marks["backward"], flops1, attn1 = rec.num_events, rec.flops, rec.attention_flops
        loss.backward()
        del loss
        marks["optimizer"] = rec.num_events
        marks["flops"] = {"forward": flops1 - flops0, "backward": rec.flops - flops1,
                          "attention_forward": attn1 - attn0, "attention_backward": rec.attention_flops - attn1}
        if opt is not None:
            rec.derive = True
            opt.step()
            rec.derive = False
        marks["zero_grad"] = rec.num_events
        (opt or model).zero_grad(set_to_none=True)
        del kept[:]  # kept until the next forward returns: the previous outputs of that step
        marks["end"] = rec.num_events
        for p in given_grads:  # the parameter table records what the optimizer steps
            p.requires_grad_(False)
        marks["inputs"] = rec.row(ids)
        return model, (in_backward or opt)


def _flat_param_grads(model) -> list:
    """FSDP1 with `use_orig_params=True` flattens a unit's parameters into one FlatParameter that
    requires grad when any of them does (_flat_param.py `_validate_tensors_to_flatten`: the logical
    OR), and in forward the parameters are views of it (`_use_unsharded_views(as_params=False)`), so
    autograd computes the frozen ones' gradients too, and saves what their gradients need
    (_wrap_utils.py `_validate_frozen_params` warns of the gradient memory). The units are the
    decoder layers and the rest of the model (one unit per layer and the root). Sets requires_grad
    on the frozen parameters of each unit holding a trainable one; returns them."""
    units: dict = {}
    for name, p in model.named_parameters():
        m = _LAYER_RE.search(name)
        units.setdefault(int(m.group(1)) if m else -1, []).append(p)
    out = []
    for params in units.values():
        if any(p.requires_grad for p in params):
            out += [p for p in params if not p.requires_grad]
    for p in out:
        p.requires_grad_(True)
    return out


def _apply_lora(model, key: TraceKey):
    """Wrap the fake-tensor model with `peft.get_peft_model` exactly as the worker does
    (launcher/peft.py). QLoRA: the Linear weights bitsandbytes would quantize stay in the compute
    dtype and run through the MatMul4Bit stand-in (launcher/peft.py module docstring); their
    storage bytes are replaced by the 4-bit layout in `trace_step`. Returns (model, those weights)."""
    settings = key.lora_settings()
    if key.quant_type == "torchao_nf4":  # torchtune: the Linears that get adapters are NF4, the rest bf16
        with lp.fake_tensor_adapter_moves():
            model = lp.apply_lora(model, settings, autocast_adapter_dtype=key.adapter_autocast)
        torchao_nf4.stand_in(torchao_nf4.adapted_linears(model))
        return model, []
    linears = lp.quantizable_linears(model) if key.quant_type else []
    gptq = key.quant_type in GPTQ_BITS
    experts = lp.expert_parameters(model) if key.quant_type and not gptq else []
    if gptq:  # a GPTQ checkpoint: QuantLinear buffers and dequantization, traced as they are
        gptq_stand_in(linears, GPTQ_BITS[key.quant_type], key.gptq_group_size)
    elif key.kbit_upcast:
        lp.upcast_non_quantized(model, [m.weight for m in linears] + experts)
    with lp.fake_tensor_adapter_moves():
        model = lp.apply_lora(model, settings, autocast_adapter_dtype=key.adapter_autocast)
    return model, ([] if gptq else lp.qlora_stand_in(linears, settings) + experts)


def _four_bit_rows(nbytes: list, quantized, rec: _Recorder, key: TraceKey) -> None:
    """QLoRA: the traced compute-dtype storage of each 4-bit base weight -> its bitsandbytes bytes
    (packed 4-bit weight + absmax (+ double-quant constants) + code; launcher/quant.py)."""
    settings = key.lora_settings()
    for w in quantized:  # a 3D expert parameter: one 4-bit matrix per expert
        nbytes[rec.row(w, create=False)] = four_bit_storage_bytes(w.numel(), settings,
                                                                  w.shape[0] if w.dim() == 3 else 1)


def _decoder_layers(model, num_layers: int):
    """The model's `ModuleList` of its `num_layers` decoder layers, or None."""
    import torch

    return next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers), None)


def _watch_layers(model, num_layers: int, rec: _Recorder, marks: dict) -> None:
    """Record in `marks` the events where the decoder layers' forward starts ('fwd0') and ends
    ('fwd1'), and where their backward starts ('bwd0': the gradient of the last layer's output
    is computed) and ends ('bwd1': the gradient of the first layer's input), and the allocation
    events of the first layer's input hidden state ('fwd_input': where the embedding's output is
    made; what the forward computes after it and before the layers, e.g. position tensors and
    attention masks, does not feed the layers' hidden state) and of the last layer's output
    hidden state ('fwd_output'). Only the first forward counts (checkpointing runs the layers
    again in backward)."""
    import torch

    layers = _decoder_layers(model, num_layers)
    if layers is None:
        return

    def mark(name):
        def hook(*_):
            marks.setdefault(name, rec.num_events)  # returns None: the gradient is unchanged
        return hook

    def watch(tensors, fwd: str, bwd: str):
        if fwd in marks:
            return
        marks[fwd] = rec.num_events
        x = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
        if x is not None and id(x.untyped_storage()) in rec.row_of:
            marks[{"fwd0": "fwd_input", "fwd1": "fwd_output"}[fwd]] = rec.alloc[rec.row(x, create=False)]
        if x is not None and x.requires_grad:
            x.register_hook(mark(bwd))

    layers[0].register_forward_pre_hook(
        lambda m, args, kwargs: watch([*args, kwargs.get("hidden_states")], "fwd0", "bwd1"),
        with_kwargs=True)
    layers[-1].register_forward_hook(
        lambda m, args, out: watch(torch.utils._pytree.tree_leaves(out), "fwd1", "bwd0"))


@contextlib.contextmanager
def _transformers4_cache():
    """The cache of keys and values as transformers 4 fills it in a training forward: each layer's
    own key and value tensors (4.36's `DynamicCache.update` appends them; earlier releases return
    them as a tuple), not copies (transformers 5's `DynamicLayer.update` concatenates them
    onto an empty tensor). GPT-2's are views of its fused qkv projection, so a kept output holds
    every layer's projection: alive until the outputs are dropped (HF Trainer's `compute_loss`
    drops them once the loss is taken), or the next forward returns (`_previous_outputs`)."""
    from transformers.cache_utils import DynamicLayer

    original = DynamicLayer.update

    def update(self, key_states, value_states, *args, **kwargs):
        if self.is_initialized:
            return original(self, key_states, value_states, *args, **kwargs)
        self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states
        return self.keys, self.values

    DynamicLayer.update = update
    try:
        yield
    finally:
        DynamicLayer.update = original


@contextlib.contextmanager
def _fused_dropout():
    """`torch.nn.functional.dropout` as ATen runs it on a CUDA tensor: `at::dropout` takes the fused
    kernel when `is_fused_kernel_acceptable` (aten/src/ATen/native/Dropout.cpp: a CUDA input, 0 <
    p < 1, not empty) and returns `native_dropout`'s output, whose backward keeps the kernel's mask
    of one byte per element (NativeDropoutBackward0 saves `result1`, a bool tensor); the in-place
    form copies that output into the input. On a CPU tensor `at::dropout` multiplies the input by
    a noise tensor of the input's dtype and keeps that tensor for backward (`_dropout_impl`), so a
    step traced on the CPU device as it runs there holds 2-4 bytes per element where the GPU holds
    one. Every `nn.Dropout` and `F.dropout` call (the models' hidden and attention dropout, peft's
    lora_dropout) goes through this function. Outside 0 < p < 1, in eval mode or on a
    non-floating input, the original function runs. SDPA's own dropout: `_cuda_sdpa`."""
    import torch

    original = torch.nn.functional.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if not (training and 0 < p < 1 and input.is_floating_point() and input.numel()):
            return original(input, p, training, inplace)
        out = torch.native_dropout(input, p, True)[0]
        return input.copy_(out) if inplace else out

    torch.nn.functional.dropout = dropout
    try:
        yield
    finally:
        torch.nn.functional.dropout = original


@contextlib.contextmanager
def _cuda_sdpa(fused_dropout: bool, gqa_math: bool):
    """`F.scaled_dot_product_attention` with the kernel CUDA picks where its memory differs from the
    CPU's kernel:

    - `gqa_math`: grouped-query attention (`enable_gqa=True`) on fp32 inputs. Of the CUDA kernels
      only FlashAttention and the math kernel take GQA (the function's own documentation, torch
      2.13), and FlashAttention takes only fp16/bf16, so fp32 queries run
      `_scaled_dot_product_attention_math`, which repeats the key/value heads and keeps the seq x
      seq probabilities for backward. transformers asks for GQA whenever no mask is passed
      (integrations/sdpa_attention.py `use_gqa_in_sdpa`), so a pure fp32 run of Llama 3, Mistral or
      Qwen2 takes that path on a GPU, while the CPU's flash kernel takes GQA in fp32 and keeps
      neither. Under autocast SDPA's inputs are cast to the autocast dtype, and FlashAttention runs.
    - `fused_dropout`: attention dropout (`dropout_p > 0`: GPT-2's and BioGPT's attention under
      sdpa). CUDA's fused kernels take it (FlashAttention and the memory-efficient kernel draw the
      mask from a Philox seed and offset they return, and draw it again in backward), so they keep
      no mask and no probabilities, while the CPU has no fused kernel with dropout and falls back
      to the math path, which keeps the seq x seq probabilities, the dropout noise and the dropped
      probabilities. So the attention is traced with `dropout_p=0`: the fused kernel's storages
      less its two scalar Philox tensors."""
    import torch

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, **kwargs):
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
        if gqa_math and enable_gqa and dtype == torch.float32 and not kwargs:
            return torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=True)[0]
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=0.0 if fused_dropout else dropout_p,
                    is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa


# CUDA autocast's op lists (aten/src/ATen/autocast_mode.h, torch 2.4 on: AT_FORALL_FP32,
# AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_PROMOTE,
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE), as `aten` overload names. Of the lower-precision list only
# the ops the CPU's autocast does not also cast (autocast_mode.cpp's AutocastCPU registrations:
# linear, matmul, mm, bmm, addmm, baddbmm, addbmm, conv*, prelu, linalg_vecdot and SDPA it casts
# alike, and with the same cache of cast weights).
CUDA_AUTOCAST_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa")
CUDA_AUTOCAST_FP32_SET_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList")
CUDA_AUTOCAST_LOWER = ("addmv", "addr", "einsum", "mv", "chain_matmul", "linalg_multi_dot")
CUDA_AUTOCAST_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
                         "index_put", "tensordot", "scatter_add")
CUDA_AUTOCAST_NORM = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
# on the CPU's autocast list only: CUDA's leaves them to their parts (cross_entropy_loss runs
# log_softmax, whose result CUDA's policy makes fp32, without the CPU's fp32 copy of the logits)
CPU_ONLY_AUTOCAST = ("cross_entropy_loss",)


@contextlib.contextmanager
def _cuda_autocast():
    """The autocast region runs CUDA's op policy. The step is traced under the CPU's autocast (CPU
    tensors dispatch to AutocastCPU), whose op lists differ from CUDA's: CUDA runs pow, exp, rsqrt,
    layer_norm and the losses in fp32 and gives softmax, log_softmax, sum and cumsum an fp32 result
    (so GPT-2's, GPT-J's and CodeGen's tanh GELU, which cubes its input, keeps its intermediates in
    fp32 on a GPU and in the autocast dtype on the CPU), casts einsum and matrix-vector products to
    the autocast dtype, and promotes mixed inputs of addcmul, index_put, scatter_add... to the widest.
    Python kernels registered for the AutocastCPU key apply CUDA's policy (autocast_mode.h: cast
    every floating, non-fp64 tensor argument, `cached_cast`; append dtype=float32 unless one is
    given, `fp32_set_opt_dtype`) with the autocast key excluded, as autocast's own kernels
    redispatch; an op only the CPU's list holds falls through, as on CUDA. They are removed when
    the trace ends."""
    import warnings

    import torch

    aten = torch.ops.aten
    exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def op_of(name):
        base, _, overload = name.partition(".")
        packet = getattr(aten, base, None)
        return getattr(packet, overload or "default", None) if packet is not None else None

    def eligible(a):
        return isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.float64

    def cast_all(x, dtype):
        if isinstance(x, (list, tuple)):
            return type(x)(cast_all(a, dtype) for a in x)
        return x.to(dtype) if eligible(x) and x.dtype != dtype else x

    def cast_policy(op, target):
        def kernel(*args, **kwargs):
            dtype = target() if callable(target) else target
            with torch._C._ExcludeDispatchKeyGuard(exclude):
                return op(*cast_all(args, dtype), **{k: cast_all(v, dtype) for k, v in kwargs.items()})
        return kernel

    def set_dtype_policy(op):
        at = [a.name for a in op._schema.arguments].index("dtype")

        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(exclude):
                given = args[at] if len(args) > at else kwargs.get("dtype")
                if given is None and eligible(args[0]):
                    if len(args) > at:
                        args = args[:at] + (torch.float32,) + args[at + 1:]
                    else:
                        kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
        return kernel

    def promote_policy(op):
        def kernel(*args, **kwargs):
            flat = [a for a in list(args) + list(kwargs.values())
                    for a in (a if isinstance(a, (list, tuple)) else [a]) if eligible(a)]
            widest = flat[0].dtype if flat else None
            for a in flat[1:]:
                widest = torch.promote_types(widest, a.dtype)
            with torch._C._ExcludeDispatchKeyGuard(exclude):
                if widest is None:
                    return op(*args, **kwargs)
                return op(*cast_all(args, widest), **{k: cast_all(v, widest) for k, v in kwargs.items()})
        return kernel

    def norm_policy(op, with_dtype):
        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(exclude):
                if eligible(args[0]):
                    return with_dtype(*args, **kwargs, dtype=torch.float32)
                return op(*args, **kwargs)
        return kernel

    region_dtype = lambda: torch.get_autocast_dtype("cpu")  # noqa: E731 - the region's lower precision
    policies = [(name, lambda op: cast_policy(op, torch.float32)) for name in CUDA_AUTOCAST_FP32]
    policies += [(name, set_dtype_policy) for name in CUDA_AUTOCAST_FP32_SET_DTYPE]
    policies += [(name, lambda op: cast_policy(op, region_dtype)) for name in CUDA_AUTOCAST_LOWER]
    policies += [(name, promote_policy) for name in CUDA_AUTOCAST_PROMOTE]
    policies += [(name, lambda op, to=to: norm_policy(op, op_of(to))) for name, to in CUDA_AUTOCAST_NORM.items()]
    # no autocast kernel on CUDA: the op falls through, and the ops it is made of autocast
    policies += [(name, lambda op: torch.library.fallthrough_kernel) for name in CPU_ONLY_AUTOCAST]
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # overriding the CPU's own autocast kernel of an op warns
            warnings.simplefilter("ignore")
            for name, policy in policies:
                op = op_of(name)
                if op is not None:  # an op this torch does not have is not called either
                    lib.impl(name, policy(op), "AutocastCPU")
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def _zero3_linear():
    """`torch.nn.functional.linear` as DeepSpeed ZeRO-3 replaces it (memory_efficient_linear, on by
    default: partition_parameters.py `_enable_mem_efficient_linear` -> runtime/zero/linear.py
    `zero3_linear_wrap`): an autograd function that computes `input.matmul(weight.t())` (+ bias)
    and saves input, weight and bias for backward whatever needs a gradient, so a frozen
    Linear (LoRA's base) keeps its input, which torch's own linear does not."""
    import torch

    class LinearFunctionForZeroStage3(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias=None):
            ctx.save_for_backward(x, weight, bias)
            out = x.matmul(weight.t())
            if bias is not None:
                out += bias
            return out

        @staticmethod
        def backward(ctx, grad_out):
            x, weight, bias = ctx.saved_tensors
            grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
            grad_w = grad_out.flatten(0, -2).t().matmul(x.flatten(0, -2)) if ctx.needs_input_grad[1] else None
            grad_b = grad_out.flatten(0, -2).sum(0) if bias is not None and ctx.needs_input_grad[2] else None
            return grad_x, grad_w, grad_b

    original = torch.nn.functional.linear
    torch.nn.functional.linear = lambda x, weight, bias=None: LinearFunctionForZeroStage3.apply(x, weight, bias)
    try:
        yield
    finally:
        torch.nn.functional.linear = original


@contextlib.contextmanager
def _unpacked_sequences():
    """Answer transformers' packed-sequence check the way a real run on our inputs does.

    Without an attention mask, `masking_utils._preprocess_mask_arguments` asks
    `find_packed_sequence_indices(position_ids)` whether several sequences are packed in a row;
    on real tensors it evaluates `(mask[:, -1] == 0).all()` and returns None for ordinary
    position ids, so SDPA runs with `is_causal=True` and no mask. On fake tensors it cannot read
    the values and returns the mask, which makes SDPA materialize a seq x seq mask and leave the
    flash kernel (+5% to +22% peak on small models). Our position ids are never packed.

    Likewise `_ignore_causal_mask_sdpa` skips the mask on real tensors when the 2D padding mask is
    all ones (`fast_all`), which it cannot read on fake ones: a model that builds a mask of ones
    itself when none is given (BioGPT, for its learned positions) would trace a seq x seq mask the
    real run never allocates. The traced inputs have no padding, so the check is answered without
    the padding mask."""
    from unittest import mock  # imports asyncio: only where a step is traced

    from transformers import masking_utils

    with contextlib.ExitStack() as stack:
        if hasattr(masking_utils, "find_packed_sequence_indices"):
            stack.enter_context(mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda _ids: None))
        skip = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
        if skip is not None:  # a mask of ones the model builds itself (BioGPT, for its positions)
            stack.enter_context(mock.patch.object(
                masking_utils, "_ignore_causal_mask_sdpa", lambda _padding_mask, *a, **k: skip(None, *a, **k)))
        yield


@contextlib.contextmanager
def _sdpa_as_transformers4():
    """SDPA attention as transformers 4.51 runs it (the version ColossalAI's shardformer runs in,
    launcher/backends/colossalai/runtime.py): `sdpa_attention_forward` always expands grouped
    key/value heads with `repeat_kv`, where transformers 5 passes `enable_gqa=True` to SDPA without
    a mask (`use_gqa_in_sdpa`), and then calls `.contiguous()` on query, key and value (a copy
    each for a repeated single key/value head, a stride-0 view, or a transposed value)."""
    from unittest import mock

    import torch
    from transformers.integrations import sdpa_attention

    if not hasattr(sdpa_attention, "use_gqa_in_sdpa"):
        yield
        return
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def contiguous_sdpa(query, key, value, *args, **kwargs):
        return sdpa(query.contiguous(), key.contiguous(), value.contiguous(), *args, **kwargs)

    with mock.patch.object(sdpa_attention, "use_gqa_in_sdpa", lambda *a, **k: False), \
            mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", contiguous_sdpa):
        yield


def _transformers4_buffers(model) -> None:
    """Buffers transformers 4.51 models hold that transformers 5 dropped: GPT-2's attention keeps
    its causal mask as a bool `bias` buffer of n_positions x n_positions per layer
    (modeling_gpt2.py `GPT2Attention.__init__`, used by its eager attention)."""
    import torch

    if model.config.model_type != "gpt2":
        return
    n = model.config.max_position_embeddings
    for module in model.modules():
        if type(module).__name__ == "GPT2Attention" and not hasattr(module, "bias"):
            mask = torch.tril(torch.ones((n, n), dtype=torch.bool)).view(1, 1, n, n)
            module.register_buffer("bias", mask, persistent=False)


def _rotary_caches(model) -> None:
    """transformers 4.37-4.44's per-layer rotary tables (training.rotary_cache, launcher/config.py):
    `cos_cached` and `sin_cached`, max_position_embeddings x head_dim in the model's dtype, on every
    attention module (Qwen2RotaryEmbedding `_set_cos_sin_cache`, called from its __init__). Added to
    any attention with an `o_proj` (the Llama-family layout); the knob's source is Qwen2's."""
    import torch

    cfg = model.config
    n = cfg.max_position_embeddings
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    for module in model.modules():
        if type(module).__name__.endswith("Attention") and hasattr(module, "o_proj"):
            module.register_buffer("cos_cached", torch.empty(n, head_dim, dtype=dtype), persistent=False)
            module.register_buffer("sin_cached", torch.empty(n, head_dim, dtype=dtype), persistent=False)


def _traced_attn(key: TraceKey) -> str:
    return "sdpa" if key.attn_implementation == "flash_attention_2" else key.attn_implementation


_LAYER_RE = re.compile(r"\.(\d+)\.")


def _param_table(model, rec: _Recorder) -> tuple[ParamTable, list]:
    """Parameters in `named_parameters(remove_duplicate=False)` order (a tied weight appears under
    each name; the later names point at the first with `tied_to`), and their storage rows."""
    import torch

    named = list(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))
    out_emb = model.get_output_embeddings()
    first_of: dict[int, int] = {}
    names, numel, esize, trainable, role, layer, tied, rows = [], [], [], [], [], [], [], []
    shapes = tuple(tuple(p.shape) for _, p in named)
    for i, (name, p) in enumerate(named):
        sid = id(p.untyped_storage())
        tied.append(first_of.setdefault(sid, i) if sid in first_of else -1)
        first_of.setdefault(sid, i)
        owner = modules[name.rpartition(".")[0]]
        m = _LAYER_RE.search(name)
        names.append(name), numel.append(p.numel()), esize.append(p.element_size())
        trainable.append(p.requires_grad), layer.append(int(m.group(1)) if m else -1)
        role.append(_role(name, owner, m is not None, owner is out_emb, torch))
        rows.append(rec.row(p, create=False))
    table = ParamTable(tuple(names), np.array(numel, np.int64), np.array(esize, np.int64),
                       np.array(trainable, bool), np.array(role, np.int8),
                       np.array(layer, np.int64), np.array(tied, np.int64), shapes)
    return table, rows


def _role(name: str, owner, in_layer: bool, is_lm_head: bool, torch) -> Role:
    """EMBEDDING: token/position embeddings and norms named after them (bloom
    `word_embeddings_layernorm`); LAYER: inside decoder layer N (first `.N.` in the name);
    HEAD: the output embedding and the final norm; OTHER: the rest (e.g. opt project_in/out)."""
    if in_layer:
        return Role.LAYER
    if is_lm_head:
        return Role.HEAD
    if isinstance(owner, torch.nn.Embedding) or "embed" in name:
        return Role.EMBEDDING
    if "norm" in type(owner).__name__.lower() or "ln_f" in name:
        return Role.HEAD
    return Role.OTHER


def _canonical_free_order(free: np.ndarray, num_events: int, boundaries) -> np.ndarray:
    """Within each run of consecutive free events, free rows in row order. The order inside such a
    run changes no peak, but some of it is hash order (autocast's cast cache is cleared at exit),
    so without this two traces of the same step could differ. Runs are cut at `boundaries`
    (phase starts, grad-ready events), so no free moves across them."""
    is_free = np.zeros(num_events + 1, bool)
    is_free[free[free < num_events]] = True
    cut = ~is_free
    cut[np.asarray(list(boundaries), np.int64)] = True
    run_of_event = np.cumsum(cut)
    freed = np.nonzero(free < num_events)[0]
    rows = freed[np.lexsort((freed, run_of_event[free[freed]]))]
    out = free.copy()
    out[rows] = np.sort(free[freed])
    return out


@contextlib.contextmanager
def _quiet_fake_kernels():
    """FakeTensorMode logs, with its traceback, every op whose meta kernel refuses its inputs
    before raising the error (torch/_subclasses/fake_tensor.py `_dispatch_impl`:
    `log.exception("failed while attempting to run meta for %s")`, e.g. `aten._grouped_mm` on
    fp32 experts); the error itself still reaches the planner, which names the strategy it rules
    out in one note, so the log is held back while a step is traced."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def trace_step(key: TraceKey) -> StepTrace:
    """Trace one training step of `key` under fake tensors on the CPU device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rec, marks, grads = _Recorder(), {}, {}
    linear = _zero3_linear() if key.zero3_linear else contextlib.nullcontext()
    sdpa = _sdpa_as_transformers4() if key.transformers4 else contextlib.nullcontext()
    cache = _transformers4_cache() if key.use_cache else contextlib.nullcontext()
    dropout = _fused_dropout() if key.fused_dropout else contextlib.nullcontext()
    autocast = _cuda_autocast() if key.cuda_autocast else contextlib.nullcontext()
    cuda_sdpa = (_cuda_sdpa(key.fused_dropout, key.cuda_sdpa_math) if key.fused_dropout or key.cuda_sdpa_math
                 else contextlib.nullcontext())
    with _unpacked_sequences(), linear, sdpa, cache, dropout, autocast, cuda_sdpa, _quiet_fake_kernels(), \
            FakeTensorMode(allow_non_fake_inputs=True), _dispatch_mode(rec):
        model, opt = _run_step(key, rec, marks, grads)
        n, num_events = len(rec.nbytes), marks["end"]  # later frees and rows are not the step's
        params, param_rows = _param_table(model, rec)
        kind, ready, param = _classify(model, opt, rec, n, params, param_rows, grads)
        owner = _owners(rec.derived, param)
        buffer_layer = _buffer_layers(model, rec, n)
        for row, layer in marks["previous_layers"].items():  # a layer's part of the previous outputs
            if row < n and layer >= 0:
                buffer_layer[row] = layer
        kind[marks["inputs"]] = Kind.BUFFER
        free = np.array(rec.free[:n], np.int64)
        nbytes = list(rec.nbytes[:n])
        _four_bit_rows(nbytes, marks.get("quantized", ()), rec, key)
    free[(free < 0) | (free > num_events)] = num_events
    phases = {ph: (marks[ph], marks[nxt]) for ph, nxt in zip(PHASES, PHASES[1:] + ("end",))}
    if "previous" in marks:  # the previous step's outputs are made after the build (`_previous_outputs`)
        phases = {"build": (marks["build"], marks["previous"]), "previous": (marks["previous"], marks["forward"]),
                  **{ph: ab for ph, ab in phases.items() if ph != "build"}}
    bounds = {ph: (marks[a], marks[b]) for ph, a, b in
              (("forward", "fwd0", "fwd1"), ("backward", "bwd0", "bwd1")) if a in marks and b in marks}
    if "fwd_input" in marks and "forward" in bounds:
        bounds["embedding"] = (marks["forward"], marks["fwd_input"] + 1)
    if "fwd_output" in marks and "forward" in bounds:
        bounds["output"] = (marks["fwd_output"], marks["fwd_output"] + 1)
    if "bwd0" in marks and "backward" not in bounds:  # no gradient reaches the first layer's input
        bounds["backward_start"] = (marks["bwd0"], marks["bwd0"] + 1)  # (frozen embeddings: LoRA)
    cuts = ([a for a, _ in phases.values()] + [num_events] + list(ready[ready >= 0])
            + [e for ph in ("forward", "backward") for e in bounds.get(ph, ())])
    return StepTrace(num_layers=key.num_layers, micro_batch_size=key.micro_batch_size,
                     seq_len=key.seq_len, params=params, nbytes=np.array(nbytes, np.int64),
                     alloc=np.array(rec.alloc[:n], np.int64),
                     free=_canonical_free_order(free, num_events, cuts), kind=kind, ready=ready,
                     param=param, num_events=num_events, phases=phases, flops=marks["flops"],
                     layer_bounds=bounds, itemsize=np.array(rec.itemsize[:n], np.int8),
                     op_class=np.array(rec.op_class[:n], np.int8), owner=owner, buffer_layer=buffer_layer)


def _buffer_layers(model, rec: _Recorder, n: int) -> np.ndarray:
    """Per row, the decoder layer whose module registered the buffer that row stores (the first
    `.N.` of the buffer's name, as for parameters), -1 for the rest."""
    out = np.full(n, -1, np.int64)
    for name, b in model.named_buffers():
        m = _LAYER_RE.search(name)
        row = rec.row_of.get(id(b.untyped_storage()), -1)
        if m and 0 <= row < n:
            out[row] = int(m.group(1))
    return out


def _owners(derived: dict[int, int], param: np.ndarray) -> np.ndarray:
    """Per row, the parameter an optimizer-step temporary was computed for: the `param` of the
    row it derives from (`_note_sources`), followed back through other temporaries; -1 else."""
    owner = np.full(len(param), -1, np.int64)
    for row in derived:
        src, seen = row, 0
        while src in derived and param[src] < 0 and seen < 64:
            src, seen = derived[src], seen + 1
        if param[src] >= 0 and param[row] < 0:
            owner[row] = param[src]
    return owner


def _classify(model, opt, rec: _Recorder, n: int, params: ParamTable, param_rows, grads):
    """Kind, ready event and parameter index of each of the `n` rows: PARAM for parameter
    storages, GRAD for the storage each .grad had when its post-accumulate hook ran, OPTIM for
    optimizer.state tensors, BUFFER for module buffers; ACT for the rest."""
    import torch

    kind = np.full(n, Kind.ACT, np.int8)
    ready, param = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
    index_of: dict[int, int] = {}
    for i, (_, p) in enumerate(model.named_parameters(remove_duplicate=False)):
        index_of.setdefault(id(p), i)
        if params.tied_to[i] < 0:
            kind[param_rows[i]], param[param_rows[i]] = Kind.PARAM, i
    for pid, (event, row) in grads.items():
        kind[row], ready[row], param[row] = Kind.GRAD, event, index_of[pid]
    for p, state in (opt.state.items() if opt is not None else ()):
        for t in state.values():
            if isinstance(t, torch.Tensor):
                row = rec.row(t, create=False)
                kind[row], param[row] = Kind.OPTIM, index_of[id(p)]
    for b in model.buffers():
        kind[rec.row(b, create=False)] = Kind.BUFFER
    return kind, ready, param


# ----------------------------------------------------------------------------- micro-batch

EXTRAPOLATION_DEPTHS = (2, 3)  # see trace_set
BATCH_BASIS = (2, 3)  # micro-batch 1 takes other paths (views instead of copies) than 2 and up


def at_micro_batch(ta: StepTrace, tb: StepTrace, micro_batch_size: int) -> StepTrace:
    """The trace at `micro_batch_size` from the traces `ta`, `tb` at two consecutive micro-batch
    sizes m, m+1 of the same step (`BATCH_BASIS`).

    Valid when both traces have the same events (same rows allocated and freed in the same order),
    i.e. no op takes a batch-size-dependent path; then every storage's size is affine in the batch
    size (activations, logits and inputs grow with it, parameters and optimizer state do not), and
    so is the live curve, event by event. Raises ValueError otherwise."""
    same = (ta.num_events == tb.num_events and ta.phases == tb.phases
            and ta.layer_bounds == tb.layer_bounds
            and len(ta.nbytes) == len(tb.nbytes) and all(
                np.array_equal(getattr(ta, f), getattr(tb, f))
                for f in ("alloc", "free", "kind", "ready", "param", "itemsize", "op_class", "owner",
                          "buffer_layer")))
    if not same or tb.micro_batch_size != ta.micro_batch_size + 1:
        raise ValueError("the two traces differ in their events or are not at m and m+1")
    k = micro_batch_size - ta.micro_batch_size
    flops = {f: ta.flops[f] + k * (tb.flops[f] - ta.flops[f]) for f in ta.flops}
    return dataclasses.replace(ta, micro_batch_size=micro_batch_size, flops=flops,
                               nbytes=ta.nbytes + k * (tb.nbytes - ta.nbytes))


# ----------------------------------------------------------------------------- cache

_FORMAT_VERSION = 15  # the tracer's version: bump when the trace's content or file layout changes
_MEMO: dict[str, StepTrace] = {}
_ROW_FIELDS = ("nbytes", "alloc", "free", "kind", "ready", "param", "itemsize", "op_class", "owner",
               "buffer_layer")
_PARAM_FIELDS = ("numel", "element_size", "trainable", "role", "layer", "tied_to")


_KEY_HASHES: dict[TraceKey, str] = {}


def cache_key(key: TraceKey) -> str:
    """Hash of the key and of what shapes the trace: torch and transformers versions (read from
    the installed distributions, so a cached plan never imports either), peft's for a LoRA key
    (its layers run in the trace), and the tracer's own version (`_FORMAT_VERSION`)."""
    h = _KEY_HASHES.get(key)
    if h is None:
        h = _KEY_HASHES[key] = _cache_key(key)
    return h


def _cache_key(key: TraceKey) -> str:
    fields = dataclasses.asdict(key)
    for name in ("kbit_upcast", "gptq_group_size", "lora_dora", "lora_modules_to_save", "lora_train_base",
                 "zero3_linear", "transformers4", "flat_param_grads", "keep_outputs",
                 "use_cache", "rotary_cache", "bnb_keeps_input", "fused_dropout", "cuda_autocast",
                 "cuda_sdpa_math"):
        # unset: the key hashes as before the field existed
        if not fields.get(name):
            fields.pop(name, None)
    for name, default in (("checkpoint_policy", "full"), ("kernels", "torch"), ("loss", "model")):
        if fields.get(name) == default:  # the default hashes as before the field existed
            del fields[name]
    if fields.get("tp_size") == 1:  # keys without tensor parallelism hash as before tp_size existed
        del fields["tp_size"]
    else:  # the shard layout (vocabulary padding multiple, `tp_padded_vocab`) is part of the trace
        fields["tp_layout"] = 4
    if key.keep_outputs:  # the kept outputs as `_loss` keeps them, the cache only with use_cache
        fields["kept_outputs_layout"] = 2
    if key.fused_dropout:  # 2: SDPA's dropout_p as CUDA's fused attention kernels run it
        fields["fused_dropout_layout"] = 2
    versions = [installed_version("torch"), installed_version("transformers")]
    if key.trainable == "lora":
        fields["peft_version"] = installed_version("peft")
    blob = json.dumps([fields, *versions, _FORMAT_VERSION], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _save(trace: StepTrace, path: Path) -> None:
    meta = {"num_layers": trace.num_layers, "micro_batch_size": trace.micro_batch_size,
            "seq_len": trace.seq_len, "num_events": trace.num_events, "phases": trace.phases,
            "flops": trace.flops, "names": trace.params.names, "layer_bounds": trace.layer_bounds,
            "shapes": [list(s) for s in trace.params.shapes]}
    arrays = {f: getattr(trace, f) for f in _ROW_FIELDS}
    arrays.update({"p_" + f: getattr(trace.params, f) for f in _PARAM_FIELDS})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        np.savez(fh, meta=np.array(json.dumps(meta)), **arrays)
    os.replace(tmp, path)


def _load(path: Path) -> StepTrace:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        params = ParamTable(tuple(meta["names"]), **{f: z["p_" + f] for f in _PARAM_FIELDS},
                            shapes=tuple(tuple(s) for s in meta.get("shapes", ())))
        rows = {f: z[f] for f in _ROW_FIELDS}
    phases = {k: tuple(v) for k, v in meta["phases"].items()}
    return StepTrace(num_layers=meta["num_layers"], micro_batch_size=meta["micro_batch_size"],
                     seq_len=meta["seq_len"], params=params, num_events=meta["num_events"],
                     phases=phases, flops=meta["flops"], **rows,
                     layer_bounds={k: tuple(v) for k, v in meta["layer_bounds"].items()})


def cached_trace(key: TraceKey, cache_dir: Optional[Path] = None) -> StepTrace:
    """`trace_step(key)`, memoized in-process and on disk under `cache_dir` (default
    $XDG_CACHE_HOME/launcher/traces, ~/.cache/launcher/traces without it). An unreadable cache file is traced again and rewritten."""
    h = cache_key(key)
    if h in _MEMO:
        return _MEMO[h]
    path = _cache_path(h, cache_dir)
    trace = None
    if path.exists():
        try:
            trace = _load(path)
        except Exception:  # a torn or foreign file: trace again
            trace = None
    if trace is None:
        trace = trace_step(key)
        _save(trace, path)
        _HELPER.start()  # torch and the model's code are imported now: a fork shares them
    _MEMO[h] = trace
    return trace


def _cache_path(h: str, cache_dir) -> Path:
    return Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / f"{h}.npz"


class _Helper:
    """A second process that traces, from the end of a list, the steps a plan is going to need
    while this process traces them from its start (`prefetch`); each writes what it traces to the
    disk cache (atomically, `_save`), and each takes from the cache what the other has written.
    A step both trace is traced twice, with the same result; a step the helper cannot trace is
    traced here. The helper is forked after this process's first trace, so it starts with torch,
    transformers and the model's code imported; it is ended when the plan is (`stop`)."""

    def __init__(self):
        self.pending: list[tuple[TraceKey, Path]] = []
        self.pid: Optional[int] = None
        self.dir: Optional[Path] = None

    def start(self) -> None:
        todo = [(k, p) for k, p in self.pending if not p.exists()]
        self.pending = []
        if self.pid is not None or len(todo) < 2 or not hasattr(os, "fork"):
            return
        import sys

        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid:
            self.pid, self.dir = pid, todo[0][1].parent
            return
        try:  # the helper: never returns into the caller's code
            for key, path in reversed(todo):
                if not path.exists():
                    try:
                        _save(trace_step(key), path)
                    except Exception:  # noqa: BLE001 - the planner traces it and reports the error
                        pass
        finally:
            os._exit(0)

    def stop(self) -> None:
        import signal

        pid, self.pid, self.pending = self.pid, None, []
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        for tmp in self.dir.glob(f".*.{pid}.tmp") if self.dir else ():  # a file it was writing
            tmp.unlink(missing_ok=True)


_HELPER = _Helper()


def prefetch(keys, num_layers: int, cache_dir: Optional[Path] = None) -> None:
    """Let a helper process trace the steps of these `TraceKey`s (as `trace_set` asks for them at
    `num_layers`) that are not cached yet, in parallel with this process, once this process has
    traced its first step (`_Helper`); on a machine with one CPU, nothing."""
    if (os.cpu_count() or 1) < 2:
        return
    seen, todo = set(), []
    for key in keys:
        for k in step_keys(key, num_layers):
            h = cache_key(k)
            if h not in seen and h not in _MEMO:
                seen.add(h)
                todo.append((k, _cache_path(h, cache_dir)))
    _HELPER.pending = todo


def stop_prefetch() -> None:
    """End the helper process (`prefetch`), if any."""
    _HELPER.stop()


def trace_set(key: TraceKey, num_layers: Optional[int] = None, cache_dir: Optional[Path] = None,
              scale_batch: bool = True) -> TraceSet:
    """Traces of `key` at two consecutive depths (its own `num_layers` is ignored), to extrapolate
    to `num_layers` (default: the config's depth): depths 2 and 3, or 1 and 2 for shallower
    models. At depth 1 the only layer is also the first, whose forward has no previous layer's
    outputs alive (bloom with gradient checkpointing keeps the previous layer's attention
    probabilities until the next layer returns), so depth 1 and 2 do not differ by one layer.
    With `scale_batch`, a micro-batch above 3 is rebuilt from traces at micro-batch 2 and 3
    (`at_micro_batch`), so a search over micro-batch sizes costs at most six traces."""
    if num_layers is None:
        num_layers = config_num_layers(key.hf_config_json)
    depths = EXTRAPOLATION_DEPTHS if num_layers >= EXTRAPOLATION_DEPTHS[1] else (1, 2)
    return TraceSet(*(_trace_at(key, d, cache_dir, scale_batch) for d in depths), num_layers)


def step_keys(key: TraceKey, num_layers: int, scale_batch: bool = True) -> list[TraceKey]:
    """The keys of the steps `trace_set(key, num_layers)` traces (`_trace_at`)."""
    depths = EXTRAPOLATION_DEPTHS if num_layers >= EXTRAPOLATION_DEPTHS[1] else (1, 2)
    out = []
    for d in depths:
        k = dataclasses.replace(key, num_layers=d)
        b = k.micro_batch_size
        out += ([dataclasses.replace(k, micro_batch_size=m) for m in BATCH_BASIS]
                if scale_batch and b > BATCH_BASIS[1] else [k])
    return out


def config_num_layers(hf_config_json: str) -> int:
    """`num_hidden_layers` of a config.json (through the config class's attribute_map)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**json.loads(hf_config_json)).num_hidden_layers


def _trace_at(key: TraceKey, depth: int, cache_dir, scale_batch: bool) -> StepTrace:
    key = dataclasses.replace(key, num_layers=depth)
    b = key.micro_batch_size
    if scale_batch and b > BATCH_BASIS[1]:
        ta, tb = (cached_trace(dataclasses.replace(key, micro_batch_size=m), cache_dir)
                  for m in BATCH_BASIS)
        try:
            return at_micro_batch(ta, tb, b)
        except ValueError:
            pass
    return cached_trace(key, cache_dir)

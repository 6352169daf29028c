"""Where `from_pretrained(device_map="auto" | "balanced" | "balanced_low_0" | "sequential")` puts a
model's weights: whole decoder layers filled onto the GPUs in order, the rest offloaded to the CPU
(then the disk), and which GPU runs each offloaded layer.

The device map is transformers' own: `transformers.integrations.accelerate._get_device_map`, the
function `from_pretrained` calls, on the model built on the meta device. A plan has no GPU to ask,
so `max_memory` is what `get_max_memory` would read on the planned GPUs: each GPU's free memory
after CUDA initialisation (accelerate/utils/modeling.py get_max_memory: torch.cuda.mem_get_info),
i.e. its capacity minus the CUDA context, unless the user caps it (`inference.max_memory_gib`); the
CPU gets 90% of the host memory when the user sets no limit (transformers' get_max_memory: "we don't
want to set extremely tight bound and pressure for cpu"). transformers' balancing rules then apply
as in a real load: "auto" and "balanced" spread the layers evenly when they fit, and every mode
keeps room for the largest layer on GPU 0 once anything is offloaded (infer_auto_device_map).

At run time (accelerate/big_modeling.py dispatch_model) the offloaded modules execute on the first
GPU of the map ("main_device"): `attach_align_device_hook` hooks every offloaded submodule that
holds tensors directly, copies its weights to that GPU before its forward and drops them after
(accelerate/hooks.py AlignDevicesHook.pre_forward/post_forward). So the first GPU also holds, one at
a time, the largest offloaded submodule's weights, and the KV cache and activations of every
offloaded layer.

A bitsandbytes load (`quantization_config=BitsAndBytesConfig(...)`) is placed as transformers
places it: on the model its quantizer has converted (`bnb_quantizer`), which sizes the converted
weights and keeps 10% of each device back; transformers refuses such a map if it offloads.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

CPU_SHARE_UNSET = 0.9  # transformers/integrations/accelerate.py get_max_memory: cpu *= 0.90 when max_memory is unset


@dataclass(frozen=True)
class Placement:
    """The device map, summed per device. GPUs are 0..n-1; "cpu" and "disk" hold offloaded weights."""

    weight_bytes: dict  # device -> bytes of the weights and buffers placed there
    layers: dict  # device -> decoder layers placed there
    main_gpu: int  # where offloaded modules execute
    offload_transient_bytes: int  # largest offloaded submodule's own tensors, copied to the main GPU for its forward
    head_gpu: int  # the GPU that computes the logits
    max_memory: dict  # what the map was computed with, per device

    def layers_run(self, gpu: int) -> int:
        """Decoder layers whose forward runs on `gpu`: its own, and on the main GPU the offloaded ones."""
        offloaded = self.layers.get("cpu", 0) + self.layers.get("disk", 0)
        return self.layers.get(gpu, 0) + (offloaded if gpu == self.main_gpu else 0)


def max_memory(gpu_count: int, gpu_free_bytes: int, host_bytes: int, cap_bytes: int | None) -> dict:
    """`max_memory` as a load on `gpu_count` planned GPUs would get it (see the module docstring)."""
    per_gpu = gpu_free_bytes if cap_bytes is None else min(cap_bytes, gpu_free_bytes)
    return {**{i: int(per_gpu) for i in range(gpu_count)}, "cpu": int(host_bytes * CPU_SHARE_UNSET)}


def bnb_quantizer(model, precision: str, double_quant: bool):
    """Turn `model` (meta device, 16-bit) into what `from_pretrained(quantization_config=
    BitsAndBytesConfig(...))` loads before placing it: transformers' own bitsandbytes quantizer
    replaces the Linear layers it converts with bitsandbytes' Linear4bit / Linear8bitLt
    (quantizers/quantizer_bnb_4bit.py, _8bit.py `_process_model_before_weight_loading`). Returns the
    quantizer, which sizes the converted weights for the device map (`param_element_size`) and
    keeps 10% of each device for quantization buffers (`adjust_max_memory`)."""
    import torch
    from transformers import BitsAndBytesConfig
    from transformers.quantizers import AutoHfQuantizer

    if precision == "int8":
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=precision,
                                    bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.bfloat16)
    quantizer = AutoHfQuantizer.from_config(config)
    quantizer.preprocess_model(model, dtype=torch.bfloat16, device_map="auto",
                               keep_in_fp32_modules=getattr(model, "_keep_in_fp32_modules", None) or [])
    return quantizer


def place(model, mode: str, memory: dict, quantizer=None, tensor_bytes=None) -> Placement:
    """The device map of `model` (built on the meta device in its load dtype, converted by
    `bnb_quantizer` when quantized) under `mode` (from_pretrained's device_map string: config.py
    DeviceMap) and `memory` (`max_memory`), summed per device.
    `tensor_bytes(module, tensor)`: the bytes one parameter or buffer holds on the device (default
    numel x element size; the quantized layouts are the caller's)."""
    from transformers.integrations.accelerate import _get_device_map

    quiet = logging.getLogger("accelerate.utils.modeling")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "Device 0 is not available": there is no GPU to plan on
    try:
        device_map = _get_device_map(model, mode, dict(memory), quantizer)
    finally:
        quiet.setLevel(level)
    nbytes = tensor_bytes or (lambda module, t: t.numel() * t.element_size())

    def device_of(name: str):
        while name not in device_map and name:
            name = name.rpartition(".")[0]
        return device_map.get(name, device_map.get(""))

    weights: dict = {}
    gpus = [d for d in device_map.values() if d not in ("cpu", "disk")]
    main = gpus[0] if gpus else 0
    layers: dict = {}
    blocks = set(model._no_split_modules or ())
    transient, seen = 0, set()
    for name, module in model.named_modules():
        own = 0
        for pname, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if id(t) in seen:  # a tied weight is held once
                continue
            seen.add(id(t))
            device, held = device_of(f"{name}.{pname}" if name else pname), nbytes(module, t)
            weights[device] = weights.get(device, 0) + held
            own += held
        device = device_of(name)
        if type(module).__name__ in blocks:
            layers[device] = layers.get(device, 0) + 1
        if device in ("cpu", "disk"):
            transient = max(transient, own)
    head = model.get_output_embeddings()
    head_name = next(n for n, m in model.named_modules() if m is head)
    head_device = device_of(head_name)
    return Placement(weight_bytes=weights, layers=layers, main_gpu=main, offload_transient_bytes=transient,
                     head_gpu=main if head_device in ("cpu", "disk") else head_device,
                     max_memory=dict(memory))

"""Paged bitsandbytes optimizers: their large states live in CUDA unified memory, outside torch's
caching allocator, so a GPU plan keeps them off the device peak and in the host-RAM need."""
from __future__ import annotations

import warnings

import pytest
import torch

from launcher import planner
from launcher.app import model_spec
from launcher.cli import compose
from launcher.hardware import cluster_from

bnb = pytest.importorskip("bitsandbytes")


def _plan(optimizer: str, cache: str, hardware: str = "a100-80g"):
    config = compose([cache, "model=small-llama", f"hardware={hardware}", "gpus=1", "strategy=single",
                      "training.precision=bf16-true", "training.seq_len=64", "training.micro_batch_size=1",
                      f"training.optimizer={optimizer}"])
    spec = model_spec(config)
    plan = planner.plan(config, spec, cluster_from(config.hardware, config.gpus, config.nodes))
    return plan.candidates[0].memory, spec


def _real_paged_state_bytes(spec) -> int:
    """The states a real PagedAdamW32bit step makes for the bf16 model's parameters of 1e5 elements
    or more (bitsandbytes' paging threshold), counted on a real CPU model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in spec.hf_config.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.hf_config["model_type"], **fields),
                                             dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on CPU the paged buffers fall back to ordinary memory
        opt = bnb.optim.PagedAdamW32bit(model.parameters(), lr=1e-3)
        ids = torch.randint(0, spec.hf_config["vocab_size"], (1, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return sum(t.untyped_storage().nbytes() for p, s in opt.state.items() if p.numel() >= 100_000
               for t in s.values() if torch.is_tensor(t))


def test_paged_states_are_off_the_device_peak_and_in_host_memory(trace_cache):
    paged, spec = _plan("paged_adamw_32bit", trace_cache)
    torch_adamw, _ = _plan("adamw_torch", trace_cache)  # bf16 states traced on the device
    real = _real_paged_state_bytes(spec)
    assert real > 0 and paged.host_bytes == real
    # the paged fp32 states (8 B per parameter) are not in torch's counters; torch's bf16 AdamW
    # keeps 4 B per parameter on the device, all of it
    assert paged.peak_allocated_bytes < torch_adamw.peak_allocated_bytes - real // 2


def test_a_traced_optimizer_is_not_modelled_again(trace_cache):
    """transformers' Adafactor is stepped by the tracer: the plan's optimizer states are the traced
    ones, equal to a real step's state bytes, with no modelled copy beside them (CPU processes: no
    allocator rounding)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.optimization import Adafactor

    memory, spec = _plan("adafactor", trace_cache, hardware="cpu")
    fields = {k: v for k, v in spec.hf_config.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.hf_config["model_type"], **fields),
                                             dtype=torch.bfloat16)
    opt = Adafactor(model.parameters(), lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False)
    ids = torch.randint(0, spec.hf_config["vocab_size"], (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    real = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    assert memory.breakdown["optimizer_states"] == real

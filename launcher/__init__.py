"""Plans, configures and launches LLM fine-tuning (README.md).

Two third-party notices that say nothing about a plan or a run are silenced here, before those
libraries are imported by the planner, the tracer or the worker:
- bitsandbytes' CPU backend (bitsandbytes/backends/cpu/ops.py) logs on every import, on a CPU
  with AVX-512 BF16, that the optional `kernels` package for its CPU 4-bit GEMM is missing;
- peft (peft_model.py) reads transformers' deprecated `is_gradient_checkpointing`, a FutureWarning
  per model built.
"""
import logging
import warnings

logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)

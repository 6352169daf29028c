"""Plans, configures and launches LLM fine-tuning (README.md).

Third-party notices that say nothing about a plan or a run are silenced here, before those
libraries are imported by the planner, the tracer or the worker:
- bitsandbytes' CPU backend (bitsandbytes/backends/cpu/ops.py) logs on every import, on a CPU
  with AVX-512 BF16, that the optional `kernels` package for its CPU 4-bit GEMM is missing;
- peft (peft_model.py) reads transformers' deprecated `is_gradient_checkpointing`, a FutureWarning
  per model built;
- transformers (modeling_utils.py `PreTrainedModel.loss_function`) names the loss type from the
  model's class name, finds none in GPT-2's `GPT2LMHeadModel`, and says it uses the default
  `ForCausalLMLoss`, the causal-LM loss the plan traces and the run trains with (a loss type a
  config names but transformers does not know still shows);
- transformers (models/gemma/configuration_gemma.py) notes that the official Gemma config.json's
  `hidden_act="gelu"` is read as the tanh approximation it always meant, as the catalogue's copy
  of that file (conf/model/gemma-2b.yaml) is;
- peft (tuners/lora/layer.py) notes that it sets `fan_in_fan_out` for GPT-2's `Conv1D` projections,
  whose weights are stored transposed: the adapters it builds are the ones planned and trained;
- ColossalAI 0.5.0, in each worker rank: colossalai/utils/safetensors.py asks on import for
  TensorNVMe, used only by asynchronous checkpoint saves (the worker saves synchronously);
  shardformer/layer/normalization.py asks for apex per fused norm it cannot build (apex's fused
  RMSNorm is a CUDA kernel); pipeline/p2p.py calls torch's deprecated `isinstance(treespec,
  LeafSpec)` per message it unpickles.
"""
import logging
import warnings

logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
logging.getLogger("transformers.modeling_utils").addFilter(
    lambda record: not str(record.msg).startswith("`loss_type=None` was set in the config but it is unrecognized"))
logging.getLogger("transformers.models.gemma.configuration_gemma").addFilter(
    lambda record: not str(record.msg).startswith('We found `hidden_act="gelu"` in this Gemma config'))
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False but the target module is `Conv1D`",
                        category=UserWarning)
warnings.filterwarnings("ignore", message="Please install the latest tensornvme", category=UserWarning)
warnings.filterwarnings("ignore", message="Please install apex from source", category=UserWarning)
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)

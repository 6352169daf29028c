"""Typed schemas for every configuration group. Values live in `conf/`; documentation of each
field lives here, under the field. No DictConfig travels past `app.main`: it converts the composed
config with `OmegaConf.to_object` into `LauncherConfig` and everything downstream is plain data.

Closed sets are Enums (OmegaConf matches members by *name*, so the member names are the exact
strings a user types, e.g. `training.precision=bf16-mixed`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

MISSING = "???"  # OmegaConf's marker of a value that must be given (omegaconf.MISSING)


def _enum(name: str, members: list[str], doc: str) -> type[Enum]:
    e = Enum(name, {m: m for m in members})  # type: ignore[misc]
    e.__doc__ = doc
    return e


Precision = _enum(
    "Precision",
    ["32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true"],
    "Lightning's precision names. '*-mixed': fp32 weights, 16-bit compute (torch autocast for "
    "torch backends; for DeepSpeed/ColossalAI the framework's 16-bit model + fp32 master copy). "
    "'*-true': every tensor in that dtype.",
)
Optimizer = _enum(
    "Optimizer",
    ["adamw_torch", "adamw_torch_fused", "adamw_torch_foreach", "sgd", "adamw_bnb_8bit",
     "paged_adamw_8bit", "paged_adamw_32bit", "adafactor"],
    "HF TrainingArguments `optim` names. adamw_torch = torch.optim.AdamW with its default "
    "implementation (foreach on this torch when all tensors are on one device); "
    "adamw_torch_fused = fused=True; adamw_torch_foreach = foreach=True; sgd = torch.optim.SGD "
    "(momentum training.sgd_momentum); adamw_bnb_8bit = bitsandbytes.optim.AdamW8bit (8-bit blockwise states); "
    "paged_adamw_8bit = bitsandbytes.optim.PagedAdamW8bit (same, states in CUDA unified memory); "
    "paged_adamw_32bit = bitsandbytes.optim.PagedAdamW32bit (fp32 states in CUDA unified memory); "
    "adafactor = transformers.optimization.Adafactor (factored second moment, no first moment).",
)
Attention = _enum(
    "Attention", ["eager", "sdpa", "flash_attention_2"], "transformers' attn_implementation."
)
CausalLmLoss = _enum("CausalLmLoss", ["model", "fp32_shift_copy", "shift_copy"],
                     "model: the installed transformers' causal-LM loss; fp32_shift_copy: transformers "
                     "4.37-4.45's (fp32 logits returned by the model and a shifted contiguous copy); "
                     "shift_copy: the same on the logits in the model's own dtype, no upcast (GPT-2, OPT "
                     "and BLOOM forwards of transformers 4.2x-4.3x, Qwen (v1)'s remote code).")
CheckpointPolicy = _enum(
    "CheckpointPolicy", ["full", "reentrant", "selective_op"],
    "What a checkpointed decoder layer keeps (launcher/checkpointing.py): full = only its inputs, "
    "everything recomputed in backward; reentrant = the same with torch's reentrant checkpoint "
    "(use_reentrant=True: transformers 4's default); selective_op = torchtitan's per-op selective checkpointing "
    "(the outputs of matmuls and attention saved, except every second matmul of the layer).")
StrategyName = _enum(
    "StrategyName",
    ["auto", "single", "ddp", "zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload",
     "cai_ddp", "cai_zero1", "cai_zero2", "cai_gemini", "cai_tp", "cai_pp",
     "fsdp2", "fsdp2_grad_op", "fsdp2_offload", "fsdp2_tp", "fsdp1", "fsdp1_grad_op"],
    "auto = plan every candidate. single = one process, the model not wrapped by any data-parallel "
    "framework (what HF Trainer and torchtune run on one GPU; gpus=1 only). ddp = torch "
    "DistributedDataParallel. zero0..zero3 = DeepSpeed "
    "ZeRO stage 0..3; *_offload = ZeRO-Offload of optimizer states (and for stage 3 "
    "parameters) to host memory. cai_* = ColossalAI plugins (optional install, see README "
    "'ColossalAI'): cai_ddp TorchDDPPlugin, cai_zero1/cai_zero2 LowLevelZeroPlugin stage 1/2, "
    "cai_gemini GeminiPlugin (chunk-based ZeRO-3), cai_tp HybridParallelPlugin with 1D tensor "
    "parallelism (colossalai.tp_size, null = every valid size), cai_pp HybridParallelPlugin with "
    "1F1B pipeline parallelism (colossalai.pp_size). fsdp2* = PyTorch FSDP2 (fully_shard per "
    "decoder block and root): fsdp2 reshard_after_forward=True (ZeRO-3-like), fsdp2_grad_op False "
    "(ZeRO-2-like), fsdp2_offload CPUOffloadPolicy, fsdp2_tp FSDP x torch tensor parallelism on a "
    "2D DeviceMesh (fsdp2.tp_size). fsdp1* = PyTorch FSDP1 (FullyShardedDataParallel, one flat "
    "parameter per decoder block and root; what Accelerate's fsdp_version 1 and HF Trainer's --fsdp run), "
    "planned by name only: fsdp1 FULL_SHARD, fsdp1_grad_op SHARD_GRAD_OP.",
)
Mode = _enum(
    "Mode",
    ["auto", "plan", "run", "measure", "calibrate", "infer_plan"],
    "auto = run when local GPUs are found, else plan. plan = estimate and write the run "
    "directory without training. run = plan then start torchrun. measure = run a few steps and "
    "report measured peak memory next to the estimate. calibrate = measure this machine "
    "(matmul throughput, collective bandwidth, per-op overhead) and write a hardware profile. "
    "infer_plan = per-GPU serving memory (weights, KV cache, activations; section `inference`).",
)
Report = _enum("Report", ["table", "json", "wide"],
               "How the plan is printed on stdout: table = one row per strategy in 120 columns; "
               "json = plan.json; wide = every column and the full verdicts.")
LaunchKind = _enum(
    "LaunchKind", ["torchrun", "slurm", "sbatch_script"],
    "torchrun = run here (launcher/launch.py). slurm = submit a Slurm job with submitit: one task "
    "per node, each running torchrun against a c10d rendezvous on the first node "
    "(launcher/slurm.py). sbatch_script = write RUN_DIR/sbatch.sh for submission by hand.")
Init = _enum(
    "Init",
    ["random", "pretrained"],
    "random = weights initialised from the config (tests, demos, memory measurement); "
    "pretrained = load weights from model.pretrained_path or the local HF cache.",
)


@dataclass
class ModelConfig:
    """A decoder LLM architecture, as the values of its Hugging Face `config.json`."""

    name: str = MISSING
    """Catalogue name (the file name under conf/model/), or 'custom'."""
    source: str = ""
    """Where the config.json values come from (URL of the model card's config.json)."""
    hf_config: Dict[str, Any] = field(default_factory=dict)
    """The config.json values; `model_type` selects the transformers architecture."""
    config_path: Optional[str] = None
    """Path to a config.json (or a directory holding one); with model=custom this replaces hf_config."""
    pretrained_path: Optional[str] = None
    """Local directory with weights and tokenizer for init=pretrained (never downloaded)."""
    tokenizer_path: Optional[str] = None
    """Local tokenizer directory. null = pretrained_path, else the project's byte-level tokenizer."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the model directory. Only honoured from the command line."""


@dataclass
class HardwareConfig:
    """One accelerator type. Every number is per device and cites its source in the YAML."""

    name: str = MISSING
    source: str = ""
    """Datasheet(s) the numbers come from."""
    calibrated_on: str = ""
    """CPU model of the machine mode=calibrate measured (/proc/cpuinfo 'model name'); a CPU profile
    used on a machine with another CPU model gets a note that its speed numbers are that machine's."""
    device: str = "cuda"
    """'cuda' for GPUs; 'cpu' for CPU processes (no CUDA runtime terms, gloo)."""
    memory_bytes: int = MISSING
    """Usable device memory as the driver reports it (nvidia-smi total)."""
    host_memory_bytes: int = 256 * 2**30
    """Host RAM per node available for offload."""
    peak_tflops: Dict[str, float] = field(default_factory=dict)
    """Dense peak TFLOP/s by compute dtype: keys fp32, tf32, fp16, bf16 (no sparsity)."""
    attention_tflops: Dict[str, float] = field(default_factory=dict)
    """Sustained TFLOP/s of the fused attention kernel (scaled_dot_product_attention, forward and
    backward) by compute dtype; absent = peak_tflops x matmul_efficiency. On CPU measured by
    mode=calibrate: torch's CPU flash-attention kernel runs far below the matmul peak, in bf16 most
    of all."""
    matmul_efficiency: float = 0.5
    """Fraction of peak a transformer training step achieves in matmuls (model FLOPs utilisation)."""
    memory_bandwidth_gbps: float = MISSING
    """HBM bandwidth, GB/s."""
    intra_node_bandwidth_gbps: float = MISSING
    """Achievable per-GPU bus bandwidth for collectives inside a node (NVLink / PCIe), GB/s."""
    inter_node_bandwidth_gbps: float = 25.0
    """Achievable per-node network bandwidth (InfiniBand / Ethernet), GB/s."""
    host_link_bandwidth_gbps: float = 25.0
    """Host <-> device copy bandwidth (PCIe), GB/s, for offload."""
    sm_arch: int = 80
    """CUDA compute capability x10 (70 V100, 80 A100, 89 Ada, 90 Hopper); selects cuBLAS workspace."""
    cuda_context_bytes: int = 768 * 2**20
    """CUDA context + loaded kernels after the first training step (outside the allocator)."""
    nvls: bool = False
    """NVLink SHARP: the GPUs of a node share an NVSwitch that reduces in the fabric (H100/H200 SXM
    in HGX/DGX systems). NCCL then backs multicast buffers with device memory for each communicator
    of more than two GPUs of a node (launcher/memory/runtime.py `nvls_bytes`)."""
    nccl_version: Optional[str] = None
    """The NCCL of the job's torch (`torch.cuda.nccl.version()`), as 'major.minor.patch'. NCCL's
    buffers per communicator depend on it (launcher/memory/runtime.py `nccl_bytes`: a p2p pool at
    init from 2.12 until 2.22's lazy connections, 2 MiB cuMem allocations from 2.19) and so do the
    NVLS buffers (`nvls_bytes`: 1.5 GiB per communicator of 8 GPUs up to 2.20, 256 MiB from 2.26).
    null = the nvidia-nccl-cu12/cu13 package installed here, which torch's CUDA wheels depend on
    and the job (started from this environment) loads; without one, 2.27 (the series of recent
    torch wheels, an assumption)."""
    nccl_channels: int = 24
    """NCCL's collective channels between the GPUs of a node (the 'N coll channels' of its
    NCCL_DEBUG=INFO log); each holds about 12 MiB of buffers per connection pair (`nccl_bytes`).
    NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS in the environment the job inherits clamp it, and
    NCCL_BUFFSIZE, NCCL_CUMEM_ENABLE, NCCL_RUNTIME_CONNECT, NCCL_NVLS_ENABLE, NCCL_P2P_DISABLE and
    NCCL_P2P_LEVEL there change the buffers as NCCL would (`runtime.py nccl_env`)."""
    nccl_transport: str = "nvlink"
    """How NCCL links the GPUs of a node: 'nvlink' (peer-to-peer over NVLink or NVSwitch), 'pcie'
    (peer-to-peer over PCIe) or 'shm' (no peer-to-peer, as on GeForce cards: buffers in host shared
    memory, none on the GPU)."""
    op_overhead_s: float = 5.0e-6
    """Host time to dispatch one tensor op (Python, dispatcher, allocation, kernel launch), s.
    CPU: measured by mode=calibrate (a chain of tiny ops); it adds to compute time. GPU: launches
    are asynchronous, so it only matters when it exceeds the GPU's work (launcher/speed.py).
    The 5 us default is an assumption for eager PyTorch on a GPU: a kernel launch costs a few
    microseconds of CPU time, which is why small kernels are launch-bound
    (https://pytorch.org/blog/accelerating-pytorch-with-cuda-graphs/)."""
    elementwise_gelems_per_s: Optional[float] = None
    """Elements per second (1e9/s) of fresh outputs that elementwise ops produce on CPU processes
    (allocation, first touch, read of the inputs, write), whatever the dtype: ATen's CPU kernels
    compute 16-bit elementwise ops in fp32 (launcher/host_time.py, term 2). Measured by
    mode=calibrate; null = memory_bandwidth_gbps / 12 (fp32: read two inputs, write one output)."""
    all_gather_bandwidth_gbps: Optional[float] = None
    """Bus bandwidth of all-gather when it differs from the all-reduce's (gloo's all-gather is
    several times slower), GB/s; null = intra_node_bandwidth_gbps. Measured by mode=calibrate."""
    collective_gbps: Dict[str, Dict[float, float]] = field(default_factory=dict)
    """Measured bus bandwidth (GB/s) per collective and dtype (`all_reduce_*`, `all_gather_*`,
    `reduce_scatter_*` for fp32 and bf16) by message size in MiB, the per-call latency taken out.
    The CPU host terms cost each call at its message size's bandwidth (interpolated in log size)
    plus `collective_latency_s` (gloo sums 16-bit tensors slower than fp32, and moves messages of a
    few hundred KB slower per byte than large ones); absent = intra_node_bandwidth_gbps /
    all_gather_bandwidth_gbps. Measured by mode=calibrate."""
    collective_latency_s: float = 2.0e-5
    """Fixed time of one collective call (a 4-byte all-reduce), s. CPU gloo: measured by
    mode=calibrate; GPU NCCL: ~20 us intra-node small-message latency (nccl-tests, assumption)."""
    framework_overhead_s: Dict[str, List[float]] = field(default_factory=dict)
    """Per strategy, [seconds per optimizer step, seconds per parameter tensor per micro-batch]
    that the framework's own step costs beyond the speed model's terms (engine bookkeeping,
    per-parameter hooks, the worker's loop). Measured by `mode=calibrate
    calibrate.frameworks=[...]` (launcher/calibrate_frameworks.py); absent = 0."""


@dataclass
class TrainingConfig:
    """What is trained and how; every field that changes memory is used by the estimator."""

    seq_len: int = 1024
    """Tokens per example (padded/packed to this length); with a length_profile, the cap at which
    examples are cut."""
    length_profile: Optional[str] = None
    """Examples of varying length, each micro-batch padded to its longest example (no packing):
    their length distribution, a file of launcher/data/lengths/ by name (alpaca) or a path to a
    .json {"cdf": [[tokens, fraction of examples with at most that many], ...]} or a .txt of token
    counts, one per line (launcher/lengths.py). The peak batch is then the shorter of seq_len and
    the longest example, and on a GPU peak reserved comes from replaying length_replay_batches
    micro-batches of sampled lengths through the allocator simulator, whose cache grows with the
    lengths seen. null = every micro-batch holds seq_len tokens (packed, or padded to seq_len).
    Planning only: the worker trains packed seq_len blocks of its dataset."""
    length_multiple_of: int = 1
    """With a length_profile: each micro-batch padded up to a multiple of this many tokens before the
    seq_len cut (transformers' DataCollatorWithPadding / DataCollatorForSeq2Seq pad_to_multiple_of)."""
    length_replay_batches: int = 300
    """With a length_profile on a GPU: micro-batches of sampled lengths replayed, the first of a run
    (about 45 ms each for a 7B model with checkpointing; one that repeats a length from unchanged
    cached segments is skipped, launcher/memory/replay.py `varlen_replay`). The cache keeps growing
    slowly with more: Llama-2-7B LoRA on Alpaca at 512 tokens holds 0.25 GiB above live bytes at
    one length and 1.05 GiB after 300 batches (scripts/validate_gpu_rows.yaml TT-32)."""
    micro_batch_size: Optional[int] = None
    """Examples per GPU per forward. null = search the largest that fits."""
    global_batch_size: Optional[int] = None
    """Examples per optimizer step over all GPUs. null = micro_batch_size x data-parallel size."""
    precision: Precision = Precision["bf16-mixed"]  # type: ignore[valid-type]
    optimizer: Optimizer = Optimizer["adamw_torch"]  # type: ignore[valid-type]
    gradient_checkpointing: bool = False
    """True reduces activation memory (recomputes each layer in backward, ~+33% compute)."""
    liger_kernel: bool = False
    """Liger-Kernel's Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy that never
    materialises the logits), as HF Trainer's use_liger_kernel applies them; llama, mistral and
    qwen2 models, GPUs with the liger-kernel package (launcher/liger.py)."""
    liger_kernels: List[str] = field(default_factory=lambda: ["rope", "rms_norm", "swiglu",
                                                              "fused_linear_cross_entropy"])
    """Which of Liger's kernels training.liger_kernel applies: the switches of Liger's
    `apply_liger_kernel_to_<family>(rope, rms_norm, swiglu, fused_linear_cross_entropy)`. A script
    that calls `apply_liger_kernel_to_<family>()` after the model is built gets [rope,
    fused_linear_cross_entropy] only: the function swaps the modeling module's RMSNorm and MLP
    classes, which the built modules do not see, while RoPE (a module function) and the LM head's
    forward (a class method) are looked up at call time (Liger 03fd603 monkey_patch.py)."""
    causal_lm_loss: CausalLmLoss = CausalLmLoss["model"]  # type: ignore[valid-type]
    """The causal-LM loss path: model = the installed transformers' (its ForCausalLMLoss upcasts the
    logits to fp32 inside the loss); fp32_shift_copy = transformers 4.37-4.45's causal-LM forwards
    (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM...: `logits = logits.float()` in the
    model, then `logits[..., :-1, :].contiguous()` before CrossEntropyLoss), for planning runs of
    those versions; shift_copy = the same lines without the upcast: the cross-entropy runs on the
    lm_head's 16-bit logits (transformers 4.2x-4.3x GPT2LMHeadModel, OPTForCausalLM,
    BloomForCausalLM; Qwen (v1)'s modeling_qwen.py QWenLMHeadModel), as in a run without autocast
    (DeepSpeed's fp16/bf16 engine: HF Trainer leaves mixed precision to it). The worker runs the
    installed one, so such a plan is an estimate only."""
    checkpoint_policy: CheckpointPolicy = CheckpointPolicy["full"]  # type: ignore[valid-type]
    """With gradient_checkpointing: what each checkpointed layer keeps (full | reentrant |
    selective_op, torchtitan's `activation_checkpoint.mode=selective, selective_ac_option=op`).
    reentrant = torch's reentrant checkpoint, which transformers 4's `gradient_checkpointing_enable`
    runs by default and many recipes ask for (`use_reentrant: true`)."""
    attn_implementation: Attention = Attention["sdpa"]  # type: ignore[valid-type]
    learning_rate: float = 2.0e-4
    weight_decay: float = 0.0
    sgd_momentum: float = 0.9
    """training.optimizer=sgd's momentum. 0 = plain SGD, which keeps no optimizer state (torch/optim/
    sgd.py creates `momentum_buffer` only when momentum != 0): torch.optim.SGD's own default, and
    HF Trainer's optim="sgd" without optim_args (transformers/trainer_optimizer.py `_get_sgd`)."""
    max_grad_norm: float = 1.0
    """Gradient clipping (0 = off)."""
    optimizer_in_backward: bool = False
    """Step each parameter's optimizer in its post-accumulate-grad hook and free its gradient there,
    so at most a few gradients are alive at once (torch's "How to save memory by fusing the optimizer
    step into the backward pass" tutorial; torchtune's `optimizer_in_bwd`). One unwrapped process
    (strategy=single), no gradient accumulation, no clipping, no fp16 loss scaling."""
    zero_grad_set_to_none: bool = True
    """`optimizer.zero_grad(set_to_none=...)` after each step. true drops the gradients, so they exist
    from each parameter's backward to the step's end: torch's default since 2.0 (torch/optim/
    optimizer.py `zero_grad(self, set_to_none: bool = True)`), HF Trainer's and the launcher's.
    false zeroes them in place, so they stay allocated through the next step's forward: the default
    of torch 1.x (`zero_grad(self, set_to_none: bool = False)`), which every loop calling
    `optimizer.zero_grad()` or `model.zero_grad()` ran before torch 2.0; autograd then adds each new
    gradient into the kept one and frees it (accumulate_grad.h `variable_grad += new_grad`), as FSDP2
    and FSDP1 add each reduce-scattered gradient into the kept shard. Planned and run for ddp (with
    gradient_as_bucket_view=true the bucket views are the gradients either way), single, fsdp2,
    fsdp2_grad_op and fsdp1; the other strategies refuse it."""
    built_on_device: bool = False
    """The whole model is built (or moved) on the GPU before the framework wraps it, as scripts that
    call `model.cuda()` before `FullyShardedDataParallel` and torchtune's first recipes
    (`models.get_model(device=cuda)`) do; false: built on the host and moved by the framework, as
    the launcher's workers do. FSDP1 and FSDP2 plans replay the initialization through the
    allocator before the step; built on the device, every parameter's own segment stays cached
    after the framework shards it (launcher/backends/fsdp1/layout.py, fsdp2/layout.py
    `initialization`). Planning only: the other strategies' plans do not depend on it (DDP and
    single keep the parameters as built; DeepSpeed moves them to the host before flattening and
    empties the cache), and the worker always builds on the host."""
    keep_outputs: bool = False
    """The training loop keeps each step's model outputs until the next forward returns, as a loop
    that assigns them does (`outputs = model(**batch)`, `loss = outputs.loss`: transformers'
    examples/pytorch/*_no_trainer.py, accelerate's examples, DeepSpeed-Chat's training): the
    logits (and, with training.use_cache, every layer's keys and values) outlive the step's
    backward and optimizer step, and the previous step's are alive through the next forward
    (launcher/trace.py `_previous_outputs`). false: the outputs are dropped once the loss is taken,
    as HF Trainer's `compute_loss`, torchtune's recipes and the launcher's workers do. Planning
    only: the worker runs the launcher's own loop, so such a plan is an estimate only."""
    use_cache: bool = False
    """The training forward builds the cache of keys and values, as transformers 4 does with the
    configs' default `use_cache=True` and no gradient checkpointing: each layer's own key and value
    tensors, not copies (GPT-2's are views of its fused qkv projection, so they hold the
    projection, which autograd does not otherwise keep), alive until the outputs are dropped
    (launcher/trace.py `_transformers4_cache`). Under gradient checkpointing transformers turns the
    cache off. false: no cache, as the launcher's workers set it (`use_cache = False`). Planning
    only: such a plan is an estimate only."""
    rotary_cache: bool = False
    """Every attention layer holds its own rotary embedding with cos and sin tables for all of the
    model's max_position_embeddings, as transformers 4.37-4.44's Qwen2 builds them
    (modeling_qwen2.py `Qwen2Attention.__init__`: `self.rotary_emb = Qwen2RotaryEmbedding(...)`,
    whose `_set_cos_sin_cache` registers `cos_cached` and `sin_cached`, max_position_embeddings x
    head_dim in the default dtype, which from_pretrained sets to the load dtype): 2 x 131072 x 128 x
    2 bytes per layer for Qwen2-7B in bf16, never sharded (they are buffers). false: the installed
    transformers' one rotary embedding per model, which computes cos and sin per forward. Planning
    only: such a plan is an estimate only."""
    warmup_steps: int = 0
    max_steps: int = 30
    """Optimizer steps of a run."""
    seed: int = 1234
    allow_peft: bool = False
    """strategy=auto may also plan LoRA/QLoRA candidates (which train adapters, not the full
    model) and gradient checkpointing as ways to fit; each candidate says what it trains."""


PeftMethod = _enum(
    "PeftMethod", ["none", "lora", "qlora"],
    "none = full fine-tuning; lora = LoRA adapters (arXiv:2106.09685) on a frozen base; qlora = "
    "LoRA on a base whose Linear weights are bitsandbytes 4-bit (arXiv:2305.14314; GPU only).")
QuantType = _enum("QuantType", ["nf4", "fp4", "gptq_int4", "gptq_int8", "torchao_nf4"],
                  "nf4 | fp4: bitsandbytes 4-bit data type (bnb_4bit_quant_type), quantized from the 16-bit "
                  "model; gptq_int4 | gptq_int8: a GPTQ-quantized checkpoint (auto-gptq QuantLinear, "
                  "peft.gptq_group_size); torchao_nf4: torchao's NF4Tensor on the Linears that get "
                  "adapters, built and loaded as torchtune's single-device QLoRA recipe does "
                  "(peft.nf4_quantize_chunk). GPTQ and torchao bases are planned but not trained by the worker.")
ComputeDtype = _enum("ComputeDtype", ["bfloat16", "float16"], "bnb_4bit_compute_dtype for QLoRA.")
InferPrecision = _enum(
    "InferPrecision", ["bf16", "fp16", "fp32", "int8", "nf4", "fp4", "gptq_int4", "gptq_int8"],
    "Serving weights: 16-bit, fp32 (transformers' default load dtype), LLM.int8 (bitsandbytes Int8Params), bitsandbytes 4-bit, or a GPTQ "
    "checkpoint (auto-gptq QuantLinear, group size 128).")
KvCache = _enum(
    "KvCache", ["dynamic", "tuple", "tuple_fused_qkv"],
    "How generate's model keeps keys and values (launcher/infer.py `_generate_phases`). dynamic: "
    "transformers' DynamicCache (4.36 on), grown layer by layer in place of the old tensors. tuple: "
    "per-layer (key, value) tuples that each forward rebuilds with torch.cat and returns, while generate "
    "still holds the previous step's tuple (transformers before 4.36, and remote-code models such as "
    "Qwen's modeling_qwen.py): two caches at a decode step's peak. tuple_fused_qkv: the same, for a "
    "model whose prompt cache holds views of one fused q|k|v projection (Qwen's c_attn): each cached "
    "value keeps the whole fused output alive, and a rotated key its own copy.")
GptqKernel = _enum(
    "GptqKernel", ["cuda_old", "exllama"],
    "AutoGPTQ's QuantLinear for serving a GPTQ checkpoint: cuda_old (its CUDA kernel up to 128 rows, "
    "whole-weight dequantization above; launcher/gptq.py) or exllama (4-bit only: AutoGPTQ 0.4's default, "
    "one fp16 dequantization buffer per GPU; launcher/infer.py gptq_buffer_bytes).")
PromptLogits = _enum(
    "PromptLogits", ["last", "all"],
    "Logits of the prompt's forward: last = the last position only (generate's logits_to_keep=1, "
    "transformers 4.45 on); all = every prompt position (older transformers and remote-code heads), "
    "kept by generate's loop until the next forward returns.")
DeviceMap = _enum(
    "DeviceMap", ["auto", "balanced", "balanced_low_0", "sequential"],
    "from_pretrained(device_map=...): whole layers spread over the GPUs, the rest offloaded to the CPU "
    "(launcher/device_map.py).")


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning with HF PEFT (launcher/peft.py builds the peft.LoraConfig);
    the estimator traces the very modules `peft.get_peft_model` creates."""

    method: PeftMethod = PeftMethod["none"]  # type: ignore[valid-type]
    r: int = 8
    """LoRA rank."""
    alpha: int = 16
    """lora_alpha (the update is scaled by alpha / r)."""
    dropout: float = 0.05
    """lora_dropout on the adapter's input."""
    target_modules: Optional[List[str]] = None
    """Module names to adapt. null = PEFT's default for the architecture
    (peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING; for BioGPT, which
    PEFT has none for, OPT's: launcher/peft.py `DEFAULT_TARGETS_PEFT_LACKS`)."""
    use_dora: bool = False
    """DoRA (Liu et al. 2024, arXiv:2402.09353; LoraConfig use_dora): adapters plus a trained
    magnitude per output row of each adapted weight; traced as peft builds it (more activations)."""
    modules_to_save: Optional[List[str]] = None
    """Modules trained in full next to the adapters, e.g. [embed_tokens,lm_head] (LoraConfig
    modules_to_save: peft keeps the frozen original and a trainable copy of each)."""
    train_base: bool = False
    """LoRA: the base model trains too, every parameter next to the adapters, as DeepSpeed-Chat
    trains its LoRA layers unless --only_optimize_lora is set (dschat/utils/module/lora.py
    `only_optimize_lora_parameters` is what freezes the base). Not with QLoRA's 4-bit base."""
    quant_type: QuantType = QuantType["nf4"]  # type: ignore[valid-type]
    """QLoRA: 4-bit type of the base Linear weights."""
    double_quant: bool = True
    """QLoRA: quantize the absmax constants again (bnb_4bit_use_double_quant)."""
    compute_dtype: ComputeDtype = ComputeDtype["bfloat16"]  # type: ignore[valid-type]
    """QLoRA: dtype the frozen base computes (and is kept) in, except its 4-bit Linear weights."""
    gptq_group_size: int = 128
    """quant_type=gptq_*: the checkpoint's GPTQ group size (quantize_config.json group_size)."""
    nf4_quantize_chunk: int = 1048576
    """quant_type=torchao_nf4: elements per nearest-value search when a weight is quantized
    (torchao >= 0.2: 1048576, nf4tensor.py CHUNK_SIZE; 0 = the whole weight at once, torchao 0.1)."""
    autocast_adapter_dtype: bool = True
    """peft's get_peft_model(autocast_adapter_dtype=...): true keeps the adapters in fp32 on a 16-bit
    model (peft's default, HF Trainer and TRL); false builds them in the model's dtype (torchtune).
    DeepSpeed casts the whole module to its 16-bit dtype either way."""
    bnb_keeps_input: bool = False
    """QLoRA (nf4, fp4): every 4-bit matmul keeps its input for its backward, as bitsandbytes
    before 0.43.2 did (autograd/_functions.py MatMul4Bit.forward: `ctx.tensors = (A, B)`, though
    its backward does not use A; dropped in 0.43.2 by "fix QLoRA mem bug: delete useless
    buffered activation", PR 1270, 2024-07-16). false: bitsandbytes 0.43.2 on (`ctx.tensors =
    (None, B)`). Traced as saved for the matmul's backward: checked against a real step without
    checkpointing; with reentrant checkpointing (training.checkpoint_policy=reentrant, as PEFT's
    and HF's QLoRA scripts of that time ran it) the forward keeps nothing and the recomputed layer
    keeps its inputs until its backward, as traced (not checked against a real run). Not modelled:
    under non-reentrant checkpointing (policy full), bitsandbytes' attribute is out of reach of the
    checkpoint's saved-tensor hooks, so every layer's inputs would stay alive through the
    forward. Planning only: the worker runs the installed bitsandbytes, so such a plan
    is an estimate only."""
    upcast_non_quantized: bool = True
    """QLoRA (bitsandbytes types): run peft's prepare_model_for_kbit_training, as HF Trainer, TRL and
    Axolotl QLoRA recipes do: every 16-bit parameter that is not 4-bit (embeddings, norms, LM head)
    becomes fp32, and so do the hidden states and logits. false = keep them in compute_dtype
    (torchtune's QLoRA)."""


@dataclass
class InferenceConfig:
    """mode=infer_plan: serving memory of `generate` per GPU (launcher/infer_plan.py)."""

    precision: InferPrecision = InferPrecision["bf16"]  # type: ignore[valid-type]
    batch_size: int = 1
    prompt_len: Optional[int] = None
    """Prompt tokens per sequence. null: 1024, or the model's maximum positions minus gen_len when
    that is shorter (gpt2: 1024 - 256 = 768), so the default request fits every catalogue model."""
    gen_len: int = 256
    """Generated tokens per sequence (max_new_tokens)."""
    tp_size: int = 1
    """Tensor-parallel GPUs the model is split over (memory reported per GPU)."""
    attn_implementation: Attention = Attention["sdpa"]  # type: ignore[valid-type]
    """transformers' attn_implementation while generating: eager materialises the attention scores
    (and their fp32 softmax) of the largest forward; sdpa and flash_attention_2 do not."""
    double_quant: bool = False
    """nf4/fp4: bnb_4bit_use_double_quant (BitsAndBytesConfig's default is False)."""
    kv_cache: KvCache = KvCache["dynamic"]  # type: ignore[valid-type]
    """How the model keeps the KV cache while generating (KvCache): dynamic is transformers' own."""
    prompt_logits: PromptLogits = PromptLogits["last"]  # type: ignore[valid-type]
    """last: transformers' generate computes the prompt's last logits only; all: every position."""
    gptq_kernel: GptqKernel = GptqKernel["cuda_old"]  # type: ignore[valid-type]
    """gptq_int4/gptq_int8: AutoGPTQ's kernel (GptqKernel); exllama is 4-bit only."""
    device_map: Optional[DeviceMap] = None  # type: ignore[valid-type]
    """null: every GPU holds the whole model or its tensor-parallel shard (tp_size). auto, balanced,
    balanced_low_0, sequential: transformers' from_pretrained(device_map=...) over `gpus` GPUs,
    what does not fit offloaded to the CPU (16-bit and fp32 weights; bitsandbytes int8/nf4/fp4
    models are placed on the GPUs only, as transformers requires without fp32 CPU offload)."""
    max_memory_gib: Optional[float] = None
    """With device_map: from_pretrained's max_memory per GPU, in GiB; null = the GPU's free memory
    (its capacity minus the CUDA context)."""


@dataclass
class DataConfig:
    path: str = "demo"
    """'demo' = the small corpus shipped with launcher; else a .jsonl/.txt file or a saved HF datasets directory."""
    text_key: str = "text"
    """Field holding the text in JSONL / datasets rows."""


@dataclass
class DeepSpeedConfig:
    """DeepSpeed knobs that change memory. The estimator and the emitted ds_config.json read the
    same values. Defaults are DeepSpeed 0.19's code defaults (deepspeed/runtime/zero/config.py);
    bucket sizes are in elements."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: Optional[bool] = None
    """null = DeepSpeed's default (True for stage 3, False otherwise)."""
    contiguous_gradients: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_param_persistence_threshold: int = 100_000
    sub_group_size: int = 1_000_000_000
    offload_pin_memory: bool = True


@dataclass
class DDPConfig:
    """torch DistributedDataParallel settings (torch/nn/parallel/distributed.py)."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    """True: gradients live in DDP's flat buckets (no second copy of the gradients)."""
    static_graph: bool = False


@dataclass
class FSDP2Config:
    """PyTorch FSDP2 knobs (launcher/backends/fsdp2/); the estimator and the emitted
    fsdp2_plan.json read the same values."""

    tp_size: Optional[int] = None
    """fsdp2_tp: tensor-parallel size (the second DeviceMesh dimension); null = every size that
    divides a node's GPUs and the model's attention and key/value heads."""
    keep_last_block: bool = True
    """With reshard_after_forward (fsdp2, fsdp2_offload, fsdp2_tp): the last decoder block keeps its
    parameters unsharded from its forward to its backward, as torchtitan's `apply_fsdp` does (one
    all-gather less per micro-batch, one block's parameters more through the LM head and the loss).
    false: it reshards like every other block, as Accelerate's `fsdp_version: 2` applies one
    `reshard_after_forward` to all of them."""


@dataclass
class ColossalAIConfig:
    """ColossalAI 0.5.0 plugin knobs that change memory; the estimator and the emitted
    colossalai_plugin.json read the same values. Defaults are the plugins' own
    (colossalai/booster/plugin/gemini_plugin.py `GeminiPlugin.__init__`,
    hybrid_parallel_plugin.py `HybridParallelPlugin.__init__`, low_level_zero_plugin.py
    `LowLevelZeroPlugin.__init__`)."""

    placement_policy: str = "static"
    """Gemini: 'static' (fixed fractions below) or 'auto' (moves chunks by measured memory).
    Default 'static' (gemini_plugin.py)."""
    shard_param_frac: float = 1.0
    """Gemini static: fraction of parameter chunks sharded over the data-parallel ranks (1.0 =
    ZeRO-3, 0.0 = replicated like ZeRO-2). Default 1.0 (gemini_plugin.py)."""
    offload_optim_frac: float = 0.0
    """Gemini static: fraction of fp32 master/optimizer chunks kept in host memory. Default 0.0."""
    offload_param_frac: float = 0.0
    """Gemini static: fraction of 16-bit parameter chunks kept in host memory (needs
    shard_param_frac=1.0). Default 0.0 (gemini_plugin.py, placement_policy.py StaticPlacementPolicy)."""
    search_range_m: int = 32
    """Gemini chunk-size search range, in 2^20 elements. Default 32 (gemini_plugin.py;
    colossalai/zero/gemini/chunk/search_utils.py `search_chunk_configuration`)."""
    min_chunk_size_m: float = 32.0
    """Gemini: smallest chunk, in 2^20 elements; a model with fewer parameters stays in one
    gathered (unsharded) chunk. Default 32 (search_utils.py)."""
    hidden_dim: Optional[int] = None
    """Gemini chunk-search step in elements. null = 1024 (chunk/utils.py `init_chunk_manager`)."""
    reduce_bucket_size_in_m: int = 12
    """LowLevelZero reduction bucket, in 2^20 elements (LowLevelZeroPlugin default 12;
    HybridParallelPlugin `zero_bucket_size_in_m` default 12)."""
    tp_size: Optional[int] = None
    """HybridParallel tensor-parallel size for cai_tp: must divide gpus, num_attention_heads and
    num_key_value_heads. null = plan every such size > 1 (no plugin default: required argument)."""
    pp_size: Optional[int] = None
    """HybridParallel pipeline stages for cai_pp: must divide the number of layers and gpus. null
    = plan every such size > 1 (no plugin default: required argument)."""
    num_microbatches: Optional[int] = None
    """HybridParallel 1F1B micro-batches per step and rank. null = pp_size (the smallest that
    fills the pipeline); plugin default None (then microbatch_size must be given)."""
    zero_stage: int = 0
    """HybridParallel ZeRO stage (0, 1 or 2) on the data-parallel dimension of cai_tp / cai_pp.
    Default 0 (hybrid_parallel_plugin.py); with pp_size > 1 stage 2 is not allowed."""
    overlap_communication: Optional[bool] = None
    """LowLevelZero/Hybrid: overlap gradient reduction on a side stream. null = True on GPUs (the
    plugins' default) and False on CPU (no streams)."""


@dataclass
class PlannerConfig:
    safety_margin: Optional[float] = None
    """Fraction of device memory kept free when deciding that a candidate fits. null = on GPUs the
    90th percentile of the estimate's underestimates on published measurements (launcher/margin.py,
    written by scripts/validate_gpu), on CPU processes 0.05."""
    max_micro_batch_size: int = 64
    """Largest micro-batch the search tries."""


@dataclass
class LaunchConfig:
    """How the chosen plan is started: the `launch` group (conf/launch/), e.g. launch=slurm."""

    kind: LaunchKind = LaunchKind["torchrun"]  # type: ignore[valid-type]
    master_port: int = 29517
    """TCP port of the c10d rendezvous on the first node (multi-node runs)."""
    max_restarts: int = 0
    """torchrun --max-restarts: after a rank fails, restart every rank this many times; the
    restarted workers continue from the latest complete checkpoint (set checkpoint.every_steps)."""
    partition: Optional[str] = None
    """Slurm partition (sbatch --partition). null = the cluster's default partition."""
    account: Optional[str] = None
    """Slurm account to charge (sbatch --account). null = the user's default account."""
    time_min: int = 60
    """Slurm time limit of the job, minutes (sbatch --time)."""
    cpus_per_task: Optional[int] = None
    """CPUs of the one task per node that runs torchrun (sbatch --cpus-per-task); OMP_NUM_THREADS
    of each rank is this divided by the ranks per node. null = Slurm's default (1)."""
    mem_gb: Optional[int] = None
    """Host memory per node, GB (sbatch --mem). null = the partition's default."""
    gpus_per_node: Optional[int] = None
    """GPUs requested per node (sbatch --gpus-per-node). null = gpus / nodes, or 0 with hardware=cpu."""
    wait: bool = True
    """launch=slurm: wait for the job to end and report its final state (sacct) and summary.
    false = submit and return (e.g. to submit every point of a -m sweep at once)."""
    wait_timeout_min: Optional[float] = None
    """Longest the launcher waits for a submitted job, minutes (the job keeps running after).
    null = launch.time_min + 30 (a half-hour allowance for queueing)."""
    signal_delay_s: int = 90
    """launch=slurm: seconds before the time limit at which Slurm signals the job (sbatch
    --signal=USR2@N, submitit's signal_delay_s); the ranks checkpoint and the job is requeued
    (launcher/slurm_job.py). Preemption signals the same way."""


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Save every N optimizer steps (0 = only at the end)."""
    keep: int = 2
    """Checkpoints kept (older ones are deleted after a newer one is complete); 0 = all."""


@dataclass
class MeasureConfig:
    """mode=measure (launcher/measure.py): a memory pass with the allocation tracker, then a
    timing pass without it (the tracker intercepts every op and slows small models ~2x)."""

    memory_steps: int = 3
    """Optimizer steps of the memory pass (the peak is steady from the second step on)."""
    timing_steps: int = 8
    """Optimizer steps of the timing pass (0 = no timing pass: step time is not reported)."""
    warmup_steps: int = 2
    """Leading steps of the timing pass left out of the median step time (lazy allocations,
    optimizer-state creation, first-call caches)."""
    keep_checkpoints: bool = False
    """Keep the checkpoints the worker writes at the last step (measure runs do not need them)."""


@dataclass
class CalibrateConfig:
    """mode=calibrate (launcher/calibrate.py): what to measure on this machine."""

    matmul_sizes: List[int] = field(default_factory=lambda: [256, 512, 1024])
    """Square matmul sizes n (n x n @ n x n); the profile keeps the best sustained rate."""
    collective_mib: List[float] = field(default_factory=lambda: [0.25, 1.0, 4.0, 16.0, 64.0])
    """Message sizes of the all-reduce / all-gather / reduce runs between `gpus` local ranks."""
    repeats: int = 20
    """Timed repetitions per measurement (the median is kept; on a 2-core machine fewer than ~20
    left the elementwise and small-message rates varying by 2x between runs)."""
    frameworks: List[str] = field(default_factory=list)
    """Strategies whose per-step framework overhead to measure by training the calibration model
    (e.g. [ddp,zero0,zero1,zero2,zero3]); empty = skip (it takes ~30 s per strategy and depth)."""
    framework_depths: List[int] = field(default_factory=lambda: [1, 4])
    """Decoder depths of the calibration model: two or more separate the per-step overhead from the
    per-parameter-tensor one."""
    framework_timing_steps: int = 16
    """Timed optimizer steps per framework measurement (after 3 warm-up steps; the median is kept)."""
    framework_rounds: int = 3
    """Times each (strategy, depth) is measured, round-robin over all of them; the median over rounds
    is kept (load drift then hits every strategy alike)."""


@dataclass
class WorkerConfig:
    """Testing aids for the per-rank worker (launcher/worker/oom.py)."""

    simulate_oom_above_bytes: Optional[int] = None
    """Testing aid: a step whose measured peak exceeds this many bytes raises torch.OutOfMemoryError,
    as a device of that size would (exercises the out-of-memory fallback on CPU). null = off."""


@dataclass
class LauncherConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    colossalai: ColossalAIConfig = field(default_factory=ColossalAIConfig)
    fsdp2: FSDP2Config = field(default_factory=FSDP2Config)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    gpus: int = 1
    """Total number of GPUs (or CPU processes with hardware=cpu) over all nodes."""
    nodes: int = 1
    strategy: StrategyName = StrategyName["auto"]  # type: ignore[valid-type]
    mode: Mode = Mode["auto"]  # type: ignore[valid-type]
    report: Report = Report["table"]  # type: ignore[valid-type]
    init: Init = Init["random"]  # type: ignore[valid-type]
    resume: Any = False
    """false, or the run directory of a previous run (resume=runs/<date>/<time>_<model>): continue
    it from its latest complete checkpoint, with the same plan and data order, writing into that
    directory under new names (.hydra-resume-N/, run-resume-N.json); only training.max_steps,
    checkpoint.*, launch.* and report may change. resume=true with hydra.run.dir=<dir> is the same."""
    fallback: bool = True
    """When a launched run runs out of device memory, relaunch it with the next-ranked candidate
    that fits and needs less memory, in RUN_DIR/attempt-N/ (launcher/fallback.py)."""
    max_fallbacks: int = 2
    """Relaunches after out-of-memory errors before giving up."""
    run_dir: Optional[str] = None
    """Set by the app to Hydra's output directory."""
    cache_dir: Optional[str] = None
    """Where traces are cached. null = ~/.cache/launcher."""


def register_schema() -> None:
    """Make `launcher_schema` (the typed base of conf/config.yaml) known to Hydra. Called by the
    entry points before they compose (launcher/__main__.py, launcher/cli.py `compose`), so the
    planning core that reads these dataclasses never imports Hydra. Stored once per process:
    turning the dataclasses into a structured config is the slow part."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    if "launcher_schema.yaml" not in store.repo:
        store.store(name="launcher_schema", node=LauncherConfig)

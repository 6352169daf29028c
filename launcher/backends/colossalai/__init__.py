"""ColossalAI booster plugins: TorchDDP, LowLevelZero, Gemini and HybridParallel (TP, PP)."""
from launcher.backends.base import Backend
from launcher.backends.colossalai import comm, emit, expand, layout, rules, runtime
from launcher.types import Strategy

BACKEND = Backend(
    name="colossalai",
    strategies={  # cai_tp / cai_pp: templates, sizes from expand.py
        "cai_ddp": Strategy("cai_ddp", "colossalai"),
        "cai_zero1": Strategy("cai_zero1", "colossalai", zero_stage=1),
        "cai_zero2": Strategy("cai_zero2", "colossalai", zero_stage=2),
        "cai_gemini": Strategy("cai_gemini", "colossalai", zero_stage=3),
        "cai_tp": Strategy("cai_tp", "colossalai", tp_size=2),
        "cai_pp": Strategy("cai_pp", "colossalai", pp_size=2),
    },
    rules=rules.rules, problem=rules.problem,
    trace_request=layout.trace_request, memory=layout.memory,
    comm=comm.comm, host_equivalent=comm.host_equivalent, communicators=comm.communicators,
    emit_file="colossalai_plugin.json",
    emit=lambda x: emit.plugin_config(x.strategy, x.training, x.knobs["colossalai"], x.knobs["ddp"], x.device,
                                      x.grad_accum_steps, x.vocab_size),
    worker="launcher.backends.colossalai.worker:ColossalAIBackend",
    join="launcher.backends.colossalai.worker:launch",
    check_worker_config="launcher.backends.colossalai.worker:check_config",
    knobs=("colossalai", "ddp"),
    expand=expand.expand, grad_accum=expand.grad_accum,
    interpreter=runtime.interpreter, attention=runtime.attention, launch_problem=runtime.candidate_problem,
    builds_on=("ddp",),  # TorchDDPPlugin and the hybrid plugin's DP dimension are torch DDP: its layout and comm
)

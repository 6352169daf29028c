"""PyTorch FSDP2 (`fully_shard`) and torch-native tensor parallelism on a 2D DeviceMesh."""
from launcher.backends.base import Backend
from launcher.backends.fsdp2 import comm, emit, layout, rules

BACKEND = Backend(
    name="fsdp2",
    strategies=rules.STRATEGIES,
    rules=rules.rules, problem=rules.problem,
    trace_request=layout.trace_request, memory=layout.memory,
    comm=comm.comm, host_equivalent=comm.host_equivalent, communicators=comm.communicators,
    emit_file=emit.PLAN_FILE, emit=emit.emit,
    worker="launcher.backends.fsdp2.worker:FSDP2Backend",
    check_worker_config="launcher.backends.fsdp2.worker:check_config",
    knobs=("fsdp2",),
    adapter_autocast=rules.adapter_autocast, peft_settings=rules.peft_settings,
    exports=emit.exports,
    expand=rules.expand, launch_problem=rules.launch_problem,
)

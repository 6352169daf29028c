"""PyTorch FSDP1 (`FullyShardedDataParallel`), one flat parameter per decoder block and the root."""
from launcher.backends.base import Backend
from launcher.backends.fsdp1 import comm, emit, layout, rules

BACKEND = Backend(
    name="fsdp1",
    strategies=rules.STRATEGIES,
    rules=rules.rules,
    trace_request=layout.trace_request, memory=layout.memory,
    comm=comm.comm, host_equivalent=comm.host_equivalent,
    emit_file=emit.PLAN_FILE, emit=emit.emit,
    worker="launcher.backends.fsdp1.worker:FSDP1Backend",
    check_worker_config="launcher.backends.fsdp1.worker:check_config",
    adapter_autocast=rules.adapter_autocast, peft_settings=rules.peft_settings,
    exports=emit.exports, auto=False,
    builds_on=("fsdp2",),  # the same traced step, collectives and per-block layout machinery
)

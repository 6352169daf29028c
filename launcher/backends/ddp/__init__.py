"""torch DistributedDataParallel (`ddp`) and one unwrapped process (`single`)."""
from launcher.backends.base import Backend
from launcher.backends.ddp import comm, emit, layout, rules
from launcher.types import Strategy

BACKEND = Backend(
    name="ddp",
    strategies={
        "single": Strategy("single", "ddp"),  # one process, no data-parallel wrapper (gpus=1)
        "ddp": Strategy("ddp", "ddp"),
    },
    rules=rules.rules,
    trace_request=layout.trace_request, memory=layout.memory,
    comm=comm.comm, host_equivalent=comm.host_equivalent,
    emit_file="ddp_config.json", emit=lambda x: emit.ddp_settings(x.knobs["ddp"]),
    worker="launcher.backends.ddp.worker:DDPBackend",
    check_worker_config="launcher.backends.ddp.worker:check_config",
    knobs=("ddp",),
    accelerate=emit.accelerate_keys,
)

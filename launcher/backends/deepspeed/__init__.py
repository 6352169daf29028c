"""DeepSpeed ZeRO stages 0-3 and ZeRO-Offload."""
from launcher.backends.base import Backend
from launcher.backends.deepspeed import comm, emit, exports, memory, rules
from launcher.types import Strategy

BACKEND = Backend(
    name="deepspeed",
    strategies={
        "zero0": Strategy("zero0", "deepspeed", zero_stage=0),
        "zero1": Strategy("zero1", "deepspeed", zero_stage=1),
        "zero2": Strategy("zero2", "deepspeed", zero_stage=2),
        "zero3": Strategy("zero3", "deepspeed", zero_stage=3),
        "zero2_offload": Strategy("zero2_offload", "deepspeed", zero_stage=2, offload_optimizer=True),
        "zero3_offload": Strategy("zero3_offload", "deepspeed", zero_stage=3, offload_optimizer=True,
                                  offload_params=True),
    },
    rules=rules.rules, problem=rules.problem,
    trace_request=memory.trace_request, memory=memory.memory,
    comm=comm.comm, host_equivalent=comm.host_equivalent, communicators=comm.communicators,
    emit_file="ds_config.json",
    emit=lambda x: emit.deepspeed_config(x.strategy, x.training, x.knobs["deepspeed"], x.micro_batch_size,
                                         x.grad_accum_steps, x.dp_size),
    worker="launcher.backends.deepspeed.worker:DeepSpeedBackend",
    join="launcher.backends.deepspeed.worker:join",
    check_worker_config="launcher.backends.deepspeed.worker:check_config",
    knobs=("deepspeed",),
    adapter_autocast=False, peft_settings=rules.peft_settings,
    to_neutral="launcher.backends.deepspeed.checkpoint:to_neutral",
    exports=exports.exports, accelerate=exports.accelerate_keys, launch_commands=exports.launch_commands,
)

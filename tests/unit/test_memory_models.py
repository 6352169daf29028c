"""Strategy memory models on synthetic traces whose every byte is known, against closed forms
composed by hand (torch DDP) and the ZeRO paper's model-state formulas (arXiv:1910.02054 sec. 5)."""
import numpy as np
import pytest

from launcher.config import DDPConfig, DeepSpeedConfig
from launcher.errors import ConfigError
from launcher.backends.registry import knobs as registry_knobs
from launcher.memory.estimate import estimate, trace_request
from launcher.memory.common import model_state_bytes
from launcher.backends.deepspeed.layout import ZeroSetup, zero0_layout, zero12_layout
from launcher.backends.deepspeed.zero3 import gathered_param_bytes, zero3_layout
from launcher.steptrace import Kind, ParamTable, Role, StepTrace, TraceSet
from launcher.types import Cluster, Strategy, Workload

EMB, LAYER_PARAMS = 4096, (20_000, 12_000)  # numel of the embedding and of each layer's params
ACT_PER_LAYER = 50_000  # bytes saved for backward per layer


class _Events:
    def __init__(self):
        self.rows, self.n = [], 0

    def alloc(self, nbytes, kind, param=-1):
        self.rows.append([nbytes, self.n, None, kind, -1, param])
        self.n += 1
        return len(self.rows) - 1

    def free(self, row):
        self.rows[row][2] = self.n
        self.n += 1


def synthetic_trace(num_layers: int, esize: int = 4, optimizer: bool = True,
                    layer_params=LAYER_PARAMS) -> StepTrace:
    """build: params; forward: one activation per layer; backward: per layer (reverse) its grads
    (each ready at the next event) then its activation freed; optimizer: AdamW foreach (2 states
    per param + one temporary over all params); zero_grad frees the grads."""
    numel = [EMB] + [n for _ in range(num_layers) for n in layer_params]
    layer = [-1] + [l for l in range(num_layers) for _ in layer_params]
    e, phases = _Events(), {}
    phases["build"] = 0
    params = [e.alloc(n * esize, Kind.PARAM, i) for i, n in enumerate(numel)]
    phases["forward"] = e.n
    acts = [e.alloc(ACT_PER_LAYER, Kind.ACT) for _ in range(num_layers)]
    phases["backward"] = e.n
    grads, ready = [], {}
    for l in reversed(range(num_layers)):
        for i in (i for i in range(len(numel)) if layer[i] == l):
            grads.append(e.alloc(numel[i] * esize, Kind.GRAD, i))
            ready[grads[-1]] = e.n
        e.free(acts[l])
    grads.append(e.alloc(EMB * esize, Kind.GRAD, 0))
    ready[grads[-1]] = e.n
    tail = e.alloc(8, Kind.ACT)
    e.free(tail)
    phases["optimizer"] = e.n
    if optimizer:
        for i, n in enumerate(numel):
            e.alloc(n * 4, Kind.OPTIM, i), e.alloc(n * 4, Kind.OPTIM, i), e.alloc(4, Kind.OPTIM, i)
        tmp = e.alloc(sum(numel) * 4, Kind.ACT)
        e.free(tmp)
    phases["zero_grad"] = e.n
    for g in grads:
        e.free(g)
    end = e.n
    rows = np.array([[r[0], r[1], end if r[2] is None else r[2], r[3], -1, r[5]] for r in e.rows],
                    dtype=np.int64)
    for g, ev in ready.items():
        rows[g, 4] = ev
    names = tuple(f"p{i}" for i in range(len(numel)))
    table = ParamTable(names, np.array(numel), np.full(len(numel), esize), np.ones(len(numel), bool),
                       np.array([Role.EMBEDDING] + [Role.LAYER] * (len(numel) - 1), np.int8),
                       np.array(layer), np.full(len(numel), -1))
    phases = {"build": (0, phases["forward"]), "forward": (phases["forward"], phases["backward"]),
              "backward": (phases["backward"], phases["optimizer"]),
              "optimizer": (phases["optimizer"], phases["zero_grad"]), "zero_grad": (phases["zero_grad"], end)}
    return StepTrace(num_layers, 1, 8, table, rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3].astype(np.int8),
                     rows[:, 4], rows[:, 5], end, phases)


def psi(num_layers):
    return EMB + num_layers * sum(LAYER_PARAMS)


CPU = Cluster("cpu", "cpu", 2, 1, 2**34, 2**34, {}, 0.5, 1, 1, 1, 1, 0, 0)
WL32 = Workload(8, 1, "32-true", "adamw_torch", False, "sdpa")


@pytest.mark.parametrize("bucket_view", [True, False])
def test_ddp_peak_is_composed_by_hand_and_extrapolated(bucket_view):
    L = 6
    traces = TraceSet(synthetic_trace(1), synthetic_trace(2), L)
    est = estimate(traces, Strategy("ddp", "ddp"), WL32, CPU,
                   registry_knobs(ddp=DDPConfig(gradient_as_bucket_view=bucket_view)), 2)
    n = psi(L)
    params, buckets, states = 4 * n, 4 * n, 8 * n + 4 * (1 + 2 * L)
    acts = L * ACT_PER_LAYER
    if bucket_view:  # the largest grad exists for one event before it is copied into its bucket
        backward = params + buckets + states + acts + 4 * max(LAYER_PARAMS)
    else:  # the last layer's grads (first in backward) arrive while every activation is alive
        backward = params + buckets + states + acts + 4 * sum(LAYER_PARAMS)
        backward = max(backward, params + buckets + states + 4 * n + ACT_PER_LAYER)
    optimizer = params + buckets + states + 4 * n + (0 if bucket_view else 4 * n)
    assert est.peak_allocated_bytes == max(backward, optimizer)
    assert est.peak_reserved_bytes == est.device_total_bytes == est.peak_allocated_bytes


def _zero(stage, dp, esize=2, **ds):
    cfg = DeepSpeedConfig(reduce_bucket_size=64, allgather_bucket_size=64, **ds)
    return ZeroSetup(stage, False, False, esize, 4, "adamw_torch", cfg, dp)


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_zero_model_states_match_the_paper_with_tiny_buckets(dp):
    """Pos: 2Ψ + 2Ψ + 12Ψ/Nd; Pos+g: 2Ψ + 14Ψ/Nd; Pos+g+p: 16Ψ/Nd (K = 12). DeepSpeed differs
    from the formulas only by: the reduce bucket; one gradient larger than the bucket waiting for
    the next hook; stage 2's partition holding the whole of the (at most 2) parameters that cross
    its edges; padding to dp."""
    small = (2000,) * 16
    t = synthetic_trace(4, esize=2, optimizer=False, layer_params=small)
    n = EMB + 4 * sum(small)
    expected = {1: 4 * n + 12 * n / dp, 2: 2 * n + 14 * n / dp, 3: 16 * n / dp}
    layouts = {1: zero12_layout(t, _zero(1, dp)), 2: zero12_layout(t, _zero(2, dp)),
               3: zero3_layout(t, _zero(3, dp, stage3_param_persistence_threshold=0))}
    got = {s: model_state_bytes(lay) for s, lay in layouts.items()}
    slack = 64 * 2 + 2 * EMB + 2 * 2 * 2000 + 16 * 2 * dp
    for s in (1, 2, 3):
        assert expected[s] <= got[s] <= expected[s] + slack, (s, got[s], expected[s])
    assert got[3] < got[2] < got[1]
    stage0 = model_state_bytes(zero0_layout(t, _zero(0, dp)))
    # bf16 params + bf16 grads + fp32 master + Adam states + a step count per parameter (the
    # unfused wrapper's torch optimizer steps one fp32 master per parameter: embedding + 4 x 16)
    assert stage0 == 16 * n + 4 * (1 + 4 * len(small))
    assert got[1] <= stage0


def test_zero1_reduce_walk_moves_small_gradients_into_the_bucket_before_the_partition_is_allocated():
    from launcher.backends.deepspeed.layout import stage1_unmoved_numel
    # flat [0,100) [100,200) [200,300) [300,1300) [1300,1400), dp=2 -> partitions [0,700) [700,1400):
    # rank 0 holds parameters 0-3, rank 1 parameter 3 (crossing 700) and 4. Buckets of 250 elements
    # in parameter order: [0, 1] [2] [3] (larger than a bucket: alone, never copied into it) [4].
    sizes = [100, 100, 100, 1000, 100]
    assert stage1_unmoved_numel(sizes, 2, 250, 0) == 1400 - 200  # at the first flush
    assert stage1_unmoved_numel(sizes, 2, 250, 1) == 1400 - 300  # at the flush of [3]
    assert stage1_unmoved_numel(sizes, 2, 250, None) == 1200  # rank 0: the bound
    assert stage1_unmoved_numel(sizes, 2, 250, 1, contiguous_gradients=False) == 1400


def test_zero2_gradient_partition_holds_whole_parameters_overlapping_the_partition():
    from launcher.backends.deepspeed.layout import grads_in_partition_numel
    # flat [0,10) [10,30) [30,40), dp=2 -> partitions [0,20) [20,40): rank 1 holds 20 + 10
    assert grads_in_partition_numel([10, 20, 10], 2) == 30


def test_zero3_gathered_parameters_follow_the_reuse_distance():
    sizes = [1000] * 10
    keep_all = _zero(3, 2, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=10**9)
    assert gathered_param_bytes(sizes, keep_all) == (2 * 10_000, True)
    # reuse distance 2 x (numel after it) < 4500 keeps the last three parameters only; the rest
    # are released and prefetched again, every module fetch taking more while fewer than
    # stage3_max_live_parameters elements are gathered: from the LM head back, 1000 at a time,
    # until the sum reaches the limit (5500 -> 6000; 10**9 -> the whole model), but never fewer
    # than the kept ones plus the one being fetched (limit 2000: 3000 + 1000)
    for live, gathered in ((5500, 6000), (10**9, 10_000), (2000, 4000)):
        some = _zero(3, 2, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=4500,
                     stage3_prefetch_bucket_size=500, stage3_max_live_parameters=live)
        assert gathered_param_bytes(sizes, some) == (2 * gathered, False)
    persistent = _zero(3, 2, stage3_param_persistence_threshold=1000)
    assert gathered_param_bytes(sizes, persistent) == (0, True)


def test_trace_request_follows_each_framework():
    wl = Workload(8, 1, "bf16-mixed", "adamw_torch", False, "sdpa")
    assert trace_request(Strategy("ddp", "ddp"), wl) == {
        "param_dtype": "float32", "autocast_dtype": "bfloat16", "optimizer": "adamw_foreach"}
    assert trace_request(Strategy("zero2", "deepspeed", 2), wl) == {
        "param_dtype": "bfloat16", "autocast_dtype": None, "optimizer": "none"}
    true = Workload(8, 1, "bf16-true", "adamw_torch", False, "sdpa")
    assert trace_request(Strategy("zero3", "deepspeed", 3), true)["param_dtype"] == "bfloat16"
    # ZeRO-0 runs bf16-true with the client optimizer on bf16 parameters (a 2-rank DeepSpeed run
    # trains so; see launcher/backends/deepspeed/emit.py unsupported_reason)
    assert trace_request(Strategy("zero0", "deepspeed", 0), true)["param_dtype"] == "bfloat16"
    with pytest.raises(ConfigError, match="bf16-true"):
        trace_request(Strategy("zero2_offload", "deepspeed", 2, offload_optimizer=True), true)
    with pytest.raises(ConfigError, match="16-true"):
        trace_request(Strategy("zero2", "deepspeed", 2), Workload(8, 1, "16-true", "sgd", False, "sdpa"))


def test_gpu_estimate_adds_runtime_terms_and_reserved_covers_allocated():
    gpu = Cluster("a100", "cuda", 2, 1, 80 * 2**30, 2**38, {}, 0.5, 1, 1, 1, 1, 80, 768 * 2**20,
                  nccl_version="2.18.1")
    traces = TraceSet(synthetic_trace(1), synthetic_trace(2), 4)
    cpu = estimate(traces, Strategy("ddp", "ddp"), WL32, CPU, registry_knobs(), 2)
    est = estimate(traces, Strategy("ddp", "ddp"), WL32, gpu, registry_knobs(), 2)
    workspace = 2 * 8_519_680
    assert est.peak_allocated_bytes >= cpu.peak_allocated_bytes + workspace
    assert est.peak_allocated_bytes <= cpu.peak_allocated_bytes + workspace + 512 * 200
    assert est.peak_reserved_bytes >= est.peak_allocated_bytes
    assert est.device_total_bytes == est.peak_reserved_bytes + 768 * 2**20 + 544 * 2**20
    assert any("nccl" in n.lower() for n in est.notes)


@pytest.mark.parametrize("strategy, dp, groups", [
    (Strategy("ddp", "ddp"), 2, [2]),  # DDP: the default process group
    (Strategy("zero2", "deepspeed", 2), 2, [2, 2]),  # + DeepSpeed's clone of it (groups._clone_world_group)
    (Strategy("zero3", "deepspeed", 3), 4, [4, 4]),
    (Strategy("fsdp2", "fsdp2"), 4, [4]),  # a 1-D DeviceMesh over the world reuses the default group
    (Strategy("fsdp2_tp", "fsdp2", tp_size=2), 2, [4, 2, 2]),  # 2-D mesh: a new group per dimension
    (Strategy("fsdp2_tp", "fsdp2", tp_size=2), 1, [2]),  # its tp dimension spans the world
    (Strategy("cai_zero2", "colossalai", zero_stage=2), 2, [2]),  # LowLevelZero on the default group
    (Strategy("cai_tp", "colossalai", tp_size=2), 2, [4, 2, 2]),  # ProcessGroupMesh: dp and tp groups
    (Strategy("cai_pp", "colossalai", pp_size=4), 1, [4, 2, 2]),  # a middle stage: two send/recv pairs
], ids=["ddp", "zero2", "zero3", "fsdp2", "fsdp2_tp", "fsdp2_tp_dp1", "cai_zero2", "cai_tp", "cai_pp"])
def test_device_total_counts_the_nccl_communicators_each_framework_creates(strategy, dp, groups):
    """NCCL buffers live outside the allocator, once per communicator (NVIDIA/nccl issue 964, 4 x A100
    NVLink with an NCCL of 2023: 544 MiB with 2 ranks, 688 MiB with more on rank 0, the head of each
    channel's tree chain; a middle rank of the chain holds one more 6 MiB connection per channel of
    the 24); which communicators a rank holds follows the framework's source (see each `groups`
    comment), not one per run."""
    from launcher.memory.estimate import communicators_note
    from launcher.backends.registry import backend_of

    nccl = sum((544 if n == 2 else 688 + 24 * 6) * 2**20 for n in groups)
    held = backend_of(strategy).communicators(strategy, dp)
    assert sorted(n for n in held if n > 1) == sorted(groups)  # single-rank groups hold no buffers
    assert communicators_note(held, nccl).startswith(f"NCCL: {len(groups)} communicator")
    if strategy.backend in ("ddp", "deepspeed"):  # the whole estimate: NCCL adds to the device total only
        gpu = Cluster("a100", "cuda", dp, 1, 80 * 2**30, 2**38, {}, 0.5, 1, 1, 1, 1, 80, 768 * 2**20,
                      nccl_version="2.18.1")
        traces = TraceSet(synthetic_trace(1, optimizer=False), synthetic_trace(2, optimizer=False), 4)
        est = estimate(traces, strategy, WL32, gpu, registry_knobs(), dp)
        assert est.device_total_bytes - est.peak_reserved_bytes - 768 * 2**20 == nccl


def test_nccl_buffers_per_communicator_match_what_was_measured_on_a100():
    """One communicator's device memory (runtime.py `nccl_bytes`) against NVIDIA/nccl issue 964:
    4 x A100 with NVLink, an NCCL of August 2023 (2.18 or older; cuMem was off by default before
    2.19, NCCL environment variable docs), 544 MiB for a 2-rank process group and 688 MiB on rank 0
    for one of more ranks. The issue does not log its channels; 24 is what NCCL logs for A100s on
    NVSwitch (NVIDIA/nccl-tests issue 100), and both figures come out of it."""
    from launcher.memory.runtime import nccl_bytes

    mib = 2**20
    for version in ((2, 16), (2, 17), (2, 18)):  # the releases with the 512 KiB NVLink p2p chunk
        assert nccl_bytes(2, version, 24, "nvlink") == 544 * mib
        assert nccl_bytes(3, version, 24, "nvlink", chain_head=True, p2p_read=True) == 688 * mib
        assert nccl_bytes(4, version, 24, "nvlink", chain_head=True, p2p_read=True) == 688 * mib
    assert nccl_bytes(1, (2, 18), 24, "nvlink") == 0  # a single rank runs no collective


def test_nccl_buffers_follow_channels_transport_and_release():
    """The mechanisms of `nccl_bytes`, each against the NCCL source it cites: ring buffers scale with
    the channels (NVIDIA/nccl issue 986: 'memory usage is linearly tied to the number of channels');
    shm keeps them in host memory; the init-time p2p pool appears in 2.12 and leaves with 2.22's
    runtime connect; cuMem (2.19+) rounds every small allocation up to 2 MiB."""
    from launcher.memory.runtime import nccl_bytes

    mib = 2**20
    # a 2-rank ring on 2.10 (before the pool, before cuMem) is 12 MiB per channel and nothing else
    assert nccl_bytes(2, (2, 10), 24, "nvlink") == 24 * 12 * mib
    assert nccl_bytes(2, (2, 10), 2, "pcie") == 2 * 12 * mib
    assert nccl_bytes(2, (2, 10), 2, "shm") == 0
    # the pool: 2 MiB per p2p channel (the channels rounded up to a power of two) before 2.16
    assert nccl_bytes(2, (2, 12), 24, "nvlink") - nccl_bytes(2, (2, 11), 24, "nvlink") == 32 * 2 * mib
    # from 2.16, 16 chunks per p2p channel: 512 KiB within an NVLink node, 128 KiB over PCIe
    assert nccl_bytes(2, (2, 16), 24, "nvlink") - nccl_bytes(2, (2, 11), 24, "nvlink") == 32 * 8 * mib
    assert nccl_bytes(2, (2, 16), 2, "pcie") - nccl_bytes(2, (2, 11), 2, "pcie") == 2 * 2 * mib
    assert nccl_bytes(16, (2, 16), 24, "nvlink", num_nodes=2) - nccl_bytes(16, (2, 11), 24, "nvlink", 2) == 32 * 2 * mib
    # cuMem from 2.19: three 2 MiB arrays per p2p channel and the device communicator
    assert nccl_bytes(2, (2, 19), 24, "nvlink") - nccl_bytes(2, (2, 18), 24, "nvlink") == (3 * 32 + 1) * 2 * mib
    # 2.22 connects at the first operation that needs it: a step of collectives makes no pool
    assert nccl_bytes(2, (2, 19), 24, "nvlink") - nccl_bytes(2, (2, 22), 24, "nvlink") == 32 * 8 * mib
    # the worst rank of a longer chain is a middle one: a send and a receive beyond its ring pair
    assert nccl_bytes(8, (2, 18), 24, "nvlink") - nccl_bytes(2, (2, 18), 24, "nvlink") == 24 * 12 * mib
    with pytest.raises(ValueError, match="nvlink, pcie, shm"):
        nccl_bytes(2, (2, 18), 2, "ethernet")


def test_nccl_environment_variables_change_the_buffers_as_nccl_reads_them():
    """The job's NCCL_* variables (runtime.py `nccl_env`), each against the source `nccl_bytes`
    cites: NCCL_BUFFSIZE sizes the Simple buffer (init.cc, default 4 MiB); NCCL_CUMEM_ENABLE=0
    drops the 2 MiB cuMem allocations and, from 2.22, the lazy connections that need cuMem;
    NCCL_P2P_DISABLE=1 or NCCL_P2P_LEVEL=LOC leave shm's host buffers; NCCL_MIN/MAX_NCHANNELS
    clamp the channels; a value NCCL cannot parse leaves its default."""
    from launcher.memory.runtime import NcclEnv, nccl_bytes, nccl_env, nccl_env_note

    mib = 2**20
    assert nccl_env({}) == NcclEnv() and nccl_env({"NCCL_BUFFSIZE": "lots"}) == NcclEnv()
    assert nccl_env({"NCCL_BUFFSIZE": "0x100000"}).buffsize == mib  # NCCL reads it with strtoll, base 0
    # 2 ranks on 2.10, no read: the receiver's 4 KiB + 5.1875 MiB + the Simple buffer, rounded to 2 MiB
    small = nccl_env({"NCCL_BUFFSIZE": str(mib)})
    assert nccl_bytes(2, (2, 10), 24, "nvlink", env=small) == 24 * (8 + 2) * mib
    assert nccl_bytes(2, (2, 10), 24, "nvlink", env=nccl_env({"NCCL_BUFFSIZE": str(8 * mib)})) == 24 * (14 + 2) * mib
    # under P2P read the Simple buffer sits with the sender
    assert nccl_bytes(2, (2, 10), 24, "nvlink", p2p_read=True, env=small) == 24 * (6 + 2) * mib
    off = nccl_env({"NCCL_CUMEM_ENABLE": "0"})
    assert nccl_bytes(2, (2, 19), 24, "nvlink", env=off) == nccl_bytes(2, (2, 18), 24, "nvlink") == 544 * mib
    assert nccl_bytes(2, (2, 27), 24, "nvlink", env=off) == 544 * mib  # no cuMem: connected at init, pool too
    assert nccl_bytes(2, (2, 18), 24, "nvlink", env=nccl_env({"NCCL_CUMEM_ENABLE": "1"})) == 738 * mib
    late = nccl_env({"NCCL_RUNTIME_CONNECT": "0"})
    assert nccl_bytes(2, (2, 27), 24, "nvlink", env=late) - nccl_bytes(2, (2, 27), 24, "nvlink") == 32 * 8 * mib
    for shm in ({"NCCL_P2P_DISABLE": "1"}, {"NCCL_P2P_LEVEL": "LOC"}):
        assert nccl_bytes(2, (2, 10), 24, "nvlink", env=nccl_env(shm)) == 0
    assert nccl_bytes(2, (2, 10), 24, "nvlink", env=nccl_env({"NCCL_MAX_NCHANNELS": "8"})) == 8 * 12 * mib
    assert nccl_bytes(2, (2, 10), 2, "pcie", env=nccl_env({"NCCL_MIN_NCHANNELS": "4"})) == 4 * 12 * mib
    assert nccl_env_note(NcclEnv()) == ""
    assert "NCCL_CUMEM_ENABLE (off)" in nccl_env_note(off)


def test_nvls_is_off_with_nccl_nvls_enable_0():
    """NCCL_NVLS_ENABLE=0 in the job's environment: no NVLS buffers on an NVSwitch node."""
    from launcher.memory.runtime import nccl_env

    traces = TraceSet(synthetic_trace(1, optimizer=False), synthetic_trace(2, optimizer=False), 4)

    def total(env):
        gpu = Cluster("h100", "cuda", 8, 1, 80 * 2**30, 2**38, {}, 0.5, 1, 1, 1, 1, 90, 2**30, nvls=True,
                      nccl_version="2.27.5", nccl_env=nccl_env(env))
        return estimate(traces, Strategy("ddp", "ddp"), WL32, gpu, registry_knobs(), 8).device_total_bytes

    assert total({}) - total({"NCCL_NVLS_ENABLE": "0"}) > 256 * 2**20


def test_device_total_takes_nccl_channels_transport_and_release_from_the_cluster():
    """Two PCIe GPUs with torch 1.12's NCCL 2.10.3 (2 channels: NVIDIA/nccl issue 1190) hold 24 MiB
    per communicator, not the A100 NVLink figure; GPUs without peer-to-peer (shm) hold none of the
    ring buffers on the device; the note names what was assumed."""
    traces = TraceSet(synthetic_trace(1, optimizer=False), synthetic_trace(2, optimizer=False), 4)

    def outside(**nccl):
        gpu = Cluster("titan", "cuda", 2, 1, 24 * 2**30, 2**38, {}, 0.5, 1, 1, 1, 1, 75, 768 * 2**20, **nccl)
        est = estimate(traces, Strategy("ddp", "ddp"), WL32, gpu, registry_knobs(), 2)
        return est.device_total_bytes - est.peak_reserved_bytes - 768 * 2**20, est.notes

    nccl, notes = outside(nccl_version="2.10.3", nccl_channels=2, nccl_transport="pcie")
    assert nccl == 24 * 2**20
    assert any("(NCCL 2.10.3, 2 channels over pcie" in n for n in notes)
    assert outside(nccl_version="2.10.3", nccl_channels=2, nccl_transport="shm")[0] == 0
    assert outside(nccl_version="2.18.1")[0] == 544 * 2**20  # the defaults: 24 channels over NVLink


def test_nvls_buffers_match_what_nccl_logged():
    """NVLS multicast buffers (runtime.py `nvls_bytes`) against NCCL's own logs: NCCL 2.19.3 on 4 x
    H100 bound 1073741824 bytes (NVIDIA/nccl-tests issue 216, 'NVLS Bind mem ... size 1073741824');
    recent releases log about 256 MiB on 8 x H100 (GPU memory notes); NVLS is only set up for
    more than 2 GPUs (vllm-project/vllm issue 9699: 'only enabled for n > 2 GPUs'); releases before
    2.17 have none."""
    from launcher.memory.runtime import nvls_bytes

    assert nvls_bytes(4, (2, 19)) == 1073741824
    assert 256 * 2**20 <= nvls_bytes(8, (2, 27)) <= 260 * 2**20
    assert nvls_bytes(2, (2, 19)) == nvls_bytes(2, (2, 27)) == nvls_bytes(8, (2, 16)) == 0
    # older releases hold more: the 4 MiB NCCL_BUFFSIZE per channel and head, 1 MiB chunks from 2.21
    assert nvls_bytes(8, (2, 19)) > nvls_bytes(8, (2, 21)) > nvls_bytes(8, (2, 23)) > nvls_bytes(8, (2, 27))


@pytest.mark.parametrize("nvls, version", [(False, "2.19.3"), (True, "2.19.3"), (True, "2.27.5")],
                         ids=["no-nvls", "2.19", "2.27"])
def test_device_total_adds_nvls_buffers_per_communicator_on_nvswitch_gpus(nvls, version):
    """On a node with NVLink SHARP each communicator of more than 2 GPUs holds its NVLS buffers
    outside the allocator: ZeRO-3 on 8 GPUs holds two communicators (the default group and
    DeepSpeed's clone), each with 8 GPUs on the node. Reserved does not change; the device total
    and what the step needs do."""
    base = Cluster("h100", "cuda", 8, 1, 80 * 2**30, 2**38, {}, 0.5, 1, 1, 1, 1, 90, 2**30, nccl_version=version)
    gpu = Cluster("h100", "cuda", 8, 1, 80 * 2**30, 2**38, {}, 0.5, 1, 1, 1, 1, 90, 2**30, nvls=nvls,
                  nccl_version=version)
    from launcher.memory.runtime import nccl_version, nvls_bytes

    # + each NVLS channel's device peers, one 2 MiB cuMem allocation per channel of 16 (channel.cc
    # initNvlsChannel) from 2.19
    extra_mib = 2 * (nvls_bytes(8, nccl_version(version)) / 2**20 + 16 * 2) if nvls else 0
    traces = TraceSet(synthetic_trace(1, optimizer=False), synthetic_trace(2, optimizer=False), 4)
    strategy = Strategy("zero3", "deepspeed", 3)
    without = estimate(traces, strategy, WL32, base, registry_knobs(), 8)
    est = estimate(traces, strategy, WL32, gpu, registry_knobs(), 8)
    assert est.peak_reserved_bytes == without.peak_reserved_bytes
    assert est.device_total_bytes - without.device_total_bytes == extra_mib * 2**20
    assert est.needed_bytes - without.needed_bytes == extra_mib * 2**20
    assert any("NVLink SHARP" in n for n in est.notes) == bool(extra_mib)


def test_zero3_linear_stand_in_saves_what_deepspeed_s_linear_saves():
    """The traced F.linear under ZeRO-3 (trace.py `_zero3_linear`) keeps the same tensors for
    backward as DeepSpeed's own `zero3_linear_wrap`: for a frozen weight, the input too."""
    import torch

    linear_mod = pytest.importorskip("deepspeed.runtime.zero.linear")
    from launcher.trace import _zero3_linear

    x = torch.randn(2, 5, 8, requires_grad=True)
    w = torch.randn(4, 8)  # frozen
    original = torch.nn.functional.linear
    with _zero3_linear():
        ours = torch.nn.functional.linear(x, w)
    assert torch.nn.functional.linear is original  # restored after the trace
    theirs = linear_mod.zero3_linear_wrap(x, w)
    shapes = lambda fn: [tuple(t.shape) for t in fn.saved_tensors if t is not None]  # noqa: E731
    assert shapes(ours.grad_fn) == shapes(theirs.grad_fn) == [(2, 5, 8), (4, 8)]
    assert torch.allclose(ours, theirs)
    g = torch.randn_like(ours)
    (gx_ours,) = torch.autograd.grad(ours, x, g)
    (gx_theirs,) = torch.autograd.grad(theirs, x, g)
    assert torch.allclose(gx_ours, gx_theirs)

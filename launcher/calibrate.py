"""mode=calibrate: measure this machine and write a hardware profile (the schema of
conf/hardware/*.yaml, `HardwareConfig` in launcher/config.py) that `hardware=<file>` uses.

`gpus` processes are spawned on this node and measure at the same time, the way training ranks
share the machine (on CPU each gets `cores / processes` threads, as launcher/launch.py gives the
worker):
- dense matmul throughput per dtype (fp32, bf16, fp16): n x n @ n x n for each size in
  `calibrate.matmul_sizes`, 2 n^3 FLOPs each; the best size's median rate is the sustained peak;
- fused attention throughput per dtype: causal scaled_dot_product_attention forward + backward at
  `ATTENTION_SHAPE`, FLOPs by the tracer's formulas;
- per-op overhead: the median time of a tiny elementwise op on 8 elements (no arithmetic to
  speak of: dispatcher, allocation, Python call), forward and backward through autograd;
- memory bandwidth: copying a 64 MiB tensor reads and writes it (2 x 64 MiB moved);
- elementwise rate: elements of fresh outputs per second of mul, add, silu, exp on 1M fp32 elements;
- all-reduce and all-gather bus bandwidth between the local ranks (gloo on CPU, nccl on GPU) for
  each size in `calibrate.collective_mib` and for fp32 and bf16 tensors, with nccl-tests'
  bus-bandwidth convention (doc/PERFORMANCE.md: all-reduce busbw = S/t x 2(n-1)/n, all-gather
  busbw = S/t x (n-1)/n with S the gathered size), and the latency of a 4-byte all-reduce, each
  the mean call of a batch over tensors not in the CPU caches (`collectives`); the
  profile keeps the whole table (`collective_gbps`) and, as the scalar link bandwidths, the
  largest fp32 size's (`largest`);
- on GPU, pinned host -> device copy bandwidth;
- with `calibrate.frameworks=[...]`, each strategy's per-step framework overhead, by training a
  small model through the real worker (launcher/calibrate_frameworks.py).
Every measurement repeats `calibrate.repeats` times after one warm-up; the median is kept.
"""
from __future__ import annotations

import datetime as dt
import itertools
import os
import platform
import socket
import time
from dataclasses import asdict
from pathlib import Path

import yaml

from launcher.config import LauncherConfig
from launcher.calibrate_frameworks import add_to_profile, measure_frameworks
from launcher.errors import ConfigError

GB = 1e9
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def timed_s(fn, repeats: int, sync=lambda: None) -> float:
    """Median wall time of `fn()` over `repeats` runs after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    import statistics  # with fractions and decimal: only when measuring

    return statistics.median(times)


def matmul_tflops(device: str, sizes: list[int], repeats: int, sync) -> dict:
    """Best median TFLOP/s over the sizes, per dtype (2 n^3 FLOPs per n x n matmul)."""
    import torch

    out = {}
    for key, dtype_name in DTYPES.items():
        dtype = getattr(torch, dtype_name)
        rates = []
        for n in sizes:
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            reps = max(1, repeats if n <= 512 or key == "fp32" or device == "cuda" else 2)
            rates.append(2 * n**3 / timed_s(lambda: torch.mm(a, b), reps, sync) / 1e12)
        out[key] = max(rates)
    return out


ATTENTION_SHAPE = (2, 8, 512, 64)
"""(batch, heads, sequence, head dim) of the attention calibration: a 7B-class head dimension."""


def attention_tflops(device: str, repeats: int, sync, shape=ATTENTION_SHAPE) -> dict:
    """Sustained TFLOP/s of causal scaled_dot_product_attention forward + backward per dtype
    (fp32, bf16), its FLOPs counted with the formulas the tracer uses (torch.utils.flop_counter
    `sdpa_flop` / `sdpa_backward_flop`), so FLOPs / rate is the kernel's time."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    b, h, s, d = shape
    flops = sdpa_flop_count((b, h, s, d), (b, h, s, d), (b, h, s, d)) + sdpa_backward_flop_count(
        (b, h, s, d), (b, h, s, d), (b, h, s, d), (b, h, s, d))
    out = {}
    for key in ("fp32", "bf16"):
        dtype = getattr(torch, DTYPES[key])
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

        def step():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        out[key] = flops / timed_s(step, repeats, sync) / 1e12
    return out


def op_overhead_s(device: str, repeats: int, sync, num_ops: int = 2000) -> float:
    """Seconds per tiny op, forward and backward: a chain of `num_ops` multiplications of an
    8-element tensor, then backward (one more op per multiplication); 2 x num_ops ops."""
    import torch

    x = torch.ones(8, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(num_ops):
            y = y * 1.0001
        y.sum().backward()

    return timed_s(chain, repeats, sync) / (2 * num_ops)


def memory_bandwidth_gbps(device: str, repeats: int, sync, num_bytes: int = 64 * 2**20) -> float:
    """GB/s of a large tensor copy (reads and writes `num_bytes` each)."""
    import torch

    src = torch.ones(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / timed_s(lambda: dst.copy_(src), repeats, sync) / GB


def elementwise_gelems_per_s(device: str, repeats: int, sync, numel: int = 1_000_000) -> float:
    """1e9 elements/s of fresh outputs of a chain of elementwise ops (mul, add, silu, exp) on fp32
    tensors of `numel` elements, as a training step's activations are produced (allocation
    included)."""
    import torch

    x, y = torch.randn(numel, device=device), torch.randn(numel, device=device)

    def chain():
        torch.exp(torch.nn.functional.silu(x * y + x))

    return 4 * numel / timed_s(chain, repeats, sync) / 1e9


def host_link_gbps(repeats: int, sync, num_bytes: int = 256 * 2**20) -> float:
    """GB/s of a pinned host -> device copy (GPU only)."""
    import torch

    src = torch.ones(num_bytes // 4).pin_memory()
    return num_bytes / timed_s(lambda: src.to("cuda", non_blocking=True), repeats, sync) / GB


COLLECTIVE_DTYPES = ("fp32", "bf16")


def batched_s(fn, batch: int, repeats: int, sync=lambda: None) -> float:
    """Mean time of one of `batch` back-to-back calls of `fn`, the median over `repeats` batches."""
    def run():
        for _ in range(batch):
            fn()
    return timed_s(run, repeats, sync) / batch


def alpha_beta_gbps(moved_bytes: float, t_s: float, latency_s: float) -> float:
    """Bandwidth of a call that took `t_s` to move `moved_bytes` when each call also costs
    `latency_s` (t = latency + bytes / bandwidth); a time within the latency's noise counts as
    1% of itself, so the rate stays finite."""
    return moved_bytes / max(t_s - latency_s, t_s / 100) / GB


def collectives(device: str, sizes_mib: list[float], repeats: int, sync) -> dict:
    """Bus bandwidth (GB/s) of all-reduce, all-gather and reduce-scatter (how ZeRO-3 reduces
    gradients) per dtype (fp32, bf16: gloo sums 16-bit elements at a different rate) and message
    size, as {"all_reduce_fp32": {MiB: GB/s}, ...}, and the 4-byte all-reduce latency.
    Reduce-scatter's bus bytes are (n-1)/n of the message (nccl-tests' convention). The
    alpha-beta model the speed model uses (a call costs the latency plus bytes / bandwidth,
    launcher/host_time.py) takes the latency out of each timing before dividing:
    bandwidth = bus bytes / (t - latency).
    Each call works on the next of `COLD_BYTES / size` distinct random tensors, round-robin, as a
    training step reduces a new gradient bucket each call (reusing one tensor would time messages
    that fit the CPU caches hot), and a timing is a batch of up to `BATCH` calls back to back,
    divided by their number: the speed model adds the calls' costs, so it needs their mean, and
    gloo calls on a busy 2-core machine have a long tail (the mean of a 0.4 MB all-reduce is about
    twice its median on the development VM)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    tiny = torch.ones(1, device=device)
    latency_s = batched_s(lambda: dist.all_reduce(tiny), BATCH, max(repeats, 20), sync)
    out = {"collective_gbps": {}, "latency_s": latency_s}
    gbps = lambda moved, t_s: alpha_beta_gbps(moved, t_s, latency_s)  # noqa: E731
    for key in COLLECTIVE_DTYPES:
        dtype = getattr(torch, DTYPES[key])
        size = torch.empty(0, dtype=dtype).element_size()
        reduce, gather, scatter = {}, {}, {}
        for mib in sizes_mib:
            numel = int(mib * 2**20) // size // n * n
            fulls = _cold_tensors(numel, dtype, device)
            shards = _cold_tensors(numel // n, dtype, device, len(fulls))
            nxt, batch = itertools.cycle(range(len(fulls))), min(len(fulls), BATCH)
            reduce[mib] = gbps(numel * size * 2 * (n - 1) / n,
                               batched_s(lambda: dist.all_reduce(fulls[next(nxt)]), batch, repeats, sync))
            gather[mib] = gbps(numel * size * (n - 1) / n,
                               batched_s(lambda: dist.all_gather_into_tensor(fulls[(k := next(nxt))], shards[k]),
                                         batch, repeats, sync))
            scatter[mib] = gbps(numel * size * (n - 1) / n,
                                batched_s(lambda: dist.reduce_scatter_tensor(shards[(k := next(nxt))], fulls[k]),
                                          batch, repeats, sync))
            del fulls, shards
        out["collective_gbps"][f"all_reduce_{key}"] = reduce
        out["collective_gbps"][f"all_gather_{key}"] = gather
        out["collective_gbps"][f"reduce_scatter_{key}"] = scatter
    return out


BATCH = 16
"""Collective calls per timing (`collectives`): their mean is what a step of many calls pays."""
COLD_BYTES = 64 * 2**20
"""Bytes the timed collectives cycle through per message size: well above a server CPU's last-level
cache per core, so each call reads memory no earlier call left in the caches (`collectives`)."""


def _cold_tensors(numel: int, dtype, device: str, count: int | None = None) -> list:
    """`count` (default: COLD_BYTES worth, at least 2) random tensors of `numel` elements. Values
    stay finite: random normals summed over a few ranks and at most a few dozen calls."""
    import torch

    nbytes = max(1, numel * torch.empty(0, dtype=dtype).element_size())
    count = count or max(2, -(-COLD_BYTES // nbytes))
    return [torch.randn(numel, device=device).to(dtype) for _ in range(count)]


def _rank_main(rank: int, world: int, port: int, device: str, threads: int, cal: dict, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    reps = cal["repeats"]
    result = {"peak_tflops": matmul_tflops(device, cal["matmul_sizes"], reps, sync),
              "attention_tflops": attention_tflops(device, reps, sync),
              "op_overhead_s": op_overhead_s(device, reps, sync),
              "memory_bandwidth_gbps": memory_bandwidth_gbps(device, reps, sync),
              "elementwise_gelems_per_s": elementwise_gelems_per_s(device, reps, sync)}
    if device == "cuda":
        result["host_link_bandwidth_gbps"] = host_link_gbps(reps, sync)
    dist.barrier()
    result["collectives"] = collectives(device, cal["collective_mib"], reps, sync)
    queue.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def measure_machine(device: str, num_ranks: int, cal: dict) -> list[dict]:
    """Spawn `num_ranks` processes that measure together; one result per rank."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    threads = max(1, (os.cpu_count() or 1) // num_ranks)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_rank_main, args=(num_ranks, port, device, threads, cal, queue), nprocs=num_ranks,
                       join=True, start_method="spawn")
    return [r for _, r in sorted(queue.get() for _ in range(num_ranks))]


def profile_from(base: dict, results: list[dict], device: str, num_ranks: int) -> dict:
    """The base profile with every measured number replaced by the slowest rank's value."""
    worst = lambda key: min(r[key] for r in results)  # noqa: E731
    tflops = {k: min(r["peak_tflops"][k] for r in results) for k in DTYPES}
    prof = dict(base)
    prof.update(
        name=f"{base['name']}-calibrated",
        calibrated_on=cpu_model(),
        source=f"launcher mode=calibrate on {machine_name()}, {num_ranks} processes, {dt.date.today().isoformat()}",
        peak_tflops={**tflops, "tf32": base.get("peak_tflops", {}).get("tf32", tflops["fp32"])
                     if device == "cuda" else tflops["fp32"]},
        matmul_efficiency=1.0 if device == "cpu" else base.get("matmul_efficiency", 0.5),
        attention_tflops={k: min(r["attention_tflops"][k] for r in results) for k in results[0]["attention_tflops"]},
        memory_bandwidth_gbps=worst("memory_bandwidth_gbps"),
        elementwise_gelems_per_s=worst("elementwise_gelems_per_s"),
        op_overhead_s=max(r["op_overhead_s"] for r in results),
        collective_latency_s=max(r["collectives"]["latency_s"] for r in results),
        intra_node_bandwidth_gbps=min(largest(r["collectives"]["collective_gbps"]["all_reduce_fp32"]) for r in results),
        all_gather_bandwidth_gbps=min(largest(r["collectives"]["collective_gbps"]["all_gather_fp32"]) for r in results),
        collective_gbps={key: {float(mib): min(r["collectives"]["collective_gbps"][key][mib] for r in results)
                               for mib in by_size}
                         for key, by_size in results[0]["collectives"]["collective_gbps"].items()},
    )
    if device == "cuda":
        prof["host_link_bandwidth_gbps"] = worst("host_link_bandwidth_gbps")
    else:  # offload on CPU processes is a copy within the same RAM
        prof["host_link_bandwidth_gbps"] = prof["memory_bandwidth_gbps"]
    return prof


def largest(by_size: dict) -> float:
    """The bandwidth at the largest message size: the speed model adds the per-call latency
    separately, so it wants the bandwidth-bound regime (gloo's all-gather slows down as messages
    grow, so the best size would overstate it for gathering millions of parameters)."""
    return by_size[max(by_size, key=float)]


def cpu_model() -> str:
    """This machine's CPU model ('model name' in /proc/cpuinfo), else platform.processor()."""
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def machine_name() -> str:
    return f"{socket.gethostname()} ({cpu_model()}, {os.cpu_count()} cores)"


def other_machine_note(hw) -> str | None:
    """A note when a CPU profile measured on another CPU model plans for this machine's processes
    (its speed numbers are that machine's), else None."""
    if hw.device != "cpu" or not hw.calibrated_on or hw.calibrated_on == cpu_model():
        return None
    return (f"note: hardware={hw.name} was calibrated on {hw.calibrated_on}; this machine is {cpu_model()}: "
            f"its speed estimates are the other machine's. Measure this one: "
            f"python -m launcher mode=calibrate hardware=cpu gpus=2, then hardware=<the written profile>")


def main(config: LauncherConfig, run_dir: Path) -> Path:
    """Measure, write RUN_DIR/hardware/<name>-calibrated.yaml and calibration.json; return the profile path."""
    import json

    from omegaconf import OmegaConf

    device = config.hardware.device
    if device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < config.gpus:
            raise ConfigError(f"mode=calibrate with hardware={config.hardware.name} needs {config.gpus} local GPUs; "
                              "use hardware=cpu to calibrate CPU processes")
    cal = asdict(config.calibrate)
    results = measure_machine(device, config.gpus, cal)
    base = OmegaConf.to_container(OmegaConf.structured(config.hardware), enum_to_str=True)
    prof = profile_from(base, results, device, config.gpus)
    path = run_dir / "hardware" / f"{prof['name']}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# {prof['name']}: measured by `python -m launcher mode=calibrate hardware={config.hardware.name} "
              f"gpus={config.gpus}` ({prof['source']}).\n# Raw measurements per rank: ../calibration.json\n")
    prof.pop("framework_overhead_s", None)  # the framework runs measure against the other terms alone
    path.write_text(header + yaml.safe_dump(prof, sort_keys=False))
    frameworks = []
    if config.calibrate.frameworks:
        overhead, frameworks = measure_frameworks(
            list(config.calibrate.frameworks), list(config.calibrate.framework_depths),
            config.calibrate.framework_timing_steps, path, config.gpus, run_dir / "frameworks",
            rounds=config.calibrate.framework_rounds)
        add_to_profile(path, overhead)
        prof = yaml.safe_load(path.read_text())
    (run_dir / "calibration.json").write_text(
        json.dumps({"ranks": results, "frameworks": frameworks, "profile": prof}, indent=2) + "\n")
    print(yaml.safe_dump(prof, sort_keys=False), end="")
    print(f"\nprofile: {path}\nuse it: python -m launcher hardware={path} ...")
    return path

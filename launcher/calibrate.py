"""mode=calibrate: measure this machine and write a hardware profile (the schema of
conf/hardware/*.yaml, `HardwareConfig` in launcher/config.py) that `hardware=<file>` uses.

`gpus` processes are spawned on this node and measure at the same time, the way training ranks
share the machine (on CPU each gets `cores / processes` threads, as launcher/launch.py gives the
worker):
- dense matmul throughput per dtype (fp32, bf16, fp16): n x n @ n x n for each size in
  `calibrate.matmul_sizes`, 2 n^3 FLOPs each; the best size's median rate is the sustained peak;
- per-op overhead: the median time of a tiny elementwise op on 8 elements (no arithmetic to
  speak of: dispatcher, allocation, Python call), forward and backward through autograd;
- memory bandwidth: copying a 64 MiB tensor reads and writes it (2 x 64 MiB moved);
- elementwise rate: bytes of fresh outputs per second of mul, add, silu, exp on 1M fp32 elements;
- all-reduce and all-gather bus bandwidth between the local ranks (gloo on CPU, nccl on GPU) for
  each size in `calibrate.collective_mib`, with nccl-tests' bus-bandwidth convention
  (doc/PERFORMANCE.md: all-reduce busbw = S/t x 2(n-1)/n, all-gather busbw = S/t x (n-1)/n with
  S the gathered size), and the latency of a 4-byte all-reduce; the profile keeps the largest
  size's bandwidth (`largest`);
- on GPU, pinned host -> device copy bandwidth;
- with `calibrate.frameworks=[...]`, each strategy's per-step framework overhead, by training a
  small model through the real worker (launcher/calibrate_frameworks.py).
Every measurement repeats `calibrate.repeats` times after one warm-up; the median is kept.
"""
from __future__ import annotations

import datetime as dt
import os
import platform
import socket
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import yaml

from launcher.config import LauncherConfig

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


def elementwise_gbps(device: str, repeats: int, sync, numel: int = 1_000_000) -> float:
    """GB/s of fresh outputs of a chain of elementwise ops (mul, add, silu, exp) on fp32 tensors
    of `numel` elements, as a training step's activations are produced (allocation included)."""
    import torch

    x, y = torch.randn(numel, device=device), torch.randn(numel, device=device)

    def chain():
        torch.exp(torch.nn.functional.silu(x * y + x))

    return 4 * numel * 4 / timed_s(chain, repeats, sync) / GB


def host_link_gbps(repeats: int, sync, num_bytes: int = 256 * 2**20) -> float:
    """GB/s of a pinned host -> device copy (GPU only)."""
    import torch

    src = torch.ones(num_bytes // 4).pin_memory()
    return num_bytes / timed_s(lambda: src.to("cuda", non_blocking=True), repeats, sync) / GB


def collectives(device: str, sizes_mib: list[float], repeats: int, sync) -> dict:
    """Bus bandwidth (GB/s) of all-reduce and all-gather per size, and the 4-byte all-reduce latency."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    out = {"all_reduce_gbps": {}, "all_gather_gbps": {}}
    for mib in sizes_mib:
        num_bytes = int(mib * 2**20) // 4 * 4
        t = torch.ones(num_bytes // 4, device=device)
        t_s = timed_s(lambda: dist.all_reduce(t), repeats, sync)
        out["all_reduce_gbps"][mib] = num_bytes / t_s * 2 * (n - 1) / n / GB
        shard = torch.ones(num_bytes // 4 // n, device=device)
        full = torch.empty(shard.numel() * n, device=device)
        t_s = timed_s(lambda: dist.all_gather_into_tensor(full, shard), repeats, sync)
        out["all_gather_gbps"][mib] = full.numel() * 4 / t_s * (n - 1) / n / GB
    tiny = torch.ones(1, device=device)
    out["latency_s"] = timed_s(lambda: dist.all_reduce(tiny), max(repeats, 20), sync)
    return out


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
              "op_overhead_s": op_overhead_s(device, reps, sync),
              "memory_bandwidth_gbps": memory_bandwidth_gbps(device, reps, sync),
              "elementwise_gbps": elementwise_gbps(device, reps, sync)}
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
        source=f"launcher mode=calibrate on {machine_name()}, {num_ranks} processes, {dt.date.today().isoformat()}",
        peak_tflops={**tflops, "tf32": base.get("peak_tflops", {}).get("tf32", tflops["fp32"])
                     if device == "cuda" else tflops["fp32"]},
        matmul_efficiency=1.0 if device == "cpu" else base.get("matmul_efficiency", 0.5),
        memory_bandwidth_gbps=worst("memory_bandwidth_gbps"),
        elementwise_gbps=worst("elementwise_gbps"),
        op_overhead_s=max(r["op_overhead_s"] for r in results),
        collective_latency_s=max(r["collectives"]["latency_s"] for r in results),
        intra_node_bandwidth_gbps=min(largest(r["collectives"]["all_reduce_gbps"]) for r in results),
        all_gather_bandwidth_gbps=min(largest(r["collectives"]["all_gather_gbps"]) for r in results),
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


def machine_name() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{socket.gethostname()} ({cpu}, {os.cpu_count()} cores)"


def main(config: LauncherConfig, run_dir: Path) -> Path:
    """Measure, write RUN_DIR/hardware/<name>-calibrated.yaml and calibration.json; return the profile path."""
    import json

    from omegaconf import OmegaConf

    device = config.hardware.device
    if device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < config.gpus:
            from launcher.errors import ConfigError

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
        from launcher.calibrate_frameworks import add_to_profile, measure_frameworks

        overhead, frameworks = measure_frameworks(
            list(config.calibrate.frameworks), list(config.calibrate.framework_depths),
            config.calibrate.framework_timing_steps, path, config.gpus, run_dir / "frameworks")
        add_to_profile(path, overhead)
        prof = yaml.safe_load(path.read_text())
    (run_dir / "calibration.json").write_text(
        json.dumps({"ranks": results, "frameworks": frameworks, "profile": prof}, indent=2) + "\n")
    print(yaml.safe_dump(prof, sort_keys=False), end="")
    print(f"\nprofile: {path}\nuse it: python -m launcher hardware={path} ...")
    return path

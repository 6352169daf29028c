"""Hardware profiles -> Cluster, and detection of local GPUs."""
from __future__ import annotations

import re
import shutil
import subprocess

from launcher.config import HardwareConfig
from launcher.memory.runtime import DEFAULT_NCCL_VERSION, nccl_env
from launcher.types import Cluster

DEFAULT_PROFILE = "a100-80g"

# nvidia-smi product names -> profile names (checked in order; first match wins).
_NAME_PATTERNS = (
    (r"H200", "h200"),
    (r"H100", "h100-80g"),
    (r"A100.*80", "a100-80g"),
    (r"A100", "a100-40g"),
    (r"L40S", "l40s"),
    (r"\bL4\b", "l4"),
    (r"A10G", "a10g"),
    (r"RTX A6000|A6000", "a6000"),
    (r"4090", "rtx4090"),
    (r"3090", "rtx3090"),
    (r"V100.*32", "v100-32g"),
    (r"V100", "v100-16g"),
)


def local_gpu_names() -> list[str]:
    """Names of local NVIDIA GPUs from `nvidia-smi -L` (empty without a GPU or driver)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [m.group(1) for m in re.finditer(r"GPU \d+: (.+?) \(UUID", out)]


def detect_local_profile(profiles: list[str]) -> tuple[str, str]:
    """(profile, note) for the local GPUs, or the default profile when there are none."""
    names = local_gpu_names()
    if not names:
        return DEFAULT_PROFILE, (f"no local GPU found: planning for hardware={DEFAULT_PROFILE}; "
                                 "pass hardware=<name> to plan for another GPU, hardware=cpu to run on CPU")
    for pattern, profile in _NAME_PATTERNS:
        if re.search(pattern, names[0]) and profile in profiles:
            return profile, f"detected {len(names)} x {names[0]}: hardware={profile}"
    return DEFAULT_PROFILE, f"unknown local GPU '{names[0]}': planning for hardware={DEFAULT_PROFILE}"


def expandable_segments(cuda_alloc_conf: str | None) -> bool:
    """Whether a PYTORCH_CUDA_ALLOC_CONF value turns expandable segments on (torch's
    CUDAAllocatorConfig parses comma-separated `key:value` options; the last one wins)."""
    value = None
    for option in (cuda_alloc_conf or "").split(","):
        key, _, v = option.partition(":")
        if key.strip() == "expandable_segments":
            value = v.strip()
    return value == "True"


def cluster_from(hw: HardwareConfig, num_gpus: int, num_nodes: int, cuda_alloc_conf: str | None = None,
                 environ=None) -> Cluster:
    """The devices a plan runs on; `cuda_alloc_conf`: the PYTORCH_CUDA_ALLOC_CONF the job will run
    with, and `environ` the environment whose NCCL_* variables it will run with (the caller's
    environment, which torchrun and sbatch hand down); None = NCCL's defaults."""
    return Cluster(
        hardware=hw.name, device=hw.device, num_gpus=num_gpus, num_nodes=num_nodes,
        memory_bytes=int(hw.memory_bytes), host_memory_bytes=int(hw.host_memory_bytes),
        peak_tflops=dict(hw.peak_tflops), matmul_efficiency=float(hw.matmul_efficiency),
        memory_bandwidth_gbps=float(hw.memory_bandwidth_gbps),
        intra_node_bandwidth_gbps=float(hw.intra_node_bandwidth_gbps),
        inter_node_bandwidth_gbps=float(hw.inter_node_bandwidth_gbps),
        host_link_bandwidth_gbps=float(hw.host_link_bandwidth_gbps),
        sm_arch=int(hw.sm_arch), cuda_context_bytes=int(hw.cuda_context_bytes),
        op_overhead_s=float(hw.op_overhead_s), collective_latency_s=float(hw.collective_latency_s),
        all_gather_bandwidth_gbps=None if hw.all_gather_bandwidth_gbps is None else float(hw.all_gather_bandwidth_gbps),
        elementwise_gelems_per_s=None if hw.elementwise_gelems_per_s is None else float(hw.elementwise_gelems_per_s),
        framework_overhead_s={k: [float(x) for x in v] for k, v in (hw.framework_overhead_s or {}).items()},
        collective_gbps={k: {float(mib): float(g) for mib, g in v.items()} for k, v in (hw.collective_gbps or {}).items()},
        attention_tflops={k: float(v) for k, v in (hw.attention_tflops or {}).items()},
        expandable_segments=hw.device == "cuda" and expandable_segments(cuda_alloc_conf),
        nvls=bool(hw.nvls), nccl_version=job_nccl_version(hw) if hw.device == "cuda" else None,
        nccl_channels=int(hw.nccl_channels), nccl_transport=str(hw.nccl_transport),
        nccl_env=nccl_env(environ or {}),
    )


def job_nccl_version(hw: HardwareConfig) -> str:
    """`hardware.nccl_version`, or when null the installed NCCL wheel's (`installed_nccl_version`)."""
    return str(hw.nccl_version) if hw.nccl_version else installed_nccl_version()


def installed_nccl_version() -> str:
    """The release (major.minor.patch) of the NCCL wheel torch's CUDA builds load (nvidia-nccl-cu12
    or -cu13, read from the package metadata without importing torch; a post-release suffix such
    as 2.26.2.post1 is dropped), or DEFAULT_NCCL_VERSION without one."""
    from importlib import metadata

    for name in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"):
        try:
            release = re.match(r"\d+\.\d+(\.\d+)?", metadata.version(name))
        except metadata.PackageNotFoundError:
            continue
        if release:
            return release.group(0)
    return DEFAULT_NCCL_VERSION

"""Where and in what precision the model runs: device, dtype `auto`, thread count.

`auto` means bf16 where the hardware computes it natively (CUDA; CPUs with AMX or
AVX512-BF16, where oneDNN runs bf16 matmuls at twice fp32's rate and half its
memory traffic) and fp32 elsewhere (emulated bf16 is slower than fp32 there).
PDSERVE_DTYPE in the environment overrides what `auto` resolves to, as it sets
--dtype for the services.
"""
from __future__ import annotations

import logging
import math
import os

import torch

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
_NATIVE_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def select_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_native_bf16(flags: set[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in _NATIVE_BF16_CPU_FLAGS)


def select_dtype(dtype: str, device: torch.device, flags: set[str] | None = None) -> torch.dtype:
    if dtype == "auto":
        dtype = os.environ.get("PDSERVE_DTYPE") or "auto"
    if dtype == "auto":
        native_bf16 = device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16(flags))
        chosen = torch.bfloat16 if native_bf16 else torch.float32
        why = "CUDA" if device.type == "cuda" else ("the CPU computes bf16 natively" if native_bf16
                                                    else "the CPU has no native bf16 (AMX or AVX512-BF16)")
        logger.info("dtype auto -> %s (%s)", str(chosen).removeprefix("torch."), why)
        return chosen
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def set_num_threads(num_threads: int | None) -> None:
    """This process's torch intra-op threads. None: torch's default (one per CPU this
    process may run on), lowered to the CPU quota of its cgroup where that is smaller.

    Processes sharing a host (a prefill and a decode instance) each get their share,
    or their threads contend for the same cores and both slow down. A container's quota
    (`docker run --cpus`, compose `cpus:`, a Kubernetes CPU limit) hides nothing from
    torch, which counts the host's cores: with more threads than the quota, the group
    uses up each period's share early and the kernel stops every thread until the next
    period, while the others wait at the step's barriers for one it stopped."""
    why = ""
    if num_threads is None:
        num_threads, why = _threads_within_cpu_quota()
        if num_threads is None:
            return
    torch.set_num_threads(num_threads)
    logger.info("torch threads: %d%s", num_threads, why)


def num_cpus_available() -> int:
    """The CPUs this process may run on (its affinity), no more than its cgroup's quota."""
    num_cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    return num_cpus if quota is None else max(1, min(num_cpus, math.floor(quota)))


def _threads_within_cpu_quota() -> tuple[int | None, str]:
    if os.environ.get("OMP_NUM_THREADS"):
        return None, ""  # the user's own count, which torch already took
    quota = cgroup_cpu_quota()
    if quota is None or quota >= torch.get_num_threads():
        return None, ""
    return max(1, math.floor(quota)), f" (the cgroup's CPU quota: {quota:g} CPUs)"


def cgroup_cpu_quota(proc_dir: str = "/proc/self") -> float | None:
    """The CPUs per period this process's cgroups allow it (the smallest quota of its cgroup
    and every parent's, cgroup v1 `cpu.cfs_quota_us` or v2 `cpu.max`), or None without one."""
    cgroup_paths = {}  # "v1" / "v2" -> this process's cgroup path in that hierarchy
    try:
        with open(f"{proc_dir}/cgroup") as f:
            for line in f:
                hierarchy_id, controllers, path = line.rstrip("\n").split(":", 2)
                if hierarchy_id == "0" and controllers == "":
                    cgroup_paths["v2"] = path
                elif "cpu" in controllers.split(","):
                    cgroup_paths["v1"] = path
        with open(f"{proc_dir}/mountinfo") as f:
            mount_lines = f.read().splitlines()
    except (OSError, ValueError):
        return None
    quotas = []
    for line in mount_lines:
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 5 or len(fields) < sep + 4:
            continue
        mount_root, mount_point = fields[3], fields[4]
        fs_type, super_options = fields[sep + 1], fields[sep + 3]
        if fs_type == "cgroup2" and "v2" in cgroup_paths:
            version = "v2"
        elif fs_type == "cgroup" and "cpu" in super_options.split(",") and "v1" in cgroup_paths:
            version = "v1"
        else:
            continue
        relative = os.path.relpath(cgroup_paths[version], mount_root)
        if relative.startswith(".."):
            relative = "."  # its cgroup lies outside what is mounted: the mount's root is the nearest
        directory = os.path.normpath(os.path.join(mount_point, relative))
        while True:
            quota = _read_cpu_quota(directory, version)
            if quota is not None:
                quotas.append(quota)
            if directory == os.path.normpath(mount_point) or directory == os.path.dirname(directory):
                break
            directory = os.path.dirname(directory)
    return min(quotas) if quotas else None


def _read_cpu_quota(directory: str, version: str) -> float | None:
    try:
        if version == "v2":
            with open(os.path.join(directory, "cpu.max")) as f:
                quota_us, period_us = f.read().split()[:2]
            if quota_us == "max":
                return None
        else:
            with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
                quota_us = f.read().strip()
            with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
                period_us = f.read().strip()
        quota, period = int(quota_us), int(period_us)
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None  # v1 writes -1 for no quota

"""How many CPUs this process may keep busy: its affinity, lowered to its cgroup's CPU quota.

torch counts the cores it may run on (honouring affinity) but not a quota (`docker run
--cpus`, compose `cpus:`, a Kubernetes CPU limit). Threads beyond the quota use up each
period's share early; the kernel then stops all of them until the next period, while the
others wait at a step's barriers for one it stopped. Pure Python and torch-free, so that
`pdserve up` (which divides the CPUs among its processes) reads the same figure.
"""
from __future__ import annotations

import math
import os


def num_cpus_available() -> int:
    """The CPUs this process may run on (its affinity), no more than its cgroup's quota."""
    num_cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    return num_cpus if quota is None else max(1, min(num_cpus, math.floor(quota)))


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

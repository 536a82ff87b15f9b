"""A real cgroup allowed one CPU per period, for tests of what a process does under a CPU
quota (a container's `--cpus 1`). Needs root, a writable cgroup v1 cpu hierarchy and two
CPUs; where any is missing the test is skipped."""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def _writable_cpu_cgroup_root() -> Path | None:
    if os.geteuid() != 0:
        return None
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        fields = line.split()
        sep = fields.index("-") if "-" in fields else -1
        if sep > 0 and fields[sep + 1] == "cgroup" and "cpu" in fields[sep + 3].split(","):
            root = Path(fields[4])
            if os.access(root, os.W_OK) and (root / "cpu.cfs_quota_us").exists():
                return root
    return None


@contextlib.contextmanager
def one_cpu_cgroup() -> Iterator[Path]:
    """A new cgroup with a quota of one CPU, removed on the way out: start processes in it
    with fresh_process.run_python(..., cgroup=group)."""
    root = _writable_cpu_cgroup_root()
    if root is None or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs root, a writable cgroup v1 cpu hierarchy and two CPUs")
    group = root / f"pdserve-test-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
        yield group
    finally:
        deadline = time.monotonic() + 10
        while True:  # an exited child leaves the group a moment later
            try:
                group.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

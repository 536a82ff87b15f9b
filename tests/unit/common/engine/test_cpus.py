"""The CPUs a process may keep busy: cgroup v1 and v2 CPU quotas read as the kernel applies
them (the smallest up the tree, under whatever root the hierarchy is mounted at)."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from common.engine.cpus import cgroup_cpu_quota, num_cpus_available
from tests.support.cpu_cgroup import one_cpu_cgroup
from tests.support.fresh_process import run_python


def _fake_proc(tmp_path: Path, cgroup: str, mounts: list[str]) -> str:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text("".join(line + "\n" for line in mounts))
    return str(proc)


def _write(path: Path, text: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, value in (line.split("=", 1) for line in text.split()):
        (path / name).write_text(value.replace("_", " ") + "\n")


def test_cgroup_v1_quota_is_read_under_the_mounts_root(tmp_path):
    # A container without a cgroup namespace: its path is the host's, mounted at its own root.
    cpu = tmp_path / "cpu"  # the host's /kubepods
    _write(cpu, "cpu.cfs_quota_us=-1 cpu.cfs_period_us=100000")
    _write(cpu / "pod1", "cpu.cfs_quota_us=150000 cpu.cfs_period_us=100000")
    proc = _fake_proc(tmp_path, "4:cpu,cpuacct:/kubepods/pod1\n0::/\n",
                      [f"32 31 0:29 /kubepods {cpu} rw - cgroup cgroup rw,cpu,cpuacct"])
    assert cgroup_cpu_quota(proc) == 1.5


def test_cgroup_v2_takes_the_smallest_quota_of_the_cgroup_and_its_parents(tmp_path):
    root = tmp_path / "unified"
    _write(root / "a", "cpu.max=200000_100000")
    _write(root / "a" / "b", "cpu.max=max_100000")
    proc = _fake_proc(tmp_path, "0::/a/b\n", [f"30 23 0:27 / {root} rw - cgroup2 cgroup2 rw"])
    assert cgroup_cpu_quota(proc) == 2.0


def test_cgroup_v2_in_a_namespaced_container_reads_its_own_root(tmp_path):
    # Docker on cgroup v2 (cgroupns private): the container's cgroup is the mount's root.
    root = tmp_path / "unified"
    _write(root, "cpu.max=150000_100000")
    proc = _fake_proc(tmp_path, "0::/\n", [f"30 23 0:27 / {root} ro,nosuid - cgroup2 cgroup rw,nsdelegate"])
    assert cgroup_cpu_quota(proc) == 1.5


@pytest.mark.parametrize("cgroup, mounts", [
    ("0::/\n", ["30 23 0:27 / {root} rw - cgroup2 cgroup2 rw"]),  # no cpu.max: the host's root
    ("1:cpuacct:/x\n", ["33 31 0:30 / {root} rw - cgroup cgroup rw,cpuacct"]),  # no cpu controller
    ("", []),
])
def test_no_quota_is_none(tmp_path, cgroup, mounts):
    root = tmp_path / "fs"
    _write(root / "x", "cpu.cfs_quota_us=100000 cpu.cfs_period_us=100000")
    proc = _fake_proc(tmp_path, cgroup, [m.format(root=root) for m in mounts])
    assert cgroup_cpu_quota(proc) is None
    assert cgroup_cpu_quota(str(tmp_path / "missing")) is None


def test_num_cpus_available_is_the_affinity_without_a_quota_and_the_quota_within_one():
    assert 1 <= num_cpus_available() <= len(os.sched_getaffinity(0))
    script = textwrap.dedent("""
        import os
        from common.engine.cpus import num_cpus_available
        print(len(os.sched_getaffinity(0)), num_cpus_available())
    """)
    with one_cpu_cgroup() as group:
        done = run_python(script, timeout_s=60, cgroup=group)
    num_affinity, num_available = map(int, done.stdout.split())
    assert num_affinity >= 2
    assert num_available == 1

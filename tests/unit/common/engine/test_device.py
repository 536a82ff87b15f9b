"""dtype auto follows the hardware (native bf16: CUDA, AMX, AVX512-BF16; else fp32), and the
default thread count follows the CPUs a process may use (its affinity and its cgroup's quota)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from common.engine.device import cgroup_cpu_quota, select_dtype, set_num_threads

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_dtype_override(monkeypatch):
    monkeypatch.delenv("PDSERVE_DTYPE", raising=False)


@pytest.mark.parametrize("flags, expected", [
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),
    ({"avx512f", "amx_tile", "amx_bf16"}, torch.bfloat16),
    ({"avx2", "avx512f"}, torch.float32),  # bf16 would be emulated: slower than fp32
    (set(), torch.float32),
])
def test_auto_picks_bf16_only_where_the_cpu_computes_it(flags, expected, caplog):
    with caplog.at_level(logging.INFO, logger="common.engine.device"):
        assert select_dtype("auto", CPU, flags) == expected
    assert f"dtype auto -> {str(expected).removeprefix('torch.')}" in caplog.text


def test_auto_is_bf16_on_cuda():
    assert select_dtype("auto", torch.device("cuda"), set()) == torch.bfloat16


def test_environment_overrides_auto_but_not_an_explicit_dtype(monkeypatch):
    monkeypatch.setenv("PDSERVE_DTYPE", "float32")
    assert select_dtype("auto", CPU, {"avx512_bf16"}) == torch.float32
    assert select_dtype("bfloat16", CPU, set()) == torch.bfloat16


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of auto"):
        select_dtype("float8", CPU, set())


def test_num_threads_sets_this_processes_torch_threads():
    previous = torch.get_num_threads()
    try:
        set_num_threads(1)
        assert torch.get_num_threads() == 1
        set_num_threads(None)  # leaves torch's choice alone
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)



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


def _writable_cpu_cgroup_root() -> Path | None:
    """A cgroup v1 cpu hierarchy this process may create children in (as root), or None."""
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


def test_default_threads_follow_a_real_cgroups_cpu_quota():
    """A process in a cgroup allowed one CPU of several starts one torch thread, not one per core."""
    root = _writable_cpu_cgroup_root()
    if root is None or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs root, a writable cgroup v1 cpu hierarchy and two CPUs")
    group = root / f"pdserve-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
        script = textwrap.dedent("""
            import torch
            from common.engine.device import set_num_threads
            before = torch.get_num_threads()
            set_num_threads(None)
            print(before, torch.get_num_threads())
        """)
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        result = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
        assert result.returncode == 0, result.stderr
        before, after = map(int, result.stdout.split())
        assert before >= 2  # torch counted the cores, not the quota
        assert after == 1
    finally:
        deadline = time.monotonic() + 10
        while True:  # the exited child leaves the group a moment later
            try:
                group.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

"""Where this machine can build the native CPU libraries (kernels/cpu/build.py: a C++
compiler; for the GEMVs and the decode loop AVX2 and FMA), each one builds and loads. Their
own test modules skip where a library is unavailable, so a source that stopped compiling
would otherwise show up only as skipped tests. The cache keeps a few recent builds of each
library, not every one ever made."""
from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kernels._backend import switched_off
from kernels.cpu import build
from kernels.cpu.build import cpu_flags, find_compiler
from kernels.cpu_attention import native_attention_error
from kernels.cpu_decode import native_decode_available
from kernels.cpu_linear import GEMV_CPU_FLAGS, native_gemv_available, panel_gemm_available
from kernels.cpu_sampling import native_argmax_available

FLAGS = set(cpu_flags().split())
needs_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C++ compiler here")
needs_avx2 = pytest.mark.skipif(not GEMV_CPU_FLAGS <= FLAGS, reason="no AVX2 and FMA here")


@needs_compiler
def test_the_attention_and_the_argmax_build_and_load():
    assert native_attention_error() is None, native_attention_error()
    if not switched_off("PDSERVE_CPU_ARGMAX"):
        assert native_argmax_available()


@needs_compiler
@needs_avx2
@pytest.mark.skipif(switched_off("PDSERVE_CPU_GEMV"), reason="PDSERVE_CPU_GEMV=0")
def test_the_gemvs_and_the_decode_loop_build_and_load_in_the_build_the_cpu_takes():
    assert native_gemv_available()  # the library's log names the compiler's error otherwise
    if not os.environ.get("PDSERVE_CPU_MARCH"):  # built for this CPU, not an older target
        assert panel_gemm_available() == ("avx512_bf16" in FLAGS)
    assert native_decode_available()


def _fake_build(directory, name, key, age_s):
    path = directory / f"{name}-{key}.so"
    path.write_bytes(b"")
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_only_the_most_recently_used_builds_of_a_library_stay(tmp_path):
    builds = [_fake_build(tmp_path, "gemv", f"{i:016x}", age_s=100 * i) for i in range(8)]
    others = [_fake_build(tmp_path, "gemv_other", "0" * 16, age_s=10**6),
              _fake_build(tmp_path, "sampling", "f" * 16, age_s=10**6)]
    dead_temp = tmp_path / ".gemv-abc123.so"
    dead_temp.write_bytes(b"")
    os.utime(dead_temp, (time.time() - 10**5, time.time() - 10**5))
    building_temp = tmp_path / ".gemv-def456.so"  # a build under way in another process
    building_temp.write_bytes(b"")

    removed = build.prune_builds(tmp_path, "gemv", keep=3)

    assert sorted(removed) == sorted(builds[3:] + [dead_temp])
    assert sorted(tmp_path.iterdir()) == sorted(builds[:3] + others + [building_temp])


def test_a_cached_build_counts_as_used_and_a_new_build_prunes(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    compiled = []

    def fake_compiler(command, **kwargs):  # writes the library g++ would have written
        output = Path(command[command.index("-o") + 1])
        output.write_bytes(b"built")
        compiled.append(output)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(build.subprocess, "run", fake_compiler)
    monkeypatch.setattr(build, "find_compiler", lambda: "/usr/bin/true")
    library = build.build_library("sampling")
    assert len(compiled) == 1 and library.read_bytes() == b"built"
    os.utime(library, (time.time() - 10**4, time.time() - 10**4))
    old = [_fake_build(tmp_path, "sampling", f"{i:016x}", age_s=10 + i) for i in range(build.KEEP_BUILDS)]

    assert build.build_library("sampling") == library  # from the cache: now the newest
    assert len(compiled) == 1 and time.time() - library.stat().st_mtime < 60

    monkeypatch.setattr(build, "compiler_identity", lambda cxx: "another g++")
    rebuilt = build.build_library("sampling")
    assert len(compiled) == 2 and rebuilt != library
    kept = sorted(p for p in tmp_path.iterdir())
    lock = tmp_path / ".sampling.lock"  # one per library, kept: processes take turns on it
    assert kept == sorted([rebuilt, library, *old[:build.KEEP_BUILDS - 2], lock])


def test_processes_building_one_library_at_once_run_the_compiler_once(monkeypatch, tmp_path):
    # A stack's engines start side by side on a machine that has not built the library:
    # the second waits on the first's build and loads its library. (flock locks belong to
    # open files, so two threads stand for two processes here.)
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "find_compiler", lambda: "/usr/bin/true")
    first_compiling, second_waiting = threading.Event(), threading.Event()
    compiled = []

    def fake_compiler(command, **kwargs):
        compiled.append(command)
        first_compiling.set()
        assert second_waiting.wait(timeout=30), "the second builder never reached the lock"
        Path(command[command.index("-o") + 1]).write_bytes(b"built")
        return subprocess.CompletedProcess(command, 0, "", "")

    real_flock = build.fcntl.flock
    lock_calls = []

    def flock(file, operation):
        if operation == build.fcntl.LOCK_EX:
            lock_calls.append(file)
            if len(lock_calls) == 2:
                second_waiting.set()
        return real_flock(file, operation)

    monkeypatch.setattr(build.subprocess, "run", fake_compiler)
    monkeypatch.setattr(build.fcntl, "flock", flock)
    libraries = []
    first = threading.Thread(target=lambda: libraries.append(build.build_library("sampling")))
    first.start()
    assert first_compiling.wait(timeout=30)
    second = threading.Thread(target=lambda: libraries.append(build.build_library("sampling")))
    second.start()
    first.join(timeout=60)
    second.join(timeout=60)
    assert len(compiled) == 1
    assert len(libraries) == 2 and libraries[0] == libraries[1] and libraries[0].read_bytes() == b"built"


def test_the_suite_builds_every_library_up_front():
    # tests/conftest.py starts tests/support/prebuild.py beside the pytest-xdist workers: a
    # library it missed would be built by one worker's first test while the other waits.
    from tests.support.prebuild import JOBS
    assert {source.stem for source in build.SOURCE_DIR.glob("*.cpp")} <= set(JOBS)


def test_the_attention_library_s_second_part_holds_the_pairs_python_splits_off():
    # kernels/cpu_attention.py builds in two parts exactly when a pair of the second is
    # chosen; a pair the C++ moved without Python knowing would be declared but never built.
    import re

    from kernels.cpu_attention import DTYPE_PAIRS, SECOND_PART_DTYPE_PAIRS

    source = (Path(build.SOURCE_DIR) / "paged_attention.cpp").read_text()
    in_second_part = {macro for macro, body in re.findall(r"#ifdef PDSERVE_ATTENTION_(\w+)\n(.*?)#endif", source,
                                                          re.DOTALL)
                      if "PDSERVE_PART_1_PAIR(" in body}
    assert in_second_part == {DTYPE_PAIRS[pair] for pair in SECOND_PART_DTYPE_PAIRS}


@needs_compiler
def test_a_build_in_two_parts_runs_two_compilers_at_once_and_links_them(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    real_run = subprocess.run
    running, most_running, commands = [0], [0], []
    lock = threading.Lock()

    def counting_run(command, **kwargs):
        with lock:
            commands.append(command)
            running[0] += 1
            most_running[0] = max(most_running[0], running[0])
        try:
            return real_run(command, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(build.subprocess, "run", counting_run)
    defines = ("PDSERVE_ATTENTION_HEAD_DIMS_NAMED", "PDSERVE_ATTENTION_DTYPES_NAMED", "PDSERVE_ATTENTION_F32",
               "PDSERVE_ATTENTION_BF16")
    library = build.build_library("paged_attention", defines, num_parts=2)
    assert [sorted(a for a in c if a.startswith("-DPDSERVE_BUILD_PART")) for c in commands] in (
        [["-DPDSERVE_BUILD_PART=0"], ["-DPDSERVE_BUILD_PART=1"], []],
        [["-DPDSERVE_BUILD_PART=1"], ["-DPDSERVE_BUILD_PART=0"], []])
    assert most_running[0] == 2 and "-c" not in commands[-1]
    symbols = real_run(["nm", "-C", "--defined-only", str(library)], capture_output=True, text=True).stdout
    assert "claim_work<float, float>" in symbols and "claim_work<c10::BFloat16, c10::BFloat16>" in symbols
    assert sorted(p.name for p in tmp_path.iterdir()) == [".paged_attention.lock", library.name]

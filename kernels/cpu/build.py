"""Compile a C++ torch-op library once per machine and load it into this process.

g++ is driven directly (not torch.utils.cpp_extension.load): that needs ninja and the
Python headers, which the slim image lacks, and the ops need neither (they register
through TORCH_LIBRARY, so the .so is loaded with torch.ops.load_library).

The library lands in <cache>/<name>-<key>.so, key = hash of the source and the headers
beside it, the compiler (its file and flags), torch's version and commit and the CPU's
flags, so a changed source, compiler, torch or machine (-march=native) builds afresh and
everything else reuses it. Where torch is installed is not part of the key: every
virtualenv (a fresh clone's, the image's) with the same torch shares one build, and the
library finds libc10/libtorch_cpu as the ones torch has already loaded (same soname).
Concurrent builders (several service processes starting at once) take turns on a lock
file per library; the first builds (to a temp file it renames), the others then find its
library. A build marks its library used (its mtime) and each new build removes
all but the KEEP_BUILDS most recently used of that library, so upgrades of pdserve, torch
or the compiler do not pile up libraries in the cache.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch
from torch.utils import cpp_extension

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
# -fopenmp: at::parallel_for is inlined from ATen's OpenMP header, so without it the
# kernel would run on one thread. The library's libgomp.so.1 resolves to the copy torch
# already loaded (same soname), so it shares torch's thread pool and thread count.
CXX_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-std=c++20", "-shared", "-fPIC",
             "-w", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
BUILD_TIMEOUT_S = 600
# Per library: enough for the builds one machine uses side by side (native; the AVX2 and
# baseline builds the tests take; attention's head-dim and dtype choices) with two torch versions or
# sources (a release and a checkout); an older one that is still wanted is rebuilt, never lost.
KEEP_BUILDS = 8


class BuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    """PDSERVE_KERNEL_CACHE, else $XDG_CACHE_HOME/pdserve/kernels (~/.cache/pdserve/kernels)."""
    if os.environ.get("PDSERVE_KERNEL_CACHE"):
        return Path(os.environ["PDSERVE_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve" / "kernels"


def target_arch() -> str:
    """PDSERVE_CPU_MARCH (e.g. x86-64-v3 for AVX2 machines), else native: this CPU's best."""
    return os.environ.get("PDSERVE_CPU_MARCH") or "native"


def find_compiler() -> str | None:
    """$CXX if set (a missing one means no compiler), else g++ or c++ on PATH."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return shutil.which("g++") or shutil.which("c++")


def cpu_flags() -> str:
    """The CPU's feature flags (/proc/cpuinfo's flags line; torch's capability name elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


def _compile_flags() -> list[str]:
    """The flags of a build, in its cache key; where torch's headers and libraries lie is not."""
    return [f"-march={target_arch()}", *CXX_FLAGS]


def _compiler(cxx: str, defines: tuple[str, ...]) -> list[str]:
    """The compiler with this build's flags, -D macros and torch's include paths."""
    return [cxx, *_compile_flags(), *[f"-D{d}" for d in defines], *[f"-I{p}" for p in cpp_extension.include_paths()]]


def _command(cxx: str, source: Path, output: Path, defines: tuple[str, ...] = ()) -> list[str]:
    """Compile and link source into the library output."""
    return [*_compiler(cxx, defines), str(source), "-o", str(output), *_link_flags()]


def _part_command(cxx: str, source: Path, output: Path, defines: tuple[str, ...], part: int) -> list[str]:
    """Compile part `part` of source into the object file output."""
    return [*_compiler(cxx, (*defines, f"PDSERVE_BUILD_PART={part}")), "-c", str(source), "-o", str(output)]


def _link_flags() -> list[str]:
    torch_lib = cpp_extension.library_paths()[0]
    return [f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]


def compiler_identity(cxx: str) -> str:
    """The compiler's real file with its size and modification time: an upgraded g++ at
    the same path is a different compiler."""
    real = os.path.realpath(cxx)
    st = os.stat(real)
    return f"{real} {st.st_size} {st.st_mtime_ns}"


def build_library(name: str, defines: tuple[str, ...] = (), num_parts: int = 1) -> Path:
    """Path of the compiled kernels/cpu/<name>.cpp (with these -D macros: another build of
    the same library, under its own key), building it if the cache lacks it. num_parts > 1
    compiles it as that many translation units side by side, each with
    -DPDSERVE_BUILD_PART=<0..num_parts-1> (the source says what each holds), then links them:
    the same library, built on more cores."""
    cxx = find_compiler()
    if cxx is None:
        raise BuildError("no C++ compiler (set CXX or install g++)")
    source = SOURCE_DIR / f"{name}.cpp"
    sources = [p.read_text() for p in sorted(SOURCE_DIR.glob("*.h"))] + [source.read_text()]
    key = hashlib.sha256("\0".join([*sources, compiler_identity(cxx), *_compile_flags(), *defines, torch.__version__,
                                    str(torch.version.git_version), cpu_flags()]).encode()).hexdigest()[:16]
    out_dir = cache_dir()
    library = out_dir / f"{name}-{key}.so"
    if library.exists():
        _mark_used(library)
        return library
    out_dir.mkdir(parents=True, exist_ok=True)
    # Services starting side by side (a stack's prefill and decode engines) would each run
    # g++ for every library on the same cores (~33 s of one core for the five here): one
    # builds, the others wait for it and load its library.
    with open(out_dir / f".{name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            if library.exists():  # built while this process waited
                _mark_used(library)
                return library
            return _build(cxx, name, source, library, out_dir, defines, num_parts)
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _build(cxx: str, name: str, source: Path, library: Path, out_dir: Path, defines: tuple[str, ...],
           num_parts: int) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=out_dir)
    os.close(fd)
    started = time.monotonic()
    try:
        if num_parts == 1:
            _run_compilers(cxx, [_command(cxx, source, Path(tmp), defines)], BUILD_TIMEOUT_S)
        else:
            with tempfile.TemporaryDirectory(prefix=f"pdserve-{name}-") as parts_dir:
                objects = [Path(parts_dir) / f"part{part}.o" for part in range(num_parts)]
                _run_compilers(cxx, [_part_command(cxx, source, obj, defines, part)
                                     for part, obj in enumerate(objects)], BUILD_TIMEOUT_S)
                link = [cxx, *_compile_flags(), *map(str, objects), "-o", tmp, *_link_flags()]
                _run_compilers(cxx, [link], max(1.0, BUILD_TIMEOUT_S - (time.monotonic() - started)))
        os.replace(tmp, library)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{cxx} could not build {source.name}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s in %.1fs -> %s", source.name, time.monotonic() - started, library)
    prune_builds(out_dir, name)
    return library


def _run_compilers(cxx: str, commands: list[list[str]], timeout_s: float) -> None:
    """Run the commands side by side; BuildError naming the first that failed, once all
    ended. One past timeout_s is killed (subprocess.TimeoutExpired)."""
    def run(command: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)

    with ThreadPoolExecutor(max_workers=len(commands), thread_name_prefix="g++") as pool:
        results = list(pool.map(run, commands))
    for done in results:
        if done.returncode != 0:
            raise BuildError(f"{cxx} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def _mark_used(library: Path) -> None:
    try:
        os.utime(library)
    except OSError:  # a read-only cache (an image's) is pruned by whoever writes it
        pass


def prune_builds(out_dir: Path, name: str, keep: int = KEEP_BUILDS) -> list[Path]:
    """Remove all but the keep most recently used builds of library name in out_dir, and
    the temp files of its builds that died (older than any build may take); the paths
    removed. A process that has a removed library loaded keeps its mapping."""
    build_name = re.compile(rf"{re.escape(name)}-[0-9a-f]{{16}}\.so")
    temp_name = re.compile(rf"\.{re.escape(name)}-.+\.so")
    builds, dead_temps = [], []
    now = time.time()
    for entry in out_dir.iterdir():
        try:
            mtime = entry.stat().st_mtime
        except OSError:  # removed meanwhile by another process
            continue
        if build_name.fullmatch(entry.name):
            builds.append((mtime, entry))
        elif temp_name.fullmatch(entry.name) and now - mtime > 2 * BUILD_TIMEOUT_S:
            dead_temps.append(entry)
    builds.sort(reverse=True)
    removed = []
    for path in [path for _, path in builds[keep:]] + dead_temps:
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    if removed:
        log.info("removed %d old build(s) of %s from %s", len(removed), name, out_dir)
    return removed


_load_locks: dict[str, threading.Lock] = {}
_load_locks_guard = threading.Lock()


def _load_lock(name: str) -> threading.Lock:
    """One build and one load_library per library, whichever thread asks first; each
    library has its own lock, so two build side by side."""
    with _load_locks_guard:
        return _load_locks.setdefault(name, threading.Lock())


def load_ops(name: str, fakes: dict[str, Callable], defines: tuple[str, ...] = (), num_parts: int = 1) -> str | None:
    """Build (once per machine) and load kernels/cpu/<name>.cpp into this process and give
    its ops their fake implementations (qualified op name -> fake) for torch.compile.
    None once loaded, else why it cannot be; a second call finds the ops loaded (whatever
    its defines: one process holds one build of a library, its ops registered once)."""
    with _load_lock(name):
        namespace, _, op = next(iter(fakes)).partition("::")
        if hasattr(getattr(torch.ops, namespace), op):
            return None
        try:
            torch.ops.load_library(str(build_library(name, defines, num_parts)))
        except (BuildError, OSError, RuntimeError) as e:
            return str(e)
        for qualified_name, fake in fakes.items():
            torch.library.register_fake(qualified_name)(fake)
        return None

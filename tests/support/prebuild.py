"""What a machine builds once for the suite, built up front: the native CPU libraries
(kernels/cpu, as the suite's processes load them) and the bundled model's conversion.

Where they are missing (a new machine, a changed kernel source), the two pytest-xdist
workers' first tests each wait for them: one worker built the libraries and converted the
model one after another while the other waited on their locks, a core idle for the first
~100 s of the parallel part (the Zen 4 EPYC, 2026-12-07). tests/conftest.py starts this
beside the workers: each of them runs on a thread of its own (g++ in processes of its own,
the conversion in this one), so both cores build from the start; a test that
needs one waits on the same lock (kernels/cpu/build.py, model_files.convert_gguf) and
loads what was built here. Where all are built it finds them and exits (~2 CPU-seconds).

    python -m tests.support.prebuild
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

# Imported here, before the threads: two threads importing kernels.cpu.build at once deadlock.
from common.engine.model_files import resolve_model
from kernels.cpu.build import BuildError, build_library, cpu_flags
from kernels.cpu_attention import native_attention_error
from kernels.cpu_linear import GEMV_CPU_FLAGS


def _attention() -> str | None:
    return native_attention_error()  # the build the suite's environment chooses (tests/conftest.py)


def _library(name: str, cpu_needs: frozenset[str] = frozenset()) -> Callable[[], str | None]:
    def build() -> str | None:
        if not cpu_needs <= set(cpu_flags().split()):
            return None  # no engine loads it on this CPU
        try:
            build_library(name)
        except BuildError as e:
            return str(e)
        return None
    return build


def _bundled_model() -> str | None:
    resolve_model()
    return None


# The attention library first: the longest build (two g++ side by side, ~42 s on the Zen 4 EPYC).
JOBS: dict[str, Callable[[], str | None]] = {
    "paged_attention": _attention,
    "decode_layers": _library("decode_layers", GEMV_CPU_FLAGS),
    "gemv": _library("gemv", GEMV_CPU_FLAGS),
    "bundled model": _bundled_model,
    "sampling": _library("sampling"),
    "arena_cache": _library("arena_cache"),
}


def main() -> int:
    """Run every job at once; print how each went. 1 if any failed (the tests that need it
    then build it themselves and say why it fails)."""
    failures: dict[str, str] = {}

    def run(name: str, job: Callable[[], str | None]) -> None:
        started = time.monotonic()
        try:
            error = job()
        except Exception as e:  # reported, not raised: a thread's exception would be lost
            error = f"{type(e).__name__}: {e}"
        if error is not None:
            failures[name] = error
        print(f"{name}: {'failed: ' + error if error else 'ready'} after {time.monotonic() - started:.1f}s",
              flush=True)

    threads = [threading.Thread(target=run, args=item, name=f"prebuild-{item[0]}") for item in JOBS.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

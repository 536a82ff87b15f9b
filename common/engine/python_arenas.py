"""Keep the memory CPython frees for its frame stack and object arenas, instead of
unmapping it (kernels/cpu/arena_cache.cpp says why: every munmap interrupts the other
cores to flush their TLBs). A decode step's Python crosses a 16 KiB frame-stack chunk
boundary tens of times per token; on the 2-core Zen 4 EPYC a bf16 single stream went from
a median of 75 to 85 tokens/s with the cache (docs/benchmarks.md, "Python's frame stack").

Installed once per engine process, before the model loads; PDSERVE_KEEP_PY_ARENAS=0 turns
it off. Without a C++ compiler the interpreter keeps its own allocator (one log line)."""
from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading

logger = logging.getLogger(__name__)


class _ArenaAllocator(ctypes.Structure):
    """CPython's PyObjectArenaAllocator."""
    _fields_ = [("ctx", ctypes.c_void_p), ("alloc", ctypes.c_void_p), ("free", ctypes.c_void_p)]


_installed: ctypes.CDLL | None = None  # the loaded library, kept for the life of the process
_unavailable: str | None = None  # why it could not be built or loaded: not tried again
_install_lock = threading.Lock()


def keep_freed_arenas() -> str | None:
    """Put the cache in front of this interpreter's arena allocator; None once it is in
    place (a second call finds it), else why not."""
    global _installed, _unavailable
    if os.environ.get("PDSERVE_KEEP_PY_ARENAS", "1") == "0":
        return "PDSERVE_KEEP_PY_ARENAS=0"
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return "the interpreter runs without its GIL, which the cache relies on"
    with _install_lock:
        if _installed is not None:
            return None
        if _unavailable is not None:  # every engine of the process asks; one build attempt, one log line
            return _unavailable
        from kernels.cpu.build import BuildError, build_library
        try:
            library = ctypes.CDLL(str(build_library("arena_cache")))
        except (BuildError, OSError) as e:
            logger.info("Python's freed arenas are unmapped as usual (%s)", e)
            _unavailable = str(e)
            return _unavailable
        library.pdserve_arena_cache_context.restype = ctypes.c_void_p
        context = library.pdserve_arena_cache_context()
        get_allocator = ctypes.pythonapi.PyObject_GetArenaAllocator
        get_allocator.argtypes = [ctypes.c_void_p]
        get_allocator.restype = None
        set_allocator = ctypes.pythonapi.PyObject_SetArenaAllocator
        set_allocator.argtypes = [ctypes.POINTER(_ArenaAllocator)]
        set_allocator.restype = None
        get_allocator(context)  # the cache's first field: where a miss and an overflow go
        cached = _ArenaAllocator(context,
                                 ctypes.cast(library.pdserve_arena_cache_alloc, ctypes.c_void_p).value,
                                 ctypes.cast(library.pdserve_arena_cache_free, ctypes.c_void_p).value)
        set_allocator(ctypes.byref(cached))  # CPython copies the struct
        _installed = library
        logger.debug("Python's freed arenas and frame-stack chunks are kept for reuse")
        return None


def arena_cache_counts() -> dict[str, int] | None:
    """How the cache has served this process (None where it is not installed):
    num_reused (allocations from kept blocks), num_passed_on (allocations it left to the
    interpreter's own allocator) and num_released (blocks it gave back)."""
    if _installed is None:
        return None
    counts = (ctypes.c_uint64 * 3)()
    _installed.pdserve_arena_cache_counts(counts)
    return {"num_reused": counts[0], "num_passed_on": counts[1], "num_released": counts[2]}

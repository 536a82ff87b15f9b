"""Keep the memory glibc's malloc frees for tensors, instead of handing it back to the kernel.

torch's CPU allocator is plain malloc. By default glibc serves a block of more than 128 KiB
(a threshold it raises only after such a block is freed) with an mmap of its own and
unmaps it on free, and trims the heap's top past 128 KiB: a step's activations (a
2,048-token prefill's MLP output is 12 MiB) come back as fresh pages each step, every page
faulted in and zeroed by the kernel, and every munmap interrupts the other cores to flush
their TLBs. A mixed run of the offline bench took ~90,000 page faults this way (~0.2 s of
kernel time); kept, ~60. vLLM's CPU guide preloads tcmalloc for the same reason.

Blocks of up to 32 MiB (glibc's largest mmap threshold) come from the heap and stay there;
what a process keeps is bounded by its largest step's working set. A service's engine
steps run on its AsyncEngine thread, not the main one, and glibc gives such a thread an
arena of its own made of 64 MiB heaps, each unmapped whole once nothing in it is in use,
whatever the trim threshold: a 2,048-token step's activations took fresh heaps, faulted in
again, every step (10% of a served embedding load's samples in the kernel clearing pages,
24.8 req/s; with one arena 29.7, `docs/benchmarks.md`). So services share the main arena
(share_main_arena, set by common.service.lifecycle before any other thread mallocs); the
offline engine steps on the main thread and keeps glibc's per-thread arenas. Set once per engine
process, before the model loads; PDSERVE_KEEP_FREED_HEAP=0 leaves glibc's defaults, as
does a C library other than glibc (one log line)."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MMAP_THRESHOLD_BYTES = 32 << 20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 2**31 - 1  # the largest mallopt takes: the heap's top is not trimmed

_settled: str | None | bool = False  # False: not tried yet; None: in place; str: why not


def keep_freed_heap() -> str | None:
    """Tell glibc's malloc to keep what it frees; None once in place (a second call finds
    it so), else why not."""
    global _settled
    if os.environ.get("PDSERVE_KEEP_FREED_HEAP", "1") == "0":
        return "PDSERVE_KEEP_FREED_HEAP=0"
    if _settled is not False:
        return _settled
    _settled = _apply()
    if _settled is None:
        logger.debug("malloc keeps freed blocks of up to %d MiB", MMAP_THRESHOLD_BYTES >> 20)
    else:
        logger.info("malloc returns freed memory to the kernel as usual (%s)", _settled)
    return _settled


def _apply() -> str | None:
    libc_name, _ = platform.libc_ver()
    if libc_name != "glibc":
        return f"the C library is {libc_name or 'not glibc'}"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    for parameter, value in ((_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES), (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)):
        if mallopt(parameter, value) != 1:
            return f"mallopt({parameter}, {value}) was refused"
    return None


def share_main_arena() -> bool:
    """Every thread that mallocs from now on takes glibc's main arena (M_ARENA_MAX 1): for a
    process whose engine runs off the main thread (a service), called on the main thread
    before any other thread mallocs. False where the C library is not glibc or refuses."""
    if os.environ.get("PDSERVE_KEEP_FREED_HEAP", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return libc.mallopt(ctypes.c_int(_M_ARENA_MAX), ctypes.c_int(1)) == 1


def release_freed_heap() -> bool:
    """Hand what malloc holds free back to the kernel once (glibc's malloc_trim(0)): after
    loading, where the weights as read from disk were freed once each linear made its own
    copies (kept otherwise, since keep_freed_heap turned trimming off), and before the
    steps' working set comes to stay. Whether glibc released anything."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc.malloc_trim(0) == 1

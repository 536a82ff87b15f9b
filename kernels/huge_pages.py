"""CPU tensors in memory that Linux backs with 2 MiB pages (transparent huge pages).

A decode step streams every weight once; with 4 KiB pages each 4 KiB costs a TLB miss
and a page walk. On the 2-core Zen 4 EPYC the bf16 GEMV over SmolLM2's 30 layers (212 MB)
took 8.9 ms a pass (median) from ordinary memory and 7.5 ms from huge pages. Most systems
run THP in "madvise" mode, where only memory advised with MADV_HUGEPAGE gets them, and
torch's allocator advises none (unless THP_MEM_ALLOC_ENABLE is set before its first
allocation).

The KV cache lives there too (common/engine/model_runner.py: allocate_paged_kv): a decode
step's attention reads each sequence's blocks scattered over a pool of a GiB, and on 4 KiB
pages the TLB caps that read (fp32 at batch 64, context 256, 30 layers' pool: 0.75 -> 0.62
ms a layer; bf16 0.49 -> 0.36 ms, the 2-core Zen 5 EPYC). `zeros_on_huge_pages` hands out
fresh memory, which reads as zero with nothing written, and `populate_in_background` faults
its pages in on a thread that takes at most about a quarter of a core: on a VM whose host
backs guest memory only when first touched, a fresh huge page can take milliseconds (1 GiB:
7.2 s on the Zen 4 EPYC's VM, against 0.66 s on 4 KiB pages; 2 GiB 0.33-0.64 s on the Zen 5's),
which neither a start nor its first requests should wait for (docs/benchmarks.md, "The KV pool
on huge pages again").

`on_huge_pages(t)` copies a tensor into such memory, `empty_on_huge_pages` (for a caller
that writes it whole) and `zeros_on_huge_pages` allocate there: small tensors share 32 MiB
chunks (64-byte aligned pieces, each tensor with a storage of its own; a chunk lives while
any of its tensors does), large ones get their own region; every region starts on a 2 MiB
boundary. Where THP is off ("never"), outside Linux, or with PDSERVE_HUGE_PAGES=0, they
return ordinary tensors. Memory is never handed out twice, so a copy costs only its own
bytes; pages of a chunk that nothing touched are not resident.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import os
import sys
import threading
import time
from pathlib import Path

import torch

from kernels._backend import switched_off

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
SMALL_PAGE_BYTES = mmap.PAGESIZE
# madvise(2) advice (Linux 5.14+) that faults pages in as if written, without writing: safe
# beside threads that write the same memory. Python 3.11's mmap module has no name for it.
MADV_POPULATE_WRITE = 23
CHUNK_BYTES = 32 << 20  # tensors up to half of this share chunks
ALIGN_BYTES = 64
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def huge_pages_available() -> bool:
    """Whether advised memory can get huge pages here (checked once per process)."""
    if switched_off("PDSERVE_HUGE_PAGES"):
        return False
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = THP_MODE_FILE.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def _region(num_bytes: int) -> tuple[mmap.mmap, int]:
    """A zeroed mapping advised to huge pages, and the offset in it of its first 2 MiB boundary."""
    size = math.ceil(num_bytes / HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES + HUGE_PAGE_BYTES
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    address = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    return region, -address % HUGE_PAGE_BYTES


def _tensor(region: mmap.mmap, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor over region[offset:], with a storage of its own (no view of another
    tensor: a compiled graph sees unrelated inputs, whose mutations need no alias analysis).
    The storage holds the mapping until it goes."""
    flat = torch.frombuffer(region, dtype=dtype, count=math.prod(shape), offset=offset)
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return torch.empty(0, dtype=dtype).set_(flat.untyped_storage(), 0, shape, strides)


class _Chunks:
    """Hands out pieces of the current chunk, then of a new one; never reuses a piece."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: mmap.mmap | None = None
        self._offset = 0
        self._end = 0

    def take(self, num_bytes: int) -> tuple[mmap.mmap, int]:  # a region and a 64-byte aligned offset in it
        if num_bytes > CHUNK_BYTES // 2:
            return _region(num_bytes)
        with self._lock:
            if self._chunk is None or self._offset + num_bytes > self._end:
                self._chunk, self._offset = _region(CHUNK_BYTES)
                self._end = self._offset + CHUNK_BYTES
            offset = self._offset
            self._offset += math.ceil(num_bytes / ALIGN_BYTES) * ALIGN_BYTES
            return self._chunk, offset


_CHUNKS = _Chunks()


def _empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """Fresh huge-page memory for a contiguous tensor (reads as zero), or None where there is none."""
    num_bytes = math.prod(shape) * dtype.itemsize
    if not huge_pages_available() or num_bytes == 0:
        return None
    region, offset = _CHUNKS.take(num_bytes)
    return _tensor(region, offset, shape, dtype)


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor in huge-page memory where available, for the caller to fill
    whole (its pages fault in as it writes); else an ordinary empty one."""
    tensor = _empty_on_huge_pages(shape, dtype)
    return torch.empty(shape, dtype=dtype) if tensor is None else tensor


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in huge-page memory where available (else an
    ordinary contiguous copy)."""
    copy = _empty_on_huge_pages(tuple(tensor.shape), tensor.dtype) if tensor.device.type == "cpu" else None
    if copy is None:
        return tensor.detach().clone(memory_format=torch.contiguous_format)
    return copy.copy_(tensor.detach())  # the copy faults the pages in


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros in huge-page memory where available (fresh memory,
    so nothing is written and no page is faulted in yet); else torch.zeros."""
    tensor = _empty_on_huge_pages(shape, dtype)
    return torch.zeros(shape, dtype=dtype) if tensor is None else tensor


def whole_small_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """The addresses [start, end) of the 4 KiB pages wholly inside the tensor's bytes
    (start >= end where none is)."""
    start = -(-tensor.data_ptr() // SMALL_PAGE_BYTES) * SMALL_PAGE_BYTES
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // SMALL_PAGE_BYTES * SMALL_PAGE_BYTES
    return start, end


# The faulting runs a piece at a time, each followed by a pause three times its length: at
# most about a quarter of a core, at normal priority. Not at SCHED_IDLE: a process killed
# outright (SIGKILL, the OOM killer) ends only when its last thread has run its exit, and an
# idle-priority thread on busy cores waits seconds for them, holding the process's sockets
# and pipes open all that while, so its executor or gateway sees the death seconds late (a
# worker killed beside two busy processes: 5-10 s against 0.1 s).
POPULATE_PIECE_BYTES = 32 << 20
POPULATE_PAUSE_RATIO = 3.0
# The populating threads this process started (wait_until_populated joins them).
_POPULATING: list[threading.Thread] = []
_POPULATING_LOCK = threading.Lock()


def _populate(spans: list[tuple[int, int]], _tensors: list[torch.Tensor], stop: threading.Event) -> None:
    libc = ctypes.CDLL(None, use_errno=True)  # ctypes lets go of the GIL for the call
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for start, end in spans:
        for piece_start in range(start, end, POPULATE_PIECE_BYTES):
            if stop.is_set():
                return
            piece_end = min(piece_start + POPULATE_PIECE_BYTES, end)
            began = time.perf_counter()
            if libc.madvise(piece_start, piece_end - piece_start, MADV_POPULATE_WRITE) != 0:
                errno = ctypes.get_errno()
                logger.debug("pages not faulted in ahead (madvise: %s); they fault in when first written",
                             os.strerror(errno))
                return
            stop.wait((time.perf_counter() - began) * POPULATE_PAUSE_RATIO)


def populate_in_background(tensors: list[torch.Tensor],
                           stop: threading.Event | None = None) -> threading.Thread | None:
    """Fault in the huge-page memory of these contiguous CPU tensors on a daemon thread that
    takes at most about a quarter of a core (_populate), so the start does not wait for it;
    their contents are left as they are. Returns the thread (None when there is nothing to do). Where the kernel
    lacks the advice the pages fault in when first written, as they would anyway.
    stop, once set, ends the thread before its next piece (32 MiB) and so lets go of the
    tensors it holds: a pool replaced, or an engine shut down, is not kept mapped to be
    faulted in for nothing (a GiB for up to ~20 s on a VM that backs fresh huge pages slowly)."""
    if not huge_pages_available():
        return None
    spans = []
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            continue
        start, end = whole_small_pages(tensor)
        if end > start:
            spans.append((start, end))
    if not spans:
        return None
    # The thread's arguments hold the tensors, so their memory stays mapped while it is advised.
    thread = threading.Thread(target=_populate, args=(spans, list(tensors), stop or threading.Event()),
                              name="pdserve-populate", daemon=True)
    with _POPULATING_LOCK:
        _POPULATING[:] = [t for t in _POPULATING if t.is_alive()] + [thread]
    thread.start()
    return thread


def wait_until_populated(timeout_s: float) -> bool:
    """Wait, up to timeout_s, for every populating thread this process started: whether all
    are done. A benchmark's timed runs start after it, as a peer's start-up zeroes its pool
    before its first request (on the Zen 4 EPYC's VM a fresh GiB of huge pages is 2.5 s of
    a core, which the quarter-core thread spreads over the first ~20 s of 2 GiB)."""
    deadline = time.monotonic() + timeout_s
    with _POPULATING_LOCK:
        threads = list(_POPULATING)
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)

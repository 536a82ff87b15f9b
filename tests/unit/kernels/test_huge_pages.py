"""kernels/huge_pages.py: copies and empty tensors in memory advised to huge pages (where
the kernel offers them), sharing chunks when small, returned to the system when their
tensors go; ordinary tensors when turned off. The engine's GEMV weights live there."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from bench.peers.proc_cpu import tree_cpu_seconds
from kernels import huge_pages
from kernels.huge_pages import (CHUNK_BYTES, empty_on_huge_pages, huge_pages_available, on_huge_pages,
                                populate_in_background, wait_until_populated, zeros_on_huge_pages)
from tests.support.memory_maps import mapping_of, resident_bytes
from tests.support.paths import REPO_ROOT
from tests.support.waiting import wait_for


needs_huge_pages = pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_a_copy_has_the_same_values_contiguous(dtype):
    source = (torch.randn(37, 50) * 100).to(dtype).t()  # not contiguous
    copy = on_huge_pages(source)
    assert copy.is_contiguous() and copy.dtype == dtype and copy.shape == source.shape
    assert torch.equal(copy, source)
    assert copy.data_ptr() != source.data_ptr()


@needs_huge_pages
def test_copies_live_in_memory_advised_to_huge_pages():
    large = on_huge_pages(torch.randn(CHUNK_BYTES // 4))  # its own region
    small = on_huge_pages(torch.randn(1000))
    for tensor in (large, small):
        assert mapping_of(tensor)["THPeligible"] == "1"
    assert large.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0


@needs_huge_pages
def test_small_tensors_share_a_chunk_at_aligned_offsets():
    pieces = [on_huge_pages(torch.randn(n)) for n in (1, 3, 100, 1000)]
    assert len({mapping_of(piece)["range"] for piece in pieces}) == 1
    assert all(piece.data_ptr() % huge_pages.ALIGN_BYTES == 0 for piece in pieces)
    ends = [piece.data_ptr() + piece.numel() * piece.element_size() for piece in pieces]
    assert all(end <= later.data_ptr() for end, later in zip(ends, pieces[1:]))  # no overlap


@needs_huge_pages
def test_each_tensor_has_a_storage_of_its_own():
    # A chunk's tensors are not views of one another: a compiled graph taking several of
    # them as inputs must not see them alias, or it adds alias analysis and guards for them.
    pieces = [on_huge_pages(torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16)) for _ in range(4)]
    assert len({mapping_of(piece)["range"] for piece in pieces}) == 1
    assert all(piece._base is None and piece.storage_offset() == 0 for piece in pieces)
    assert len({piece.untyped_storage().data_ptr() for piece in pieces}) == len(pieces)
    pieces[0].fill_(1)
    assert not any(piece.any() for piece in pieces[1:])


@needs_huge_pages
def test_a_region_is_unmapped_when_its_tensors_go():
    tensor = empty_on_huge_pages((CHUNK_BYTES,), torch.uint8)
    view = tensor[10:20]
    address = tensor.data_ptr()
    del tensor
    gc.collect()
    assert mapping_of(view) is not None  # a view keeps the region
    del view
    gc.collect()
    with open("/proc/self/maps") as maps:
        ranges = [tuple(int(part, 16) for part in line.split()[0].split("-")) for line in maps]
    assert not any(start <= address < end for start, end in ranges)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("num_bytes", [4096, CHUNK_BYTES])  # a chunk's piece, a region of its own
def test_zeros_read_as_zero_in_any_cache_dtype(dtype, num_bytes):
    # Both kinds of memory are fresh, never handed out before: zero with nothing written.
    zeros = zeros_on_huge_pages((num_bytes // 64, 64 // dtype.itemsize), dtype)
    assert zeros.dtype == dtype and zeros.is_contiguous() and not zeros.float().any()


@needs_huge_pages
def test_populating_faults_the_pages_in_and_keeps_what_was_written():
    tensor = zeros_on_huge_pages((CHUNK_BYTES // 4,), torch.float32)
    assert resident_bytes(tensor) == 0
    tensor[:1000] = torch.arange(1000.0)  # written before and while the thread runs: kept
    # (a quarter of a core at most: under a loaded test run that can take seconds)
    thread = populate_in_background([tensor])
    tensor[-1000:] = torch.arange(1000.0)
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert resident_bytes(tensor) == CHUNK_BYTES
    assert torch.equal(tensor[:1000], torch.arange(1000.0)) and torch.equal(tensor[-1000:], torch.arange(1000.0))
    assert not tensor[1000:-1000].any()


@needs_huge_pages
def test_waiting_until_populated_returns_once_every_pool_is_resident():
    pools = [zeros_on_huge_pages((CHUNK_BYTES // 4,), torch.float32) for _ in range(2)]
    threads = [populate_in_background([pool]) for pool in pools]
    assert wait_until_populated(timeout_s=120)
    assert not any(thread.is_alive() for thread in threads)
    assert [resident_bytes(pool) for pool in pools] == [CHUNK_BYTES, CHUNK_BYTES]
    assert wait_until_populated(timeout_s=0)  # nothing left to wait for


@needs_huge_pages
def test_a_stopped_population_faults_in_no_further():
    # Sixteen pieces: stopped before it starts, the thread advises none of them. Stopped once
    # the first is in, it ends before the piece after the one it is in (or its pause).
    pool = zeros_on_huge_pages((16 * huge_pages.POPULATE_PIECE_BYTES // 4,), torch.float32)
    stop = threading.Event()
    stop.set()
    thread = populate_in_background([pool], stop)
    thread.join(timeout=60)
    assert not thread.is_alive() and resident_bytes(pool) == 0
    stop = threading.Event()
    thread = populate_in_background([pool], stop)
    wait_for(lambda: resident_bytes(pool) > 0, timeout_s=60, what="the first piece faulted in")
    stop.set()
    thread.join(timeout=60)
    assert not thread.is_alive() and resident_bytes(pool) < pool.untyped_storage().nbytes()


@needs_huge_pages
def test_waiting_until_populated_says_when_the_deadline_came_first(monkeypatch):
    released = threading.Event()
    monkeypatch.setattr(huge_pages, "_populate", lambda spans, tensors, stop: released.wait(60))
    thread = populate_in_background([zeros_on_huge_pages((CHUNK_BYTES // 4,), torch.float32)])
    began = time.monotonic()
    assert not wait_until_populated(timeout_s=0.2)
    assert time.monotonic() - began < 10 and thread.is_alive()
    released.set()
    assert wait_until_populated(timeout_s=60) and not thread.is_alive()


POPULATING_PROCESS = """
import sys, torch
from kernels.huge_pages import populate_in_background, zeros_on_huge_pages
pool = zeros_on_huge_pages((1 << 28,), torch.float32)  # 1 GiB
populate_in_background([pool])
print("populating", flush=True)
sys.stdin.read()
"""


@needs_huge_pages
@pytest.mark.timing
def test_a_process_killed_while_populating_on_busy_cores_ends_within_a_second():
    # Its death closes its sockets and pipes, which is how an executor or a gateway sees it;
    # a populating thread at idle priority held them open for seconds on busy cores.
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    process = subprocess.Popen([sys.executable, "-c", POPULATING_PROCESS], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    busy = []
    try:
        assert process.stdout.readline().strip() == "populating"
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
        wait_for(lambda: all(tree_cpu_seconds(loop.pid) >= 0.1 for loop in busy), timeout_s=10,
                 what="the busy loops to run")
        process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        process.wait(timeout=30)
        assert time.monotonic() - killed_at < 1.0
    finally:
        for loop in busy:
            loop.kill()
            loop.wait()
        process.kill()
        process.wait()


def test_nothing_to_populate_starts_no_thread():
    assert populate_in_background([]) is None
    assert populate_in_background([torch.zeros(0)]) is None


def test_an_empty_tensor_has_the_shape_and_dtype_asked():
    empty = empty_on_huge_pages((3, 4, 5), torch.bfloat16)
    assert empty.shape == (3, 4, 5) and empty.dtype == torch.bfloat16 and empty.is_contiguous()


def test_turned_off_they_are_ordinary_tensors(monkeypatch):
    monkeypatch.setenv("PDSERVE_HUGE_PAGES", "0")
    huge_pages_available.cache_clear()

    def no_region(num_bytes):
        raise AssertionError("an advised region was made while turned off")

    # No THPeligible check on the result: memory torch reuses may sit in a range another
    # library advised (NumPy advises its large arrays), so no region made is what is asserted.
    monkeypatch.setattr(huge_pages, "_region", no_region)
    try:
        assert not huge_pages_available()
        source = torch.randn(CHUNK_BYTES // 4)
        copy = on_huge_pages(source)
        assert torch.equal(copy, source) and copy.data_ptr() != source.data_ptr()
        assert empty_on_huge_pages((CHUNK_BYTES,), torch.uint8).shape == (CHUNK_BYTES,)
        assert empty_on_huge_pages((8,), torch.float32).dtype == torch.float32
        assert not zeros_on_huge_pages((CHUNK_BYTES // 4,), torch.float32).any()
        assert populate_in_background([torch.zeros(CHUNK_BYTES // 4)]) is None
    finally:
        monkeypatch.undo()
        huge_pages_available.cache_clear()

"""glibc's malloc told to keep what it frees: a step's worth of large blocks, freed and
asked for again, comes back without its pages being faulted in anew. Each case runs in a
fresh interpreter, whose allocator settings it changes for good; the blocks come from
malloc itself, which torch's CPU allocator calls."""
from __future__ import annotations

import json
import os
import platform

import pytest

from tests.support.fresh_process import run_python


_BLOCK_BYTES = 20 << 20  # a 2,048-token prefill's MLP activations are 12-25 MiB
_NUM_BLOCKS = 3
_NUM_PAGES = _NUM_BLOCKS * _BLOCK_BYTES // os.sysconf("SC_PAGE_SIZE")

_SCRIPT = f"""
import ctypes, json, resource
from common.engine.heap_retention import keep_freed_heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.malloc.argtypes = [ctypes.c_size_t]
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
reasons = [keep_freed_heap(), keep_freed_heap()]  # the second finds it settled
passes = []
blocks = [0] * {_NUM_BLOCKS}
for _ in range(4):  # a step's activations: allocated, written, freed together
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(len(blocks)):
        blocks[i] = libc.malloc({_BLOCK_BYTES})
    for block in blocks:
        ctypes.memset(block, 1, {_BLOCK_BYTES})
    num_page_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    mmapped_bytes = libc.mallinfo2().hblkhd
    for block in reversed(blocks):
        libc.free(block)
    passes.append({{"num_page_faults": num_page_faults, "mmapped_bytes": mmapped_bytes,
                    "heap_bytes_after_free": libc.mallinfo2().arena}})
print(json.dumps({{"reasons": reasons, "passes": passes}}))
"""


def _run(env_overrides: dict[str, str]) -> dict:
    done = run_python(_SCRIPT, timeout_s=300, **env_overrides)
    return json.loads(done.stdout.strip().splitlines()[-1])


glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and mallinfo2 are glibc's")


@glibc_only
def test_freed_blocks_stay_in_the_heap_and_come_back_with_their_pages():
    result = _run({})
    assert result["reasons"] == [None, None]
    first, *later = result["passes"]
    assert first["mmapped_bytes"] < _BLOCK_BYTES  # from the heap, not mappings of their own
    assert first["num_page_faults"] >= _NUM_PAGES // 2  # fresh pages, once
    for again in later:
        assert again["heap_bytes_after_free"] >= _NUM_BLOCKS * _BLOCK_BYTES  # freed, not trimmed
        assert again["num_page_faults"] < _NUM_PAGES // 20  # the same pages


@glibc_only
def test_turned_off_glibc_maps_and_trims_as_usual():
    result = _run({"PDSERVE_KEEP_FREED_HEAP": "0"})
    assert result["reasons"] == ["PDSERVE_KEEP_FREED_HEAP=0"] * 2
    # glibc's defaults, the control that shows the first test can fail: a block past 128
    # KiB is a mapping of its own until one is freed; the threshold then rises to its size,
    # and the heap's top is trimmed past twice that, so every step faults pages in anew
    first, *later = result["passes"]
    assert first["mmapped_bytes"] >= _NUM_BLOCKS * _BLOCK_BYTES
    for again in later:
        assert again["num_page_faults"] >= _NUM_PAGES // 4


_RELEASE_SCRIPT = f"""
import ctypes, json, os
from common.engine.heap_retention import keep_freed_heap, release_freed_heap

def resident_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

libc = ctypes.CDLL("libc.so.6")
libc.malloc.argtypes = [ctypes.c_size_t]
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
keep_freed_heap()
# Weights as loaded, then freed once the linears hold their own copies (a block kept
# after them, as a copy would be, so the freed ones lie below the heap's top).
blocks = [libc.malloc({_BLOCK_BYTES}) for _ in range({_NUM_BLOCKS})]
for block in blocks:
    ctypes.memset(block, 1, {_BLOCK_BYTES})
kept = libc.malloc({_BLOCK_BYTES})
ctypes.memset(kept, 1, {_BLOCK_BYTES})
for block in blocks:
    libc.free(block)
freed = resident_bytes()
released = release_freed_heap()
print(json.dumps({{"released": released, "freed": freed, "after_release": resident_bytes()}}))
"""


@glibc_only
def test_what_loading_freed_goes_back_to_the_kernel_once_asked():
    done = run_python(_RELEASE_SCRIPT, timeout_s=300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["released"]
    # Kept by keep_freed_heap until then, given back by release_freed_heap (the kept block stays).
    assert result["freed"] - result["after_release"] >= (_NUM_BLOCKS - 1) * _BLOCK_BYTES


_THREAD_SCRIPT = f"""
import ctypes, json, os, resource, threading
from common.engine.heap_retention import keep_freed_heap, share_main_arena

libc = ctypes.CDLL("libc.so.6")
libc.malloc.argtypes = [ctypes.c_size_t]
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
shared = share_main_arena() if os.environ.get("SHARE") == "1" else None
keep_freed_heap()
faults = []

def steps():  # an engine thread's steps: more than one 64 MiB heap of activations each
    blocks = [0] * 4
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for i in range(len(blocks)):
            blocks[i] = libc.malloc({_BLOCK_BYTES})
            ctypes.memset(blocks[i], 1, {_BLOCK_BYTES})
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
        for block in reversed(blocks):
            libc.free(block)

thread = threading.Thread(target=steps)
thread.start()
thread.join()
print(json.dumps({{"shared": shared, "faults": faults}}))
"""


@glibc_only
@pytest.mark.parametrize("share", [True, False])
def test_a_thread_off_the_main_one_keeps_its_pages_only_in_the_shared_main_arena(share):
    done = run_python(_THREAD_SCRIPT, timeout_s=300, SHARE="1" if share else "0")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    num_pages = 4 * _BLOCK_BYTES // os.sysconf("SC_PAGE_SIZE")
    assert result["faults"][0] >= num_pages // 2  # fresh pages, once
    if share:
        assert result["shared"] is True
        assert all(again < num_pages // 20 for again in result["faults"][1:])
    else:  # the thread's own arena unmaps its emptied heaps: every step faults again (the control)
        assert all(again >= num_pages // 4 for again in result["faults"][1:])

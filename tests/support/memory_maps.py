"""This process's memory as the kernel reports it: its mappings (/proc/self/smaps) and a
range's resident pages (mincore)."""
from __future__ import annotations

import ctypes
import mmap

import torch

from kernels.huge_pages import whole_small_pages


def mapping_of(tensor: torch.Tensor) -> dict[str, str] | None:
    """The /proc/self/smaps entry (range and fields) holding the tensor's first byte."""
    address = tensor.data_ptr()
    entry: dict[str, str] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                if entry is not None:
                    return entry
                if start <= address < end:
                    entry = {"range": head}
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    return entry


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's whole pages that are in memory (mincore(2)): the tensor's own
    range, where its smaps entry may have merged with a neighbouring mapping's pages."""
    page = mmap.PAGESIZE
    start, end = whole_small_pages(tensor)
    if end <= start:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    flags = (ctypes.c_ubyte * ((end - start) // page))()
    if libc.mincore(start, end - start, flags) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(flag & 1 for flag in flags) * page

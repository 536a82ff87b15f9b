"""This process's memory mappings as the kernel reports them (/proc/self/smaps)."""
from __future__ import annotations

import torch


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

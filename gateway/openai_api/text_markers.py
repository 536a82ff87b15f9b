"""Markers in streamed text: how much of a stream's end must wait for the next piece."""
from __future__ import annotations


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (and so may
    not go out yet as plain text)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0

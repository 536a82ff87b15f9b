"""Helpers for executor tests: where a worker process or a shared-memory segment lives."""
from __future__ import annotations

import os
from pathlib import Path


def alive_pids(pids: list[int]) -> list[int]:
    """Those of pids that still exist (and are not zombies waiting to be reaped)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def existing_segments(names: list[str]) -> list[str]:
    return [name for name in names if os.path.exists(f"/dev/shm/{name.lstrip('/')}")]

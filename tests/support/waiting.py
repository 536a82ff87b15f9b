"""Waiting on a condition with a deadline, instead of sleeping and hoping."""
from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], object], timeout_s: float, what: str) -> None:
    """Return once cond() is true; AssertionError naming `what` after timeout_s seconds."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)

"""The last thing a process of ours does before it exits."""
from __future__ import annotations

import gc


def skip_collection_at_exit() -> None:
    """Turn automatic garbage collection off for the rest of the process; only when it exits
    next, everything released. With collection on, the interpreter's teardown collects again
    and again over the hundreds of thousands of objects torch made: seconds of every stop on
    a small machine."""
    gc.disable()

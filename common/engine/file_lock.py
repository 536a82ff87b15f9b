"""An exclusive lock between processes on one host, held on a file (flock)."""
from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Callable, Iterator


@contextlib.contextmanager
def exclusive_file_lock(lock_path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold lock_path's lock for the block; another process holding it is waited for (a
    process that dies lets go of it). on_wait is called once where that wait begins.

    Several services may start at once (compose, `pdserve up`, tests): one of them makes
    what all need (a converted model, compiled code), the rest wait and then read it."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)

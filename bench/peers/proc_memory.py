"""The memory a process and its descendants hold, read from /proc (Linux), for comparing
engines that run as one process (pdserve's offline LLM) or several (vLLM's front end and
its engine core). Plain Python with no imports from pdserve: vLLM's offline runner, which
runs in vLLM's own venv, imports this file beside it; pdserve's bench as
bench.peers.proc_memory.
"""
from __future__ import annotations

import os
from collections.abc import Collection


def _pss_kib(pid: int) -> int:
    """The process's proportional set size: each page it maps counted as its share among
    the processes mapping it."""
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise OSError(f"no Pss line in /proc/{pid}/smaps_rollup")


def _child_pids(pid: int) -> list[int]:
    """Children of every thread of the process (a thread's children are listed under it)."""
    child_pids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as children:
            child_pids += [int(c) for c in children.read().split()]
    return child_pids


def tree_pids(root: int, exclude_pids: Collection[int] = ()) -> list[int]:
    """The process and its descendants, less those in `exclude_pids` and theirs (the root
    is never left out); [] when the root is gone. One that exits meanwhile may be listed."""
    pids, pending = [], [root]
    while pending:
        current = pending.pop()
        if current in exclude_pids and current != root:
            continue
        try:
            pending += _child_pids(current)
        except FileNotFoundError:
            if current == root:
                return []
            continue  # a descendant that exited meanwhile
        pids.append(current)
    return pids


def tree_memory(pid: int | None = None, exclude_pids: Collection[int] = ()) -> dict | None:
    """{"pss_mib": the summed proportional set size of the process (default: this one) and
    all its descendants, "num_processes": how many}: a page they share (torch's libraries,
    mapped by each of vLLM's processes) counts once in the sum, as the machine holds it.
    The descendants in `exclude_pids`, and theirs, are left out (another engine this
    process started beside its own). None where the kernel does not say (no
    /proc/<pid>/smaps_rollup: not Linux, or < 4.14)."""
    root = os.getpid() if pid is None else pid
    pids = tree_pids(root, exclude_pids)
    if not pids:
        return None
    total_kib, num_processes = 0, 0
    for current in pids:
        try:
            total_kib += _pss_kib(current)
            num_processes += 1
        except FileNotFoundError:
            if current == root:
                return None
            # a descendant that exited meanwhile (what it held is gone as well)
        except OSError:
            return None
    return {"pss_mib": total_kib / 1024, "num_processes": num_processes}

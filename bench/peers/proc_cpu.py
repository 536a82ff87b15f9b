"""The CPU time a process tree uses, read from /proc (Linux), so a benchmark that keeps two
engines up on the same cores starts each timed run only once the other has gone quiet:
vLLM's CPU build keeps a core busy for about a second after each `generate` returns
(measured here: 10 of 10 possible ticks a 100 ms window, then none), which a run started
at once would lose to it.
"""
from __future__ import annotations

import os
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager

from bench.peers.proc_memory import tree_pids

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int, exclude_pids: Collection[int] = ()) -> float:
    """User + system CPU seconds of the process and its descendants (every thread), less
    the subtrees in `exclude_pids`; what has exited meanwhile is not counted."""
    ticks = 0
    for current in tree_pids(pid, exclude_pids):
        try:
            with open(f"/proc/{current}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # the name may hold spaces
        except FileNotFoundError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
    return ticks / _TICKS_PER_S


def host_steal_seconds(stat_text: str | None = None) -> float:
    """CPU seconds the hypervisor has taken from this machine's vCPUs since boot (all of
    them together; /proc/stat's `steal`, 0 on bare metal). Read around a timed run, it says
    how much of the run's wall time the host had the cores elsewhere."""
    if stat_text is None:
        with open("/proc/stat") as stat:
            stat_text = stat.readline()
    fields = stat_text.split("\n", 1)[0].split()
    if fields[0] != "cpu":
        raise ValueError(f"not /proc/stat's first line: {stat_text[:40]!r}")
    # user nice system idle iowait irq softirq steal ...; kernels before 2.6.11 lack steal
    return int(fields[8]) / _TICKS_PER_S if len(fields) > 8 else 0.0


@contextmanager
def cpu_and_steal(pids: Sequence[int], exclude_pids: Collection[int] = ()) -> Iterator[dict[str, float]]:
    """Over the block: the CPU seconds of the process trees of `pids` (less the subtrees in
    `exclude_pids`), the host's steal and the wall time, in the dict yielded ("cpu_s",
    "steal_s", "wall_s"), filled as the block ends. Threads that spin keep their vCPUs
    runnable, and only a runnable vCPU gathers steal: the two read together tell spinning
    from work."""
    def cpu_s() -> float:
        return sum(tree_cpu_seconds(pid, exclude_pids) for pid in pids)

    reading: dict[str, float] = {}
    steal_before, cpu_before, started = host_steal_seconds(), cpu_s(), time.monotonic()
    yield reading
    reading.update(cpu_s=cpu_s() - cpu_before, steal_s=host_steal_seconds() - steal_before,
                   wall_s=time.monotonic() - started)


def tree_wakeups_per_s(pid: int, exclude_pids: Collection[int] = (), window_s: float = 2.0) -> dict[str, float]:
    """Context switches a second of the process tree's threads over one window, by thread
    name, busiest first: how often an idle engine takes a core from whatever runs beside it
    (each switch a thread of its own woken, or preempted)."""
    def switches() -> dict[str, tuple[str, int]]:
        counts = {}
        for current in tree_pids(pid, exclude_pids):
            try:
                task_ids = os.listdir(f"/proc/{current}/task")
            except FileNotFoundError:
                continue
            for task_id in task_ids:
                try:
                    with open(f"/proc/{current}/task/{task_id}/status") as status:
                        fields = dict(line.split(":", 1) for line in status if ":" in line)
                except FileNotFoundError:
                    continue
                counts[task_id] = (fields["Name"].strip(), int(fields["voluntary_ctxt_switches"]) +
                                   int(fields["nonvoluntary_ctxt_switches"]))
        return counts

    before = switches()
    time.sleep(window_s)
    per_name: dict[str, float] = {}
    for task_id, (name, count) in switches().items():
        if task_id in before:  # threads started meanwhile are left out
            per_name[name] = per_name.get(name, 0.0) + (count - before[task_id][1]) / window_s
    return dict(sorted(((name, round(rate, 1)) for name, rate in per_name.items() if rate > 0),
                       key=lambda item: -item[1]))


def wait_until_quiet(pid: int, exclude_pids: Collection[int] = (), window_s: float = 0.2,
                     max_busy_cores: float = 0.1, timeout_s: float = 10.0) -> tuple[float, bool]:
    """Waits until the process tree uses less than `max_busy_cores` over one `window_s`
    window, at most `timeout_s`; (seconds waited, whether it went quiet)."""
    started = time.monotonic()
    while True:
        before = tree_cpu_seconds(pid, exclude_pids)
        time.sleep(window_s)
        busy_cores = (tree_cpu_seconds(pid, exclude_pids) - before) / window_s
        waited = time.monotonic() - started
        if busy_cores < max_busy_cores:
            return waited, True
        if waited >= timeout_s:
            return waited, False

"""A CPU engine stepped on a thread other than the one that loaded it, while that one lives.

libgomp keeps a team of OpenMP worker threads for every thread that has opened a parallel
region, for as long as that thread lives. Loading (weights packed, graphs compiled and
warmed up) opens regions on the loading thread; stepping opens them on the stepping one. Once
the teams' threads outnumber the CPUs, libgomp spins only ~100 times at a barrier before it
sleeps on a futex, and every barrier of a step and every region's start becomes a sleep and a
wake: on the 2-core Zen 5 an fp32 decode step at two threads took 13.7-15.6 ms against
11.5-11.7 ms with the loading thread gone (`docs/benchmarks.md`, "One OpenMP team in a
service"). The services load on a thread that ends (common.service.passing_thread); an
application that loads `LLM` on one thread and generates on another gets this warning, once.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def _num_cpus() -> int:
    # libgomp weighs its threads against the CPUs of the affinity mask, not a cgroup quota
    # (which common.engine.cpus.num_cpus_available also counts).
    return len(os.sched_getaffinity(0))


class LoadingThreadWatch:
    """Made on the loading thread; `check()` at every step (cheap once the stepping thread is known)."""

    def __init__(self, num_threads: Callable[[], int] = torch.get_num_threads,
                 num_cpus: Callable[[], int] = _num_cpus):
        self.loading_thread = threading.current_thread()
        self._num_threads, self._num_cpus = num_threads, num_cpus
        self._checked_thread: threading.Thread | None = None
        self.warned = False

    def check(self) -> None:
        current = threading.current_thread()
        if self.warned or current is self._checked_thread:
            return
        self._checked_thread = current
        if current is self.loading_thread or not self.loading_thread.is_alive():
            return
        num_threads = self._num_threads()
        if num_threads < 2 or 2 * num_threads <= self._num_cpus():
            return  # no team of workers, or both teams fit the CPUs: libgomp keeps spinning
        self.warned = True
        logger.warning(
            "this engine was loaded on thread %r, which is still alive, and steps on thread %r: libgomp keeps "
            "an OpenMP team of %d threads for each, more than the %d CPUs, and then sleeps at every barrier "
            "(a step ~25%% slower on 2 cores). Load the engine on the thread that steps it, or on one that has "
            "ended before it steps.", self.loading_thread.name, current.name, num_threads, self._num_cpus())

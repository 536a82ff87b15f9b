"""Run a service's start-up work on a thread that ends with it, so that one OpenMP team
steps the engine.

libgomp keeps a team of worker threads for every thread that has opened a parallel region,
for as long as that thread lives, and once it manages more threads than the process has
CPUs it stops spinning at barriers: every barrier and every region's start then goes
through a futex sleep and wake. A service loads its model (weights packed, graphs
compiled and warmed up: parallel regions) off the event loop and then steps on the engine
thread. Loaded on a thread of asyncio's default executor, which lives on idle, that
thread's team stayed beside the engine thread's; a decode step on the 2-core Zen 5, fp32,
one row, two threads, took 13.7-15.6 ms that way against 11.5-11.7 ms with the loading
thread gone (the same engine stepped from a thread in both; `docs/benchmarks.md`, "One
OpenMP team in a service"). A thread that ends frees its team (libgomp's thread-exit hook).
"""
from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def run_in_passing_thread(fn: Callable[..., T], *args: Any, name: str = "start-up") -> T:
    """fn(*args) on a new thread in a copy of this task's context (as asyncio.to_thread),
    awaited without blocking the event loop; the thread has ended (and any OpenMP team it
    opened with it) by the time this returns or raises. Cancelled, it returns at once and
    the thread runs fn to its end unawaited."""
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = context.run(fn, *args), None
        except BaseException as e:  # handed to the awaiting task, as asyncio.to_thread does
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed while fn ran: nobody awaits it any more
            pass

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        return await done
    finally:
        if done.done() and not done.cancelled():
            # Its last act was to schedule `settle`: joining waits out its exit hooks (the
            # team's teardown), milliseconds at most, before anything else is served.
            thread.join()

"""run_in_passing_thread: a service's start-up work runs on a thread that is gone, with any
OpenMP team it opened, by the time the service goes on (common.service.passing_thread)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from common.service.passing_thread import run_in_passing_thread
from tests.support.fresh_process import run_python


def test_the_result_comes_back_from_a_thread_that_has_ended():
    async def main():
        loop_thread = threading.current_thread()
        ran_on = await run_in_passing_thread(threading.current_thread, name="build")
        return loop_thread, ran_on

    loop_thread, ran_on = asyncio.run(main())
    assert ran_on is not loop_thread and ran_on.name == "build" and not ran_on.is_alive()


def test_an_error_is_raised_in_the_awaiting_task_and_the_thread_has_ended():
    ran_on = []

    def fail():
        ran_on.append(threading.current_thread())
        raise ValueError("the KV pool does not fit")

    with pytest.raises(ValueError, match="the KV pool does not fit"):
        asyncio.run(run_in_passing_thread(fail))
    ran_on[0].join(timeout=10)
    assert not ran_on[0].is_alive()


_TEAMS = """
import asyncio, os, time
import torch
from common.service.passing_thread import run_in_passing_thread

torch.set_num_threads(2)

def num_threads():
    return len(os.listdir("/proc/self/task"))

def parallel_work():  # past ATen's grain size: an OpenMP parallel region of two threads
    torch.ones(1 << 24).add_(1)

async def main():
    base = num_threads()
    await run_in_passing_thread(parallel_work)
    deadline = time.monotonic() + 10  # the team's worker ends just after its master
    while num_threads() > base and time.monotonic() < deadline:
        time.sleep(0.01)
    left_by_passing = num_threads() - base
    await asyncio.to_thread(parallel_work)  # the executor's thread lives on idle, and its team
    left_by_executor = num_threads() - base
    print(left_by_passing, left_by_executor)

asyncio.run(main())
"""


def test_an_openmp_team_opened_at_start_up_ends_with_its_thread():
    left_by_passing, left_by_executor = map(int, run_python(_TEAMS, timeout_s=120).stdout.split())
    assert left_by_passing == 0
    # What the service did before: the executor's thread and its team's worker stay.
    assert left_by_executor >= 2


def test_the_work_sees_the_awaiting_tasks_context_variables():
    import contextvars
    name = contextvars.ContextVar("name", default="unset")

    async def main():
        name.set("decode-0")
        return await run_in_passing_thread(name.get)

    assert asyncio.run(main()) == "decode-0"


@pytest.mark.timing
def test_cancelling_the_wait_does_not_block_the_loop_on_the_unfinished_work():
    release = threading.Event()
    threading.Timer(5.0, release.set).start()  # what a loop blocked on the thread would wait for

    async def main():
        task = asyncio.ensure_future(run_in_passing_thread(release.wait))
        await asyncio.sleep(0)  # the thread is started and waits
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < 2.0
    release.set()

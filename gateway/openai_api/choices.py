"""Running a request's choices through the gateway's one request path (Gateway.stream /
Gateway.generate), with n > 1 and prompt lists fanned out into independent requests.

Nothing here places, tokenizes or detokenizes: each choice is an ordinary
GenerateInput, so an HTTP request is placed, cancelled and counted exactly like a
gRPC one. Closing `stream_choices` (or cancelling the task awaiting either function)
closes every Gateway.stream it opened, which cancels their Decode calls.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TypeVar

from gateway.core import Gateway
from gateway.types import GenerateInput, GenerationDelta

T = TypeVar("T")


async def stream_choices(gateway: Gateway, inputs: list[GenerateInput]
                         ) -> AsyncIterator[tuple[int, GenerationDelta]]:
    """(choice index, delta) as each choice's deltas arrive; the first failure of any
    choice is raised (ServiceError) and the other choices are cancelled."""
    if len(inputs) == 1:  # the common case: no tasks, no queue
        async with aclosing(gateway.stream(inputs[0])) as deltas:
            async for delta in deltas:
                yield 0, delta
        return
    # (index, delta, None) per delta, (index, None, None) when a choice is done,
    # (index, None, error) when it failed. Unbounded: at most max_tokens per choice.
    queue: asyncio.Queue = asyncio.Queue()

    async def run(index: int, request: GenerateInput) -> None:
        try:
            async with aclosing(gateway.stream(request)) as deltas:
                async for delta in deltas:
                    queue.put_nowait((index, delta, None))
            queue.put_nowait((index, None, None))
        except Exception as error:  # noqa: BLE001 -- handed to the consumer, who raises it
            queue.put_nowait((index, None, error))

    tasks = [asyncio.create_task(run(i, request)) for i, request in enumerate(inputs)]
    try:
        num_running = len(tasks)
        while num_running:
            index, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                num_running -= 1
            else:
                yield index, delta
    finally:
        await _cancel(tasks)


async def generate_choices(gateway: Gateway, inputs: list[GenerateInput]) -> list[GenerationDelta]:
    """Each choice's whole completion, in choice order; the first failure is raised and
    the other choices are cancelled."""
    if len(inputs) == 1:
        return [await gateway.generate(inputs[0])]
    return await all_or_none([gateway.generate(request) for request in inputs])


async def all_or_none(calls: list[Awaitable[T]]) -> list[T]:
    """The calls' results, in order, run at once; the first failure is raised and the other
    calls are cancelled."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await _cancel(tasks)


async def _cancel(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

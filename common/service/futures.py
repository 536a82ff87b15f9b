"""Awaiting a connector's concurrent future from asyncio without owning it."""
from __future__ import annotations

import asyncio
import concurrent.futures


def watch(future: concurrent.futures.Future) -> asyncio.Future:
    """An asyncio future resolved with `future`'s outcome. Unlike asyncio.wrap_future
    (and so `await transfer_handle`), cancelling it, or a task awaiting it, leaves
    `future` alone: a KV transfer's future must only ever be resolved by its
    connector, or its blocks would look free while zmq may still touch them."""
    loop = asyncio.get_running_loop()
    mirror = loop.create_future()

    def copy(done: concurrent.futures.Future) -> None:
        if mirror.done():
            return
        if done.cancelled():
            mirror.cancel()
        elif done.exception() is not None:
            mirror.set_exception(done.exception())
        else:
            mirror.set_result(done.result())
    def on_done(done: concurrent.futures.Future) -> None:
        try:
            loop.call_soon_threadsafe(copy, done)
        except RuntimeError:  # the loop closed: nobody is waiting any more
            pass
    future.add_done_callback(on_done)
    return mirror

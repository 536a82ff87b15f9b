"""Await, from asyncio code, the end of a request's KV transfer.

The engine reports ended transfers on its own thread (EngineCore.kv_transfer_observers),
after the scheduler released or kept the blocks they touched; a waiter registered
before the request was admitted hears of it on its own event loop.
"""
from __future__ import annotations

import asyncio
import threading

from common.engine.kv_connector.metadata import KVTransferOutcome


class KVTransferWaiters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[tuple[str, str], asyncio.Future] = {}  # (req_id, direction) -> future

    def expect(self, req_id: str, direction: str) -> asyncio.Future:
        """A future on the running loop that resolves to req_id's KVTransferOutcome.
        Call discard when done with it."""
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._waiters[(req_id, direction)] = future
        return future

    def discard(self, req_id: str, direction: str) -> None:
        with self._lock:
            self._waiters.pop((req_id, direction), None)

    def __call__(self, outcome: KVTransferOutcome) -> None:
        """Engine thread: a transfer ended."""
        with self._lock:
            future = self._waiters.pop((outcome.req_id, outcome.direction), None)
        if future is not None:
            future.get_loop().call_soon_threadsafe(_resolve, future, outcome)


def _resolve(future: asyncio.Future, outcome: KVTransferOutcome) -> None:
    if not future.done():
        future.set_result(outcome)

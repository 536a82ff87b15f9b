"""Admission control: how many requests the gateway lets run at once, and a bounded
queue for the rest.

Capacity is `max_running_per_decode` requests per live decode instance (the engine's
own batch limit, --max-num-seqs, is the natural value): past it a request waits here, in
arrival order, rather than on an instance where its KV transfer deadline would already be
running. At most `max_waiting` requests wait; one more is refused at once with
RESOURCE_EXHAUSTED (HTTP 429) carrying a retry hint (AdmissionRefused.retry_after_s: the
`retry-after-ms` trailing metadata, the HTTP `Retry-After` header), so an overloaded
deployment says so in microseconds instead of failing admitted requests after seconds.

A waiting request leaves the queue when a slot frees (a request ends, a decode instance
registers), when its own deadline passes (DEADLINE_EXCEEDED), or when the last decode
instance is gone (UNAVAILABLE, as a request arriving then gets). With no decode instance
alive requests are not queued at all: placement answers UNAVAILABLE at once.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from common.service.errors import ServiceError
from gateway.routing.registry import InstanceRegistry

logger = logging.getLogger(__name__)

RETRY_AFTER_METADATA = "retry-after-ms"
RETRY_AFTER_S = 1.0  # about how long a running request takes to free its slot under load


class AdmissionRefused(ServiceError):
    """The wait queue is full: retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = RETRY_AFTER_S):
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.retry_after_s = retry_after_s


class Admission:
    def __init__(self, registry: InstanceRegistry, max_running_per_decode: int, max_waiting: int):
        """max_running_per_decode <= 0: no limit (nothing ever waits)."""
        self.registry = registry
        self.max_running_per_decode = max_running_per_decode
        self.max_waiting = max_waiting
        self.num_running = 0
        self._waiters: deque[asyncio.Future] = deque()
        registry.subscribe(on_added=self._instances_changed, on_removed=self._instances_changed)

    @property
    def num_waiting(self) -> int:
        return sum(1 for waiter in self._waiters if not waiter.done())

    @property
    def capacity(self) -> int | None:
        """Requests that may run now; None: unlimited."""
        if self.max_running_per_decode <= 0:
            return None
        return self.max_running_per_decode * len(self.registry.instances("decode"))

    @asynccontextmanager
    async def slot(self, timeout_s: float | None) -> AsyncIterator[None]:
        """Hold a running slot for the block; wait for one (up to timeout_s) when all are taken."""
        capacity = self.capacity
        if capacity is None or capacity == 0:  # unlimited, or no decode: placement answers
            yield
            return
        if self.num_running < capacity and not self.num_waiting:
            self.num_running += 1
        else:
            await self._wait(timeout_s)
        try:
            yield
        finally:
            self.num_running -= 1
            self._admit_waiters()

    async def _wait(self, timeout_s: float | None) -> None:
        if self.num_waiting >= self.max_waiting:
            raise AdmissionRefused(f"the gateway is at capacity ({self.num_running} requests running, "
                                   f"{self.num_waiting} waiting, --max-waiting-requests {self.max_waiting}); "
                                   f"retry after {RETRY_AFTER_S:g}s")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)  # its result: the slot, counted by _admit_waiters
        except asyncio.TimeoutError:
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"the request's deadline passed while it waited for capacity "
                               f"({self.num_running} requests running)") from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.num_running -= 1  # granted as we were cancelled: hand it on
                self._admit_waiters()
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _admit_waiters(self) -> None:
        capacity = self.capacity
        while self._waiters and (capacity is None or self.num_running < capacity):
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.num_running += 1
                waiter.set_result(None)

    def _instances_changed(self, instance, _reason: str) -> None:
        if instance.role != "decode":
            return
        if self.capacity == 0:  # the last decode instance left: nothing will free a slot
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_exception(ServiceError(grpc.StatusCode.UNAVAILABLE,
                                                      "no decode instance is alive; retry"))
        else:
            self._admit_waiters()

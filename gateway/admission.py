"""Admission control: how many requests the gateway lets run at once in each pool, and a
bounded queue per pool for the rest.

Each pool has its own `PoolAdmission`:
- decode: `max_running_per_instance` requests per live decode instance (the engine's own
  batch limit, --max-num-seqs, is the natural value), held for the request's whole life;
- prefill: that many requests in their prefill phase per live prefill instance, held from
  placement until the request's first token (its prefill is then done), so a burst of
  prompts waits here, where placement is decided when a slot frees, instead of in one
  prefill instance's queue.
A request takes its decode slot first and its prefill slot second; the prefill slot is
always given back soon (first token, or the end), so the two queues cannot hold each
other up.

Past capacity a request waits in its pool's queue, in arrival order. At most
`max_waiting` requests wait per pool; one more is refused at once with
RESOURCE_EXHAUSTED (HTTP 429) carrying a retry hint (AdmissionRefused.retry_after_s: the
`retry-after-ms` trailing metadata, the HTTP `Retry-After` header), so an overloaded
deployment says so in microseconds instead of failing admitted requests after seconds.

A waiting request leaves the queue when a slot frees (a request ends or finishes its
prefill, an instance registers), when its own deadline passes (DEADLINE_EXCEEDED), or
when its pool's last instance is gone: with no decode instance it fails UNAVAILABLE (as a
request arriving then does); with no prefill instance it goes ahead, because the decode
instance then prefills locally. An empty pool queues nothing.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from common.service.errors import ServiceError
from common.service.registration import Role
from gateway.routing.registry import InstanceRegistry

logger = logging.getLogger(__name__)

RETRY_AFTER_METADATA = "retry-after-ms"
RETRY_AFTER_S = 1.0  # about how long a running request takes to free its slot under load
_FLAG = {"decode": "--max-running-per-decode", "prefill": "--max-running-per-prefill"}


class AdmissionRefused(ServiceError):
    """The wait queue is full: retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = RETRY_AFTER_S):
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.retry_after_s = retry_after_s


class Slot:
    """A held running slot; `release()` gives it back (once; later calls do nothing)."""

    def __init__(self, admission: PoolAdmission | None):
        self._admission = admission

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission.num_running -= 1
            admission._admit_waiters()


class PoolAdmission:
    def __init__(self, registry: InstanceRegistry, role: Role, max_running_per_instance: int, max_waiting: int):
        """max_running_per_instance <= 0: no limit (nothing ever waits)."""
        self.registry = registry
        self.role = role
        self.max_running_per_instance = max_running_per_instance
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
        if self.max_running_per_instance <= 0:
            return None
        return self.max_running_per_instance * len(self.registry.instances(self.role))

    async def acquire(self, timeout_s: float | None) -> Slot:
        """A running slot; wait for one (up to timeout_s) when all are taken."""
        capacity = self.capacity
        if capacity is None or capacity == 0:  # unlimited, or an empty pool: placement decides
            return Slot(None)
        if self.num_running < capacity and not self.num_waiting:
            self.num_running += 1
        elif not await self._wait(timeout_s):
            return Slot(None)
        return Slot(self)

    @asynccontextmanager
    async def slot(self, timeout_s: float | None) -> AsyncIterator[Slot]:
        """Hold a running slot for the block (or until the block releases it)."""
        slot = await self.acquire(timeout_s)
        try:
            yield slot
        finally:
            slot.release()

    async def _wait(self, timeout_s: float | None) -> bool:
        """Wait for a slot: True when granted one, False when the pool emptied (no limit then)."""
        if self.num_waiting >= self.max_waiting:
            raise AdmissionRefused(f"the gateway's {self.role} pool is at capacity ({self.num_running} requests "
                                   f"running, {self.num_waiting} waiting, {_FLAG[self.role]} "
                                   f"{self.max_running_per_instance}, --max-waiting-requests {self.max_waiting}); "
                                   f"retry after {RETRY_AFTER_S:g}s")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await asyncio.wait_for(waiter, timeout_s)  # a grant was counted by _admit_waiters
        except asyncio.TimeoutError:
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"the request's deadline passed while it waited for {self.role} capacity "
                               f"({self.num_running} requests running)") from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None and waiter.result():
                Slot(self).release()  # granted as we were cancelled: hand it on
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
                waiter.set_result(True)

    def _instances_changed(self, instance, _reason: str) -> None:
        if instance.role != self.role:
            return
        if self.capacity != 0:
            self._admit_waiters()
            return
        # The pool's last instance left: nothing here will free a slot.
        while self._waiters:
            waiter = self._waiters.popleft()
            if waiter.done():
                continue
            if self.role == "decode":
                waiter.set_exception(ServiceError(grpc.StatusCode.UNAVAILABLE, "no decode instance is alive; retry"))
            else:
                waiter.set_result(False)  # decode instances prefill locally

"""Request ids in flight at this gateway, and when an id may be used again.

An id belongs to one request at a time; the request frees it when it ends (finished,
failed or cancelled). A client that cancels a stream and at once re-sends its id races
its own cancel: the cancellation reaches the old call's handler asynchronously, so the
re-sent request can arrive while the old one still holds the id. So a request whose id
is held waits for the holder to end, at most RELEASE_WAIT_S (and never past its own
deadline), and is then served. If the holder is still there after that (two live
requests with one id), the request is refused with RequestIdInFlight: ALREADY_EXISTS
with a message that says why and a retry hint (`retry-after-ms` trailing metadata,
HTTP `Retry-After`).

Decode and prefill instances gate ids too, and learn of a cancellation the same
asynchronous way: an id this gateway has just freed may still be held on the instance
for a moment. `recently_released` tells the gateway that this is what an instance's
ALREADY_EXISTS means (Gateway retries the placement within the same bound).
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict

import grpc

from common.service.errors import ServiceError

# How long a re-sent id waits for the request that had it to let go. A cancel crosses
# loopback or a LAN in milliseconds; a second covers a loaded event loop many times over.
RELEASE_WAIT_S = 1.0


class RequestIdInFlight(ServiceError):
    """Another request with this id is still in flight: retry after `retry_after_s`."""

    def __init__(self, request_id: str, where: str, retry_after_s: float = RELEASE_WAIT_S):
        super().__init__(grpc.StatusCode.ALREADY_EXISTS,
                         f"request_id {request_id!r} is still held by another request {where} (one still "
                         f"running, or one just cancelled that has not finished cancelling); give each "
                         f"request its own id, or to reuse the id of a cancelled request retry after "
                         f"{round(retry_after_s * 1000)} ms")
        self.retry_after_s = retry_after_s


class RequestIds:
    """The ids of the requests this gateway is serving (single event loop, no locking)."""

    def __init__(self, release_wait_s: float = RELEASE_WAIT_S):
        self.release_wait_s = release_wait_s
        self._holders: dict[str, asyncio.Event] = {}  # id -> set when its request ends
        self._released_at: OrderedDict[str, float] = OrderedDict()  # id -> loop time, oldest first
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._holders)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._holders

    async def acquire(self, request_id: str, timeout_s: float | None = None) -> None:
        """Take the id, waiting (bounded) for a request that holds it to end; raise
        RequestIdInFlight if one still holds it then. Pair with release()."""
        loop = asyncio.get_running_loop()
        wait_s = self.release_wait_s if timeout_s is None else min(self.release_wait_s, timeout_s)
        deadline = loop.time() + wait_s
        # A loop: several re-sends may wait on one holder, and only the first to wake takes the id.
        while (released := self._holders.get(request_id)) is not None:
            try:
                await asyncio.wait_for(released.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise RequestIdInFlight(request_id, "at this gateway") from None
        self._holders[request_id] = asyncio.Event()
        self._idle.clear()

    def release(self, request_id: str) -> None:
        """The request ended: free its id (synchronous, so it runs even as a task is torn down)."""
        released = self._holders.pop(request_id, None)
        if released is None:
            return
        released.set()
        now = asyncio.get_running_loop().time()
        self._released_at.pop(request_id, None)
        self._released_at[request_id] = now
        while self._released_at:  # only the last RELEASE_WAIT_S are kept
            oldest_id, released_at = next(iter(self._released_at.items()))
            if now - released_at <= self.release_wait_s:
                break
            del self._released_at[oldest_id]
        if not self._holders:
            self._idle.set()

    def recently_released(self, request_id: str) -> float | None:
        """Seconds left of the release window of an id a request here freed lately (its
        instance may not have let go of it yet); None when there is none."""
        released_at = self._released_at.get(request_id)
        if released_at is None:
            return None
        left = self.release_wait_s - (asyncio.get_running_loop().time() - released_at)
        return left if left > 0 else None

    async def wait_idle(self) -> None:
        """Until no request holds an id (draining)."""
        await self._idle.wait()

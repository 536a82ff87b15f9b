"""The Decode calls running on each decode instance, so that the gateway can end them the
moment it decides the instance is gone.

Keepalive (common.service.keepalive) fails a call whose connection died; it cannot tell
a frozen process from a slow one while the kernel still acknowledges its packets for a
while, and a call on an instance the registry has dropped (missed heartbeats, a failed
probe) has nobody left to finish it. So when the registry drops an instance as dead
(reasons in DEAD_REASONS, not a clean deregistration: a draining instance finishes its
calls), every call still running there is cancelled and marked lost; the dispatcher
turns that into UNAVAILABLE, or places the request again when no token was streamed yet.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from decode_service.client import DecodeStream
from gateway.routing.registry import Instance, InstanceRegistry

logger = logging.getLogger(__name__)

DEAD_REASONS = frozenset({"expired", "unresponsive"})


class TrackedCall:
    def __init__(self, stream: DecodeStream):
        self.stream = stream
        self.lost_reason: str | None = None  # why its instance was dropped, once it was


class InFlightCalls:
    def __init__(self, registry: InstanceRegistry):
        self._by_instance: dict[str, set[TrackedCall]] = {}
        registry.subscribe(on_removed=self._on_removed)

    @contextmanager
    def tracking(self, instance: Instance, stream: DecodeStream) -> Iterator[TrackedCall]:
        call = TrackedCall(stream)
        calls = self._by_instance.setdefault(instance.instance_id, set())
        calls.add(call)
        try:
            yield call
        finally:
            calls.discard(call)
            if not calls and self._by_instance.get(instance.instance_id) is calls:
                del self._by_instance[instance.instance_id]

    def count(self, instance_id: str) -> int:
        return len(self._by_instance.get(instance_id, ()))

    def _on_removed(self, instance: Instance, reason: str) -> None:
        if reason not in DEAD_REASONS:
            return
        calls = self._by_instance.get(instance.instance_id, set())
        if calls:
            logger.warning("decode instance %s dropped (%s): failing its %d calls in flight",
                           instance.instance_id, reason, len(calls))
        for call in list(calls):
            call.lost_reason = reason
            call.stream.cancel()

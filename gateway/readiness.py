"""Whether the gateway can serve a Generate call right now (readiness), as opposed to
whether its process works (liveness).

Ready means: not draining, and at least one decode instance alive in the registry.
The answer is recomputed when the registry adds or removes an instance (its
listeners fire on Register, Deregister and heartbeat expiry) and when draining
starts, never by polling; subscribers (the gRPC health service, gateway.server)
are told each time it changes.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from gateway.routing.registry import InstanceRegistry

logger = logging.getLogger(__name__)

NOT_READY_NO_DECODE = "no decode instance is registered"
NOT_READY_DRAINING = "the gateway is draining"


class Readiness:
    def __init__(self, registry: InstanceRegistry):
        self.registry = registry
        self._draining = False
        self._subscribers: list[Callable[[bool], None]] = []
        self._last = self.ready
        registry.subscribe(on_added=self._instances_changed, on_removed=self._instances_changed)

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        self._publish()

    @property
    def reason(self) -> str | None:
        """Why the gateway is not ready, or None when it is."""
        if self._draining:
            return NOT_READY_DRAINING
        if not self.registry.instances("decode"):
            return NOT_READY_NO_DECODE
        return None

    @property
    def ready(self) -> bool:
        return self.reason is None

    def subscribe(self, on_change: Callable[[bool], None]) -> None:
        """Call on_change(ready) whenever readiness changes (on the registry's thread)."""
        self._subscribers.append(on_change)

    def _instances_changed(self, instance, _reason: str) -> None:
        if instance.role == "decode":
            self._publish()

    def _publish(self) -> None:
        ready = self.ready
        if ready == self._last:
            return
        self._last = ready
        logger.info("gateway %s", "ready" if ready else f"not ready: {self.reason}")
        for on_change in self._subscribers:
            on_change(ready)

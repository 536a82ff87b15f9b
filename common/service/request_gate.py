"""Admission of work RPCs on an engine service: ready, draining, or stopping."""
from __future__ import annotations

import asyncio
import contextlib

import grpc
from grpc import aio

from common.service.errors import ServiceError


class RequestGate:
    """Admission of work RPCs: counts in-flight ones, refuses new ones while draining."""

    def __init__(self, description: str):
        self.description = description  # e.g. "prefill instance prefill-a-12"
        self.draining = False
        self.stopping = False  # grace period over: in-flight requests are being failed
        self._num_inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_inflight(self) -> int:
        return self._num_inflight

    @contextlib.asynccontextmanager
    async def admit(self, context: aio.ServicerContext):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"{self.description} is draining (shutting down); send the request elsewhere")
        self._num_inflight += 1
        self._idle.clear()
        try:
            yield
        except ServiceError:
            if self.stopping:  # past the grace period every failure is the shutdown's
                raise self.shutdown_error() from None
            raise
        finally:
            self._num_inflight -= 1
            if not self._num_inflight:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def shutdown_error(self) -> ServiceError:
        return ServiceError(grpc.StatusCode.UNAVAILABLE,
                            f"{self.description} shut down before the request finished")

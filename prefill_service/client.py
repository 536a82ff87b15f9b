"""The Prefill API's typed client: what decode instances (Prefill, one channel per prefill
address) and the gateway (GetCachedBlocks) call instead of raw stubs."""
from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import Any

import grpc
from grpc import aio

from common.service.keepalive import KEEPALIVE_CHANNEL_OPTIONS
from prefill_service.api import CachedBlocks, PrefillJob, PrefillResult
from protos.pdserve.v1 import prefill_pb2, prefill_pb2_grpc

# Beyond the KV transfer's own timeout, how long the Prefill RPC may take to report.
RPC_SLACK_S = 5.0


class PrefillCall:
    """A Prefill in flight: await it for the PrefillResult; `cancel()` aborts the prefill
    and its transfer on the prefill instance (a no-op once it has ended)."""

    def __init__(self, call: aio.UnaryUnaryCall):
        self._call = call

    def __await__(self) -> Generator[Any, None, PrefillResult]:
        response = yield from self._call.__await__()
        return PrefillResult.from_pb(response)

    def cancel(self) -> None:
        self._call.cancel()


class PrefillClients:
    def __init__(self):
        self._stubs: dict[str, tuple[aio.Channel, prefill_pb2_grpc.PrefillServiceStub]] = {}

    def _stub(self, address: str) -> prefill_pb2_grpc.PrefillServiceStub:
        entry = self._stubs.get(address)
        if entry is None:
            # Keepalive: a frozen prefill instance fails the call instead of holding it.
            channel = aio.insecure_channel(address, options=KEEPALIVE_CHANNEL_OPTIONS)
            entry = self._stubs[address] = (channel, prefill_pb2_grpc.PrefillServiceStub(channel))
        return entry[1]

    def prefill(self, address: str, job: PrefillJob, transfer_timeout_s: float,
                trace_headers: Mapping[str, str] | None = None) -> PrefillCall:
        """trace_headers: gRPC metadata making the prefill's span a child of the caller's."""
        metadata = tuple(trace_headers.items()) if trace_headers else None
        return PrefillCall(self._stub(address).Prefill(job.to_pb(), timeout=transfer_timeout_s + RPC_SLACK_S,
                                                       metadata=metadata))

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()


async def fetch_cached_blocks(address: str, timeout_s: float | None = None, stub=None) -> CachedBlocks:
    """One GetCachedBlocks on a channel of its own: resyncs are rare, instances come and go.
    `stub`: the service's stub class (a decode instance answers it too); PrefillService's by default."""
    async with aio.insecure_channel(address) as channel:
        response = await (stub or prefill_pb2_grpc.PrefillServiceStub)(channel).GetCachedBlocks(
            prefill_pb2.GetCachedBlocksRequest(), timeout=timeout_s)
    return CachedBlocks.from_pb(response)


def failure_status(error: aio.AioRpcError, prefill: str) -> tuple[grpc.StatusCode, str]:
    """How a failed Prefill call reads to its caller: its own code, except that a prefill
    instance that is gone or gave up reads as UNAVAILABLE."""
    code = error.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return grpc.StatusCode.UNAVAILABLE, f"prefill instance {prefill} is unavailable: {error.details()}"
    return code, f"prefill instance {prefill}: {error.details()}"

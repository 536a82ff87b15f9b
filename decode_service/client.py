"""The Decode API's typed client: what a caller of a decode instance (the gateway) holds
instead of a raw stub. Speaks decode_service.api's types; gRPC errors surface as
grpc.aio.AioRpcError for the caller to map, since what a failure means is its call."""
from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from common.service.keepalive import KEEPALIVE_CHANNEL_OPTIONS
from common.service.registration import InstanceLoad
from decode_service.api import DecodeJob, DecodeOutput
from protos.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc


class DecodeStream:
    """One Decode call in flight: iterate it for DecodeOutputs; `cancel()` aborts the
    request on the decode instance and so its prefill (a no-op once it has ended)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall):
        self._call = call

    async def __aiter__(self) -> AsyncIterator[DecodeOutput]:
        async for msg in self._call:
            yield DecodeOutput.from_pb(msg)

    def cancel(self) -> None:
        self._call.cancel()


class DecodeClient:
    def __init__(self, address: str):
        self.address = address
        # Keepalive: a frozen instance fails its streams instead of holding them forever.
        self._channel = grpc.aio.insecure_channel(address, options=KEEPALIVE_CHANNEL_OPTIONS)
        self._stub = decode_pb2_grpc.DecodeServiceStub(self._channel)

    def decode(self, job: DecodeJob, timeout_s: float | None = None) -> DecodeStream:
        """job.trace_headers travel as gRPC metadata (the decode span's parent)."""
        metadata = tuple(job.trace_headers.items()) if job.trace_headers else None
        return DecodeStream(self._stub.Decode(job.to_pb(), timeout=timeout_s, metadata=metadata))

    async def abort(self, req_ids: list[str], timeout_s: float | None = None) -> int:
        """How many of `req_ids` were in flight there."""
        response = await self._stub.Abort(decode_pb2.AbortRequest(request_ids=req_ids), timeout=timeout_s)
        return response.num_aborted

    async def load(self, timeout_s: float | None = None) -> InstanceLoad:
        """The instance's load now (its Stats RPC); also how the gateway probes an instance."""
        response = await self._stub.Stats(common_pb2.StatsRequest(), timeout=timeout_s)
        return InstanceLoad.from_pb(response.load)

    async def close(self) -> None:
        await self._channel.close()

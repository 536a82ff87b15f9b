"""The Embed API's typed client: what the gateway holds for an engine instance's
EmbeddingService instead of a raw stub. gRPC errors surface as grpc.aio.AioRpcError for
the caller to map."""
from __future__ import annotations

from collections.abc import Mapping

import grpc

from common.service.embedding_api import EmbedJob, EmbedResult
from common.service.keepalive import KEEPALIVE_CHANNEL_OPTIONS
from protos.pdserve.v1 import embedding_pb2_grpc


class EmbeddingClient:
    def __init__(self, address: str):
        self.address = address
        # Keepalive: a frozen instance fails its calls instead of holding them forever.
        self._channel = grpc.aio.insecure_channel(address, options=KEEPALIVE_CHANNEL_OPTIONS)
        self._stub = embedding_pb2_grpc.EmbeddingServiceStub(self._channel)

    async def embed(self, job: EmbedJob, timeout_s: float | None = None,
                    trace_headers: Mapping[str, str] | None = None) -> EmbedResult:
        """trace_headers: gRPC metadata making the instance's span a child of the caller's."""
        metadata = tuple(trace_headers.items()) if trace_headers else None
        return EmbedResult.from_pb(await self._stub.Embed(job.to_pb(), timeout=timeout_s, metadata=metadata))

    async def close(self) -> None:
        await self._channel.close()

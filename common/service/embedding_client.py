"""The Embed API's typed client: what the gateway holds for an engine instance's
EmbeddingService instead of a raw stub. gRPC errors surface as grpc.aio.AioRpcError for
the caller to map."""
from __future__ import annotations

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

    async def embed(self, job: EmbedJob, timeout_s: float | None = None) -> EmbedResult:
        return EmbedResult.from_pb(await self._stub.Embed(job.to_pb(), timeout=timeout_s))

    async def close(self) -> None:
        await self._channel.close()

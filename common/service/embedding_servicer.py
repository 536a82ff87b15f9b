"""gRPC face of an engine instance's embeddings (pdserve.v1.EmbeddingService), which
prefill and decode instances both serve.

RPC status codes:
  Embed  INVALID_ARGUMENT  bad prompt or pooling (nothing was queued)
         ALREADY_EXISTS    the request id is in flight here
         UNAVAILABLE       draining / shutting down
         (a cancelled call aborts the request and frees its blocks)
"""
from __future__ import annotations

import logging

from common.service.embedder import Embedder
from common.service.embedding_api import EmbedJob
from common.service.logging_setup import logged_request
from common.service.tracing import NO_TRACING, Tracing
from common.service.request_gate import RequestGate
from protos.pdserve.v1 import embedding_pb2, embedding_pb2_grpc

logger = logging.getLogger(__name__)


class EmbeddingServicer(embedding_pb2_grpc.EmbeddingServiceServicer):
    def __init__(self, embedder: Embedder, gate: RequestGate, instance_id: str, tracing: Tracing = NO_TRACING):
        self.embedder = embedder
        self.gate = gate
        self.instance_id = instance_id
        self.tracing = tracing

    async def Embed(self, request: embedding_pb2.EmbedRequest, context) -> embedding_pb2.EmbedResponse:
        with logged_request(logger, "embed", request.request_id, context, self.tracing,
                            prompt_tokens=len(request.prompt_token_ids)) as end:
            async with self.gate.admit(context):
                result = await self.embedder.embed(EmbedJob.from_pb(request))
                result.instance_id = self.instance_id
                end.update(cached_tokens=result.num_cached_tokens)
                return result.to_pb(request.request_id)

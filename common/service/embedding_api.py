"""The Embed API's one owner: pdserve.v1.EmbeddingService's messages <-> the service kit's
types, for both sides of the call (the instances' servicer, the gateway's client).
Torch-free."""
from __future__ import annotations

from dataclasses import dataclass

from common.engine.pooling_params import PoolingParams
from common.service.errors import invalid
from protos.pdserve.v1 import embedding_pb2


def pooling_params_from_pb(msg: embedding_pb2.PoolingParams, field_path: str = "pooling.") -> PoolingParams:
    """Unset fields take PoolingParams' defaults; a bad value is INVALID_ARGUMENT naming the field."""
    try:
        return PoolingParams(normalize=msg.normalize if msg.HasField("normalize") else None,
                             dimensions=msg.dimensions if msg.HasField("dimensions") else None)
    except ValueError as e:
        raise invalid(f"{field_path}{e}") from None


def pooling_params_to_pb(params: PoolingParams) -> embedding_pb2.PoolingParams:
    msg = embedding_pb2.PoolingParams()
    if params.normalize is not None:
        msg.normalize = params.normalize
    if params.dimensions is not None:
        msg.dimensions = params.dimensions
    return msg


@dataclass
class EmbedJob:
    """One Embed call: the prompt's embedding, pooled as `pooling` says."""

    req_id: str
    prompt_token_ids: list[int]
    pooling: PoolingParams
    priority: int = 0
    cache_salt: str | None = None  # only requests of the same salt share cached blocks
    lora_name: str | None = None  # the LoRA adapter, by the name the instance serves it under

    @classmethod
    def from_pb(cls, msg: embedding_pb2.EmbedRequest) -> EmbedJob:
        return cls(msg.request_id, list(msg.prompt_token_ids), pooling_params_from_pb(msg.pooling), msg.priority,
                   msg.cache_salt if msg.HasField("cache_salt") else None,
                   msg.lora_name if msg.HasField("lora_name") else None)

    def to_pb(self) -> embedding_pb2.EmbedRequest:
        return embedding_pb2.EmbedRequest(request_id=self.req_id, prompt_token_ids=self.prompt_token_ids,
                                          pooling=pooling_params_to_pb(self.pooling), priority=self.priority,
                                          cache_salt=self.cache_salt, lora_name=self.lora_name)


@dataclass
class EmbedResult:
    embedding: list[float]
    num_cached_tokens: int  # prompt tokens the instance's prefix cache held
    instance_id: str = ""  # the instance that computed it

    @classmethod
    def from_pb(cls, msg: embedding_pb2.EmbedResponse) -> EmbedResult:
        return cls(list(msg.embedding), msg.num_cached_tokens, msg.instance_id)

    def to_pb(self, request_id: str) -> embedding_pb2.EmbedResponse:
        return embedding_pb2.EmbedResponse(request_id=request_id, embedding=self.embedding,
                                           num_cached_tokens=self.num_cached_tokens, instance_id=self.instance_id)

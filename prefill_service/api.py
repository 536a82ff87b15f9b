"""The Prefill API's one owner: pdserve.v1.PrefillService's messages <-> the prefill
service's types, for both sides of the call (the prefill servicer here, decode
instances and the gateway through prefill_service.client). Torch-free: checking a KV
target against a pool is prefill_service.kv_export's work, not the wire's."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.outputs import Logprobs, RequestTimings
from common.engine.sampling_params import SamplingParams
from common.service.common_api import logprobs_from_pb, logprobs_to_pb, sampling_params_from_pb, sampling_params_to_pb
from protos.pdserve.v1 import prefill_pb2


@dataclass
class KvTargetSpec:
    """Where a prompt's KV goes, as the decode instance that reserved the blocks says."""

    kv_endpoint: str
    transfer_id: str
    dst_block_ids: list[int]  # decode pool blocks, from prompt block first_block_index on
    first_block_index: int
    num_layers: int  # the decode pool's geometry, checked against ours before any work
    dtype: str
    block_shape: list[int]
    timeout_s: float | None = None  # None: the prefill instance's --kv-transfer-timeout
    kv_layout_hash: str = ""  # what the decode pool's KV means (common.engine.kv_connector.layout)
    # Every decode rank's endpoint under tensor parallelism (rank 0's is kv_endpoint); empty: one rank.
    rank_kv_endpoints: list[str] = field(default_factory=list)
    # Seconds the transfer may take once sending starts (within timeout_s); None: no own limit.
    transfer_timeout_s: float | None = None

    @classmethod
    def from_pb(cls, msg: prefill_pb2.KvTarget) -> KvTargetSpec:
        return cls(msg.kv_endpoint, msg.transfer_id, list(msg.dst_block_ids), msg.first_block_index,
                   msg.num_layers, msg.dtype, list(msg.block_shape),
                   msg.timeout_ms / 1000 if msg.timeout_ms else None, msg.kv_layout_hash,
                   list(msg.rank_kv_endpoints),
                   msg.transfer_timeout_ms / 1000 if msg.transfer_timeout_ms else None)

    def to_pb(self) -> prefill_pb2.KvTarget:
        return prefill_pb2.KvTarget(
            kv_endpoint=self.kv_endpoint, transfer_id=self.transfer_id, dst_block_ids=self.dst_block_ids,
            first_block_index=self.first_block_index, num_layers=self.num_layers, dtype=self.dtype,
            block_shape=self.block_shape,
            timeout_ms=0 if self.timeout_s is None else max(1, round(self.timeout_s * 1000)),
            kv_layout_hash=self.kv_layout_hash, rank_kv_endpoints=self.rank_kv_endpoints,
            transfer_timeout_ms=0 if self.transfer_timeout_s is None else max(1, round(self.transfer_timeout_s * 1000)))


@dataclass
class PrefillJob:
    """One Prefill call: compute the prompt's KV, sample its first token, ship the KV."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    kv_target: KvTargetSpec | None = None  # None: prefill only (nothing is sent)
    cache_salt: str | None = None  # only requests of the same salt share cached blocks
    lora_name: str | None = None  # the LoRA adapter, by the name the instance serves it under

    @classmethod
    def from_pb(cls, msg: prefill_pb2.PrefillRequest) -> PrefillJob:
        params = sampling_params_from_pb(msg.sampling)
        kv_target = KvTargetSpec.from_pb(msg.kv_target) if msg.HasField("kv_target") else None
        return cls(msg.request_id, list(msg.prompt_token_ids), params, msg.priority, kv_target,
                   msg.cache_salt if msg.HasField("cache_salt") else None,
                   msg.lora_name if msg.HasField("lora_name") else None)

    def to_pb(self) -> prefill_pb2.PrefillRequest:
        msg = prefill_pb2.PrefillRequest(
            request_id=self.req_id, prompt_token_ids=self.prompt_token_ids,
            sampling=sampling_params_to_pb(self.params), priority=self.priority, cache_salt=self.cache_salt,
            lora_name=self.lora_name)
        if self.kv_target is not None:
            msg.kv_target.CopyFrom(self.kv_target.to_pb())
        return msg


@dataclass
class PrefillResult:
    """What a Prefill answers once the KV has landed (a failed transfer is an error status)."""

    token_ids: list[int]  # the first sampled token
    logprobs: list[Logprobs] | None
    num_cached_tokens: int  # prompt tokens the prefill instance's prefix cache held
    transferred: bool  # False: no target was given
    num_transferred_blocks: int = 0
    instance_id: str = ""  # the prefill instance that answered
    # (prompt token i + 1, its Logprobs) for each, when sampling.prompt_logprobs was set
    prompt_logprobs: list[tuple[int, Logprobs]] = field(default_factory=list)
    # The prefill's engine intervals, for this instance's log and span (not sent)
    timings: RequestTimings | None = None

    @classmethod
    def from_pb(cls, msg: prefill_pb2.PrefillResponse) -> PrefillResult:
        return cls(list(msg.token_ids), [logprobs_from_pb(lp)[1] for lp in msg.logprobs] or None,
                   msg.num_cached_tokens, msg.kv_transfer_state == prefill_pb2.KV_TRANSFER_STATE_COMPLETE,
                   msg.num_transferred_blocks, msg.instance_id,
                   [logprobs_from_pb(lp) for lp in msg.prompt_logprobs])

    def to_pb(self, request_id: str) -> prefill_pb2.PrefillResponse:
        return prefill_pb2.PrefillResponse(
            request_id=request_id, token_ids=self.token_ids,
            logprobs=[logprobs_to_pb(t, lp) for t, lp in zip(self.token_ids, self.logprobs or [])],
            num_cached_tokens=self.num_cached_tokens,
            kv_transfer_state=(prefill_pb2.KV_TRANSFER_STATE_COMPLETE if self.transferred
                               else prefill_pb2.KV_TRANSFER_STATE_NOT_REQUESTED),
            num_transferred_blocks=self.num_transferred_blocks, instance_id=self.instance_id,
            prompt_logprobs=[logprobs_to_pb(t, lp) for t, lp in self.prompt_logprobs])


@dataclass
class CachedBlocks:
    """Every block hash in a prefill instance's prefix cache, stamped with the sequence
    number of the last KV cache event it reflects (the gateway's resync)."""

    instance_id: str
    sequence: int
    block_hashes: list[int] = field(default_factory=list)
    block_size: int = 0

    @classmethod
    def from_pb(cls, msg: prefill_pb2.GetCachedBlocksResponse) -> CachedBlocks:
        return cls(msg.instance_id, msg.sequence, list(msg.block_hashes), msg.block_size)

    def to_pb(self) -> prefill_pb2.GetCachedBlocksResponse:
        return prefill_pb2.GetCachedBlocksResponse(instance_id=self.instance_id, sequence=self.sequence,
                                                   block_hashes=self.block_hashes, block_size=self.block_size)

"""The Decode API's one owner: pdserve.v1.DecodeService's messages <-> the decode
service's types, for both sides of the call (the servicer here, the gateway through
decode_service.client). Torch-free, so the gateway can import it."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.outputs import Logprobs
from common.engine.sampling_params import SamplingParams
from common.service.common_api import (
    FINISH_REASON_TO_PB,
    finish_reason_from_pb,
    logprobs_from_pb,
    logprobs_to_pb,
    sampling_params_from_pb,
    sampling_params_to_pb,
)
from protos.pdserve.v1 import decode_pb2


@dataclass
class DecodeJob:
    """One Decode call: a prompt to decode, prefilled remotely when prefill_address is set."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    prefill_address: str = ""  # empty: prefill locally
    prefill_instance_id: str = ""
    cache_salt: str | None = None  # only requests of the same salt share cached blocks
    lora_name: str | None = None  # the LoRA adapter, by the name the instances serve it under
    # Output a lost decode instance produced already: prefilled here with the prompt, continued after
    resumed_token_ids: list[int] = field(default_factory=list)
    # W3C trace context for the calls this one makes (gRPC metadata, not the message; see
    # common.service.tracing): the Decode span's own, on the decode side
    trace_headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_pb(cls, msg: decode_pb2.DecodeRequest) -> DecodeJob:
        params = sampling_params_from_pb(msg.sampling)
        return cls(msg.request_id, list(msg.prompt_token_ids), params, msg.priority, msg.prefill_address,
                   msg.prefill_instance_id, msg.cache_salt if msg.HasField("cache_salt") else None,
                   msg.lora_name if msg.HasField("lora_name") else None, list(msg.resumed_token_ids))

    def to_pb(self) -> decode_pb2.DecodeRequest:
        return decode_pb2.DecodeRequest(
            request_id=self.req_id, prompt_token_ids=self.prompt_token_ids,
            sampling=sampling_params_to_pb(self.params), priority=self.priority,
            prefill_address=self.prefill_address, prefill_instance_id=self.prefill_instance_id,
            cache_salt=self.cache_salt, lora_name=self.lora_name, resumed_token_ids=self.resumed_token_ids)


@dataclass
class DecodeOutput:
    """One message of a Decode stream; the last one has finish_reason set."""

    token_ids: list[int]
    logprobs: list[Logprobs] = field(default_factory=list)  # parallel to token_ids, or empty
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None until the last message
    stop_token_id: int | None = None  # the token that stopped it (EOS or a stop token)
    num_cached_tokens: int = 0  # prompt tokens found in a prefix cache
    prefill_instance_id: str = ""  # empty when prefilled on the decode instance
    decode_instance_id: str = ""
    request_id: str = ""
    # (prompt token i + 1, its Logprobs), in the first message, when sampling.prompt_logprobs was set
    prompt_logprobs: list[tuple[int, Logprobs]] = field(default_factory=list)

    @classmethod
    def from_pb(cls, msg: decode_pb2.DecodeResponse) -> DecodeOutput:
        finish_reason = finish_reason_from_pb(msg.finish_reason)
        return cls(
            token_ids=list(msg.token_ids),
            logprobs=[logprobs_from_pb(lp)[1] for lp in msg.logprobs],
            finish_reason=finish_reason,
            stop_token_id=msg.stop_token_id if finish_reason and msg.HasField("stop_token_id") else None,
            num_cached_tokens=msg.num_cached_tokens, prefill_instance_id=msg.prefill_instance_id,
            decode_instance_id=msg.decode_instance_id, request_id=msg.request_id,
            prompt_logprobs=[logprobs_from_pb(lp) for lp in msg.prompt_logprobs])

    def to_pb(self) -> decode_pb2.DecodeResponse:
        msg = decode_pb2.DecodeResponse(
            request_id=self.request_id, token_ids=self.token_ids,
            logprobs=[logprobs_to_pb(t, lp) for t, lp in zip(self.token_ids, self.logprobs)],
            finish_reason=FINISH_REASON_TO_PB[self.finish_reason], num_cached_tokens=self.num_cached_tokens,
            prefill_instance_id=self.prefill_instance_id, decode_instance_id=self.decode_instance_id,
            prompt_logprobs=[logprobs_to_pb(t, lp) for t, lp in self.prompt_logprobs])
        if self.stop_token_id is not None:
            msg.stop_token_id = self.stop_token_id
        return msg

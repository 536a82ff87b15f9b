"""The messages of common.proto that every API shares (sampling parameters, token
logprobs, finish reasons, Stats), mapped to and from the engine's types; no validation.

SamplingParams and the proto message share field names, so the mapping is generic.
Unset proto fields take the dataclass defaults. Two values need translating:
`None` for seed/logprobs is "unset", and max_tokens=None (no limit) travels as 0,
because unset max_tokens means the default (16); an empty allowed_token_ids is None (every
token). The constraint `structured_outputs` (vLLM's name) is the message `structured_output`,
its kind a oneof; logit_bias is a map.
"""
from __future__ import annotations

import dataclasses

from common.engine.outputs import Logprobs
from common.engine.sampling_params import SamplingParams
from common.engine.structured_output.params import KINDS, StructuredOutputsParams
from common.service.errors import invalid
from protos.pdserve.v1 import common_pb2

_NO_LIMIT_MAX_TOKENS = 0


def sampling_params_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams()
    for f in dataclasses.fields(SamplingParams):
        value = getattr(params, f.name)
        if f.name == "structured_outputs":
            if value is not None:
                msg.structured_output.CopyFrom(structured_output_to_pb(value))
            continue
        if f.name == "max_tokens" and value is None:
            value = _NO_LIMIT_MAX_TOKENS
        if f.name == "logit_bias":
            msg.logit_bias.update(value or {})
        elif f.name == "bad_words_token_ids":
            msg.bad_words_token_ids.extend(common_pb2.TokenSequence(token_ids=seq) for seq in value or ())
        elif isinstance(value, list):
            getattr(msg, f.name).extend(value)
        elif value is not None:
            setattr(msg, f.name, value)
    return msg


def sampling_params_from_pb(msg: common_pb2.SamplingParams, field_path: str = "") -> SamplingParams:
    """Values SamplingParams rejects are INVALID_ARGUMENT, named as the caller sent them
    (`field_path`, e.g. "sampling." for a field of GenerateRequest)."""
    kwargs = {}
    if msg.HasField("structured_output"):
        kwargs["structured_outputs"] = structured_output_from_pb(msg.structured_output, field_path)
    for f in dataclasses.fields(SamplingParams):
        if f.name == "structured_outputs":
            continue
        descriptor = msg.DESCRIPTOR.fields_by_name[f.name]
        if f.name == "logit_bias":
            kwargs[f.name] = dict(msg.logit_bias) or None
        elif f.name == "bad_words_token_ids":
            kwargs[f.name] = [list(seq.token_ids) for seq in msg.bad_words_token_ids] or None
        elif f.name == "bad_words":
            kwargs[f.name] = list(msg.bad_words) or None
        elif f.name == "allowed_token_ids":
            kwargs[f.name] = list(msg.allowed_token_ids) or None
        elif descriptor.is_repeated:
            kwargs[f.name] = list(getattr(msg, f.name))
        elif msg.HasField(f.name):
            kwargs[f.name] = getattr(msg, f.name)
    if kwargs.get("max_tokens") == _NO_LIMIT_MAX_TOKENS:
        kwargs["max_tokens"] = None
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:  # SamplingParams names the field and its allowed range
        raise invalid(f"{field_path}{e}") from None


def structured_output_to_pb(params: StructuredOutputsParams) -> common_pb2.StructuredOutput:
    kind, value = params.kind, params.value
    if kind == "choice":
        value = common_pb2.StringList(values=value)
    return common_pb2.StructuredOutput(**{kind: value}, start_after_token_ids=params.start_after_token_ids)


def structured_output_from_pb(msg: common_pb2.StructuredOutput, field_path: str = "") -> StructuredOutputsParams:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise invalid(f"{field_path}structured_output must set one of {', '.join(KINDS)}")
    value = list(msg.choice.values) if kind == "choice" else getattr(msg, kind)
    if kind == "json_object" and not value:  # set in the oneof, but it asks for nothing
        raise invalid(f"{field_path}structured_output.json_object must be true, got false")
    try:
        return StructuredOutputsParams(**{kind: value}, start_after_token_ids=tuple(msg.start_after_token_ids))
    except ValueError as e:  # named structured_outputs.<kind>, the engine's name
        raise invalid(f"{field_path}{str(e).replace('structured_outputs', 'structured_output', 1)}") from None


def prompt_logprob_pairs(prompt_token_ids: list[int],
                         prompt_logprobs: list[Logprobs | None] | None) -> list[tuple[int, Logprobs]]:
    """An engine's prompt_logprobs (None for the first token) as (prompt token i + 1, its
    Logprobs), the form every message carries them in; [] where there are none."""
    if prompt_logprobs is None:
        return []
    return list(zip(prompt_token_ids[1:], prompt_logprobs[1:]))


def logprobs_to_pb(token_id: int, logprobs: Logprobs) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=token_id, logprob=logprobs.token_logprob,
                                   top_token_ids=logprobs.top_token_ids,
                                   top_logprobs=logprobs.top_logprobs, rank=logprobs.token_rank)


def logprobs_from_pb(msg: common_pb2.TokenLogprob) -> tuple[int, Logprobs]:
    return msg.token_id, Logprobs(token_logprob=msg.logprob, top_token_ids=list(msg.top_token_ids),
                                  top_logprobs=list(msg.top_logprobs),
                                  token_rank=msg.rank if msg.HasField("rank") else None)


FINISH_REASON_TO_PB = {None: common_pb2.FINISH_REASON_UNSPECIFIED, "stop": common_pb2.FINISH_REASON_STOP,
                       "length": common_pb2.FINISH_REASON_LENGTH, "abort": common_pb2.FINISH_REASON_ABORT}
_FINISH_REASON_FROM_PB = {pb: reason for reason, pb in FINISH_REASON_TO_PB.items()}


def finish_reason_from_pb(value: int) -> str | None:
    """None for FINISH_REASON_UNSPECIFIED (the request goes on) and for values this build does not know."""
    return _FINISH_REASON_FROM_PB.get(value)


def stats_response(instance_id: str, stats: dict, load) -> "common_pb2.StatsResponse":
    """The Stats RPC's answer, the same for both roles: load plus prefix-cache counters."""
    return common_pb2.StatsResponse(
        instance_id=instance_id, load=load.to_pb(),
        prefix_cache_queried_tokens=stats["prefix_cache_queried_tokens"],
        prefix_cache_hit_tokens=stats["prefix_cache_hit_tokens"],
        num_finished_requests=stats["num_finished_requests"])

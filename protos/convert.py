"""Field mapping between engine dataclasses and their proto messages; no validation.

SamplingParams and the proto message share field names, so the mapping is generic.
Unset proto fields take the dataclass defaults. Two values need translating:
`None` for seed/logprobs is "unset", and max_tokens=None (no limit) travels as 0,
because unset max_tokens means the default (16).
"""
from __future__ import annotations

import dataclasses

from common.engine.outputs import Logprobs
from common.engine.sampling_params import SamplingParams
from protos.pdserve.v1 import common_pb2

_NO_LIMIT_MAX_TOKENS = 0


def sampling_params_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams()
    for f in dataclasses.fields(SamplingParams):
        value = getattr(params, f.name)
        if f.name == "max_tokens" and value is None:
            value = _NO_LIMIT_MAX_TOKENS
        if isinstance(value, list):
            getattr(msg, f.name).extend(value)
        elif value is not None:
            setattr(msg, f.name, value)
    return msg


def sampling_params_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    kwargs = {}
    for f in dataclasses.fields(SamplingParams):
        descriptor = msg.DESCRIPTOR.fields_by_name[f.name]
        if descriptor.is_repeated:
            kwargs[f.name] = list(getattr(msg, f.name))
        elif msg.HasField(f.name):
            kwargs[f.name] = getattr(msg, f.name)
    if kwargs.get("max_tokens") == _NO_LIMIT_MAX_TOKENS:
        kwargs["max_tokens"] = None
    return SamplingParams(**kwargs)


def logprobs_to_pb(token_id: int, logprobs: Logprobs) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=token_id, logprob=logprobs.token_logprob,
                                   top_token_ids=logprobs.top_token_ids,
                                   top_logprobs=logprobs.top_logprobs)


def logprobs_from_pb(msg: common_pb2.TokenLogprob) -> tuple[int, Logprobs]:
    return msg.token_id, Logprobs(token_logprob=msg.logprob, top_token_ids=list(msg.top_token_ids),
                                  top_logprobs=list(msg.top_logprobs))

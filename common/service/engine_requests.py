"""An RPC's request as the engine takes it: validated against the served model, with
the model's end-of-sequence tokens and the caller's request id."""
from __future__ import annotations

import grpc

from common.engine.request import Request
from common.engine.sampling_params import SamplingParams, validate_prompt_token_ids
from common.service.errors import ServiceError


def eos_token_ids(core) -> tuple[int, ...]:
    """The tokens that end generation, as the offline LLM computes them."""
    from common.text.tokenizer import load_tokenizer
    return tuple(sorted(set(core.model_config.eos_token_ids)
                        | set(load_tokenizer(core.model_dir).eos_token_ids)))


def validate_request(prompt_token_ids: list[int], params: SamplingParams, core) -> None:
    """Raise ServiceError(INVALID_ARGUMENT) for what the engine cannot serve."""
    try:
        validate_prompt_token_ids(prompt_token_ids, core.model_config.vocab_size)
        params.validate_token_ids(core.model_config.vocab_size)
    except ValueError as e:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    if params.n != 1:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"n must be 1 on an engine instance (the gateway fans out n > 1); got {params.n}")
    if len(prompt_token_ids) > core.max_model_len:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"prompt has {len(prompt_token_ids)} tokens, longer than the maximum model "
                           f"length of {core.max_model_len} tokens")


def new_request(req_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                eos: tuple[int, ...]) -> Request:
    if not req_id:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
    return Request(req_id, prompt_token_ids, params, eos_token_ids=eos, priority=priority)

"""An RPC's request as the engine takes it: validated against the served model, with
the model's end-of-sequence tokens and the caller's request id."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from common.engine.block_hash import check_cache_salt
from common.engine.errors import LoRAAdaptersBusyError, RequestIdReleasingError
from common.engine.lora.request import LoRARequest
from common.engine.outputs import EngineCoreOutput, RequestTimings
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams, validate_prompt_token_ids
from common.service.errors import DuplicateRequestError, ServiceError

T = TypeVar("T")
# How long an admission waits for an earlier request of the same id to be released (a
# client that cancelled a stream and sent it again at once: the abort, and a KV
# transfer it may hold, end on the engine thread a moment later).
ID_RELEASE_WAIT_S = 1.0
ID_RETRY_FIRST_BACKOFF_S = 0.005
ID_RETRY_MAX_BACKOFF_S = 0.1


def eos_token_ids(core) -> tuple[int, ...]:
    """The tokens that end generation, as the offline LLM computes them."""
    from common.text.tokenizer import load_eos_token_ids
    return tuple(sorted(set(core.model_config.eos_token_ids) | set(load_eos_token_ids(core.model_dir))))


def validate_request(prompt_token_ids: list[int], params: SamplingParams, core,
                     resumed_token_ids: list[int] = ()) -> None:
    """Raise ServiceError(INVALID_ARGUMENT) for what the engine cannot serve."""
    validate_prompt(prompt_token_ids, core)
    if resumed_token_ids:
        validate_resumed(len(prompt_token_ids), resumed_token_ids, params, core)
    try:
        params.validate_token_ids(core.model_config.vocab_size)
    except ValueError as e:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    if params.n != 1:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"n must be 1 on an engine instance (the gateway fans out n > 1); got {params.n}")


def validate_prompt(prompt_token_ids: list[int], core) -> None:
    """Raise ServiceError(INVALID_ARGUMENT) for a prompt the engine cannot take: an id out of
    the vocabulary, more tokens than max_model_len."""
    try:
        validate_prompt_token_ids(prompt_token_ids, core.model_config.vocab_size)
    except ValueError as e:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    if len(prompt_token_ids) > core.max_model_len:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"prompt has {len(prompt_token_ids)} tokens, longer than the maximum model "
                           f"length of {core.max_model_len} tokens")


def validate_resumed(num_prompt_tokens: int, resumed_token_ids: list[int], params: SamplingParams, core) -> None:
    """Raise ServiceError(INVALID_ARGUMENT) unless a request resumed after resumed_token_ids of
    output can still produce a token here: ids in the vocabulary, room under max_tokens and
    under max_model_len."""
    try:
        validate_prompt_token_ids(resumed_token_ids, core.model_config.vocab_size, "resumed_token_ids")
    except ValueError as e:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    num_resumed = len(resumed_token_ids)
    if params.max_tokens is not None and num_resumed >= params.max_tokens:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{num_resumed} resumed_token_ids leave nothing to generate under max_tokens "
                           f"{params.max_tokens}")
    if num_prompt_tokens + num_resumed >= core.max_model_len:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"prompt ({num_prompt_tokens} tokens) and {num_resumed} resumed_token_ids reach the "
                           f"maximum model length of {core.max_model_len} tokens: nothing is left to generate")


def add_request(core, request: Request) -> None:
    """Engine thread: queue a request computed here from its prompt (a prefill, whose KV goes
    where its kv_transfer_params say, or an embedding)."""
    if request.req_id in core.scheduler.requests or request.req_id in core.scheduler.held_requests:
        raise DuplicateRequestError(f"request {request.req_id!r} is already in flight on this instance")
    core.add_request(request)


async def finished_output(stream) -> EngineCoreOutput:
    """The last output of a request's engine stream (the one with finish_reason set)."""
    async for output in stream:
        if output.finished:
            return output
    raise RuntimeError("engine stream ended without a finished output")


def new_request(req_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                eos: tuple[int, ...], cache_salt: str | None = None,
                lora_request: LoRARequest | None = None, resumed_token_ids: list[int] = ()) -> Request:
    """The engine's Request; resumed_token_ids (checked by validate_request) are its output so far."""
    if not req_id:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
    return Request(req_id, prompt_token_ids, params, eos_token_ids=eos, priority=priority,
                   cache_salt=checked_cache_salt(cache_salt), lora_request=lora_request,
                   output_token_ids=resumed_token_ids)


def timing_fields(timings: RequestTimings) -> dict[str, float]:
    """A finished request's engine timings as end-of-request log fields (and span attributes:
    common.service.tracing names them as vLLM's spans do)."""
    return {"queue_s": round(timings.queued_s, 4), "prefill_s": round(timings.prefill_s, 4),
            "decode_s": round(timings.decode_s, 4), "inference_s": round(timings.inference_s, 4)}


def refused(error: ValueError) -> ServiceError:
    """The status of a request the engine refused at admission: RESOURCE_EXHAUSTED while all
    its LoRA adapter slots are taken (retry later), else INVALID_ARGUMENT (the request's fault)."""
    code = (grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(error, LoRAAdaptersBusyError)
            else grpc.StatusCode.INVALID_ARGUMENT)
    return ServiceError(code, str(error))


def checked_cache_salt(cache_salt: str | None) -> str | None:
    """The salt, or INVALID_ARGUMENT saying what vLLM's bounds refuse."""
    try:
        return None if cache_salt is None else check_cache_salt(cache_salt)
    except ValueError as e:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


async def admit_when_id_free(admit: Callable[[], Awaitable[T]], wait_s: float = ID_RELEASE_WAIT_S) -> T:
    """admit(), retried with backoff while the engine still holds an earlier request of
    this id (DuplicateRequestError, RequestIdReleasingError) for up to wait_s; then
    ALREADY_EXISTS saying so."""
    deadline = time.monotonic() + wait_s
    backoff = ID_RETRY_FIRST_BACKOFF_S
    while True:
        try:
            return await admit()
        except (DuplicateRequestError, RequestIdReleasingError) as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"{e}; it was not released within {wait_s:g}s: retry later") from None
            await asyncio.sleep(min(backoff, left))
            backoff = min(2 * backoff, ID_RETRY_MAX_BACKOFF_S)


async def open_stream_when_id_free(engine, req_id: str):
    """engine.open_stream(req_id), waiting as admit_when_id_free does while a cancelled
    earlier request of the id is still being released."""
    async def open_stream():
        return engine.open_stream(req_id)
    return await admit_when_id_free(open_stream)

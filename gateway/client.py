"""Python clients of the gateway's GenerateService, for backend services.

    from gateway.client import Client
    with Client("127.0.0.1:50051") as client:
        result = client.generate("The capital of France is", max_tokens=16, temperature=0)
        print(result.text, result.finish_reason, result.usage)
        for chunk in client.generate_stream(messages=[{"role": "user", "content": "Hi"}]):
            print(chunk.text, end="", flush=True)

`AsyncClient` is the same for asyncio (`await client.generate(...)`,
`async for chunk in client.generate_stream(...)`). The prompt is text, token ids
(a list of ints) or chat messages (a list of {"role", "content"} dicts), given as the
first argument or as token_ids= / messages=. A stream's request is sent at once;
reading it yields deltas, and closing or dropping it cancels the request
everywhere (decode and prefill included). Sampling values are SamplingParams
fields as keywords (or sampling=SamplingParams(...)); they are checked here first,
so a bad value raises ValueError before anything is sent. Chat prompts also take
chat_options=ChatTemplateOptions(...) (continue the last message, template variables,
tools), any prompt add_special_tokens=. Failures on the server raise grpc.RpcError with
the gateway's status (INVALID_ARGUMENT, UNAVAILABLE, ...). A gateway started with
--api-key needs api_key= (or PDSERVE_API_KEY in the environment).

Results are gateway.types.GenerationDelta: text, token_ids, logprobs, finish_reason,
stop_token_id, stop_string, usage (prompt, completion, cached tokens), and the
prefill/decode instance ids that served the request. `client.embed(prompt,
pooling=PoolingParams(...))` gives a gateway.types.EmbeddingResult (embedding, usage,
the instance that computed it).

RegistryClient (common.service.registration) is re-exported for the engine instances.
"""
from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc

from common.engine.pooling_params import PoolingParams
from common.engine.sampling_params import SamplingParams
from common.service.common_api import sampling_params_to_pb
from common.service.embedding_api import pooling_params_to_pb
from common.text.chat_template import ChatTemplateOptions
from gateway.api import (beam_search_result_from_pb, chat_message_to_pb, chat_options_to_pb, delta_from_pb,
                         deployment_info_from_pb, embedding_result_from_pb)
from gateway.api_keys import API_KEY_ENV
from gateway.types import BeamSearchResult, DeploymentInfo, EmbeddingResult, GenerationDelta
from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc

Prompt = str | Sequence[int] | Sequence[dict]  # text, token ids, or chat messages {role, content}
_OPTIONS = ("request_id", "priority", "return_token_ids", "return_logprobs", "model", "chat_options",
            "add_special_tokens", "split_reasoning", "cache_salt")


def build_generate_request(prompt: Prompt, sampling: SamplingParams | None = None, request_id: str = "",
                           priority: int = 0, return_token_ids: bool = False,
                           return_logprobs: bool = False, model: str = "",
                           chat_options: ChatTemplateOptions | None = None,
                           add_special_tokens: bool | None = None,
                           split_reasoning: bool = False,
                           cache_salt: str | None = None) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(
        sampling=sampling_params_to_pb(sampling or SamplingParams()), request_id=request_id,
        priority=priority, model=model, cache_salt=cache_salt,
        output=generate_pb2.OutputOptions(return_token_ids=return_token_ids, return_logprobs=return_logprobs,
                                          split_reasoning=split_reasoning))
    return _with_prompt(request, prompt, chat_options, add_special_tokens)


def build_embedding_request(prompt: Prompt, pooling: PoolingParams | None = None, request_id: str = "",
                            priority: int = 0, model: str = "", chat_options: ChatTemplateOptions | None = None,
                            add_special_tokens: bool | None = None, truncate_prompt_tokens: int | None = None,
                            cache_salt: str | None = None) -> generate_pb2.EmbeddingRequest:
    request = generate_pb2.EmbeddingRequest(pooling=pooling_params_to_pb(pooling or PoolingParams()),
                                            request_id=request_id, priority=priority, model=model,
                                            cache_salt=cache_salt)
    if truncate_prompt_tokens is not None:
        request.truncate_prompt_tokens = truncate_prompt_tokens
    return _with_prompt(request, prompt, chat_options, add_special_tokens)


def _with_prompt(request, prompt: Prompt, chat_options: ChatTemplateOptions | None,
                 add_special_tokens: bool | None):
    """request (a GenerateRequest or an EmbeddingRequest) with its prompt set."""
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        request.messages.messages.extend(chat_message_to_pb(m) for m in prompt)
        if chat_options is not None:
            chat_options_to_pb(chat_options, request.messages)
    else:
        request.token_ids.ids.extend(prompt)
    if chat_options is not None and not request.HasField("messages"):
        raise ValueError("chat_options apply only to a prompt of chat messages")
    return request


def _beam_search_request(prompt: Prompt | None, token_ids: Sequence[int] | None, messages: Sequence[dict] | None,
                         beam_width: int, length_penalty: float | None,
                         kwargs: dict[str, Any]) -> generate_pb2.BeamSearchRequest:
    msg = generate_pb2.BeamSearchRequest(request=_request(prompt, token_ids, messages, None, kwargs),
                                         beam_width=beam_width)
    if length_penalty is not None:
        msg.length_penalty = length_penalty
    return msg


def _request(prompt: Prompt | None, token_ids: Sequence[int] | None, messages: Sequence[dict] | None,
             sampling: SamplingParams | None, kwargs: dict[str, Any]) -> generate_pb2.GenerateRequest:
    given = [p for p in (prompt, token_ids, messages) if p is not None]
    if len(given) != 1:
        raise ValueError("give exactly one prompt: text or a list as the first argument, token_ids= or messages=")
    options = {name: kwargs.pop(name) for name in _OPTIONS if name in kwargs}
    if kwargs:  # the rest are SamplingParams fields
        sampling = sampling.clone(**kwargs) if sampling else SamplingParams(**kwargs)
    return build_generate_request(given[0], sampling, **options)


class ResponseStream:
    """The deltas of one GenerateStream call. The request is sent when the stream is
    made, not when it is first read; close() (or dropping the stream, or leaving a
    `with` block) cancels it, which cancels decode and prefill."""

    def __init__(self, call: grpc.Call):
        self._call = call

    def __iter__(self) -> Iterator[GenerationDelta]:
        return self

    def __next__(self) -> GenerationDelta:
        return delta_from_pb(next(self._call))

    def close(self) -> None:
        self._call.cancel()  # no-op once finished

    def __enter__(self) -> "ResponseStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncResponseStream:
    """ResponseStream for asyncio: `async for delta in stream`, `await stream.close()`."""

    def __init__(self, call: grpc.aio.UnaryStreamCall):
        self._call = call

    def __aiter__(self) -> AsyncIterator[GenerationDelta]:
        return self

    async def __anext__(self) -> GenerationDelta:
        response = await self._call.read()
        if response is grpc.aio.EOF:
            raise StopAsyncIteration
        return delta_from_pb(response)

    async def close(self) -> None:
        self._call.cancel()

    async def __aenter__(self) -> "AsyncResponseStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def auth_metadata(api_key: str | None = None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that carries `api_key`, or PDSERVE_API_KEY's (what a gateway started
    with --api-key needs); None without a key."""
    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


class AsyncClient:
    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = None, api_key: str | None = None):
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)
        self.timeout = timeout  # default per-call deadline in seconds
        self._metadata = auth_metadata(api_key)

    async def generate(self, prompt: Prompt | None = None, *, token_ids: Sequence[int] | None = None,
                       messages: Sequence[dict] | None = None, sampling: SamplingParams | None = None,
                       timeout: float | None = None, **kwargs) -> GenerationDelta:
        request = _request(prompt, token_ids, messages, sampling, kwargs)
        return delta_from_pb(await self._stub.Generate(request, timeout=timeout or self.timeout,
                                                       metadata=self._metadata))

    def generate_stream(self, prompt: Prompt | None = None, *, token_ids: Sequence[int] | None = None,
                        messages: Sequence[dict] | None = None, sampling: SamplingParams | None = None,
                        timeout: float | None = None, **kwargs) -> "AsyncResponseStream":
        return AsyncResponseStream(self._stub.GenerateStream(
            _request(prompt, token_ids, messages, sampling, kwargs), timeout=timeout or self.timeout,
            metadata=self._metadata))

    async def beam_search(self, prompt: Prompt | None = None, *, beam_width: int,
                          token_ids: Sequence[int] | None = None, messages: Sequence[dict] | None = None,
                          length_penalty: float | None = None, timeout: float | None = None,
                          **kwargs) -> BeamSearchResult:
        """Client.beam_search's, awaited."""
        request = _beam_search_request(prompt, token_ids, messages, beam_width, length_penalty, kwargs)
        return beam_search_result_from_pb(await self._stub.BeamSearch(request, timeout=timeout or self.timeout,
                                                                      metadata=self._metadata))

    async def embed(self, prompt: Prompt, *, pooling: PoolingParams | None = None, timeout: float | None = None,
                    **options) -> EmbeddingResult:
        """The prompt's embedding; options: build_embedding_request's (request_id, priority, model,
        chat_options, add_special_tokens, truncate_prompt_tokens, cache_salt)."""
        request = build_embedding_request(prompt, pooling, **options)
        return embedding_result_from_pb(await self._stub.Embed(request, timeout=timeout or self.timeout,
                                                               metadata=self._metadata))

    async def model_info(self, timeout: float | None = None) -> DeploymentInfo:
        return deployment_info_from_pb(await self._stub.ModelInfo(
            generate_pb2.ModelInfoRequest(), timeout=timeout or self.timeout, metadata=self._metadata))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


GatewayClient = AsyncClient  # the earlier name


class Client:
    """Blocking twin of AsyncClient (grpc's sync channel; safe to share across threads)."""

    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = None, api_key: str | None = None):
        self._channel = grpc.insecure_channel(address)
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)
        self.timeout = timeout
        self._metadata = auth_metadata(api_key)

    def generate(self, prompt: Prompt | None = None, *, token_ids: Sequence[int] | None = None,
                 messages: Sequence[dict] | None = None, sampling: SamplingParams | None = None,
                 timeout: float | None = None, **kwargs) -> GenerationDelta:
        request = _request(prompt, token_ids, messages, sampling, kwargs)
        return delta_from_pb(self._stub.Generate(request, timeout=timeout or self.timeout, metadata=self._metadata))

    def generate_stream(self, prompt: Prompt | None = None, *, token_ids: Sequence[int] | None = None,
                        messages: Sequence[dict] | None = None, sampling: SamplingParams | None = None,
                        timeout: float | None = None, **kwargs) -> "ResponseStream":
        return ResponseStream(self._stub.GenerateStream(
            _request(prompt, token_ids, messages, sampling, kwargs), timeout=timeout or self.timeout,
            metadata=self._metadata))

    def beam_search(self, prompt: Prompt | None = None, *, beam_width: int, token_ids: Sequence[int] | None = None,
                    messages: Sequence[dict] | None = None, length_penalty: float | None = None,
                    timeout: float | None = None, **kwargs) -> BeamSearchResult:
        """The beam_width best continuations, best first; kwargs: max_tokens, ignore_eos,
        include_stop_str_in_output, skip_special_tokens, and the request options (request_id ...)."""
        request = _beam_search_request(prompt, token_ids, messages, beam_width, length_penalty, kwargs)
        return beam_search_result_from_pb(self._stub.BeamSearch(request, timeout=timeout or self.timeout,
                                                                metadata=self._metadata))

    def embed(self, prompt: Prompt, *, pooling: PoolingParams | None = None, timeout: float | None = None,
              **options) -> EmbeddingResult:
        request = build_embedding_request(prompt, pooling, **options)
        return embedding_result_from_pb(self._stub.Embed(request, timeout=timeout or self.timeout,
                                                         metadata=self._metadata))

    def model_info(self, timeout: float | None = None) -> DeploymentInfo:
        return deployment_info_from_pb(self._stub.ModelInfo(
            generate_pb2.ModelInfoRequest(), timeout=timeout or self.timeout, metadata=self._metadata))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

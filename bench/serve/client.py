"""The load generator: a backend interface, the gRPC and OpenAI HTTP backends, and the
pacing loop.

A backend turns one BenchRequest into a stream of (arrival time, tokens in that
chunk) pairs; everything else (timing, pacing, concurrency, metrics) is shared, so
the gRPC and the OpenAI-compatible HTTP figures of one workload are comparable.

Timing follows vLLM: a request's send time is taken after it gets its concurrency
slot, just before the call, so --max-concurrency queueing is not counted as TTFT;
chunk times are taken the moment each message is handed to us. One gRPC channel
(one HTTP/2 connection) carries every request, as vLLM shares one HTTP session.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from google.protobuf.json_format import MessageToDict

from bench.serve.arrivals import send_offsets
from bench.serve.datasets import BenchRequest
from bench.serve.metrics import RequestOutcome
from common.engine.structured_output.params import StructuredOutputsParams
from common.service.common_api import structured_output_to_pb
from gateway.api_keys import API_KEY_ENV
from gateway.client import auth_metadata
from protos.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc


class Backend:
    """What the benchmark needs from a serving endpoint."""

    name = "abstract"

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def server_info(self) -> dict | None:
        """What is served (vocab_size, eos_token_ids, max_model_len, ...), if the API says."""
        return None

    def stream(self, request: BenchRequest) -> AsyncIterator[tuple[float, int]]:
        """Send `request`; yield (time.perf_counter() at arrival, tokens in it) per chunk.
        Raise on failure; the caller records the error."""
        raise NotImplementedError

    async def __aenter__(self) -> "Backend":
        await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class GrpcGenerateBackend(Backend):
    """pdserve.v1.GenerateService/GenerateStream on the gateway (with PDSERVE_API_KEY's key,
    when set, for a gateway started with --api-key)."""

    name = "grpc"

    def __init__(self, address: str, model: str = "", temperature: float = 0.0, ignore_eos: bool = True,
                 timeout_s: float | None = None, request_id_prefix: str = "bench"):
        self.address = address
        self.model = model
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.timeout_s = timeout_s
        self.request_id_prefix = request_id_prefix
        self._ids = itertools.count()  # the gateway refuses two in-flight requests with one id
        self._metadata = auth_metadata()
        self._channel: grpc.aio.Channel | None = None
        self._stub: generate_pb2_grpc.GenerateServiceStub | None = None

    async def open(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.address)
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def server_info(self) -> dict | None:
        response = await self._stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=30, metadata=self._metadata)
        return MessageToDict(response, preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)

    def _stub_for(self, request: BenchRequest) -> generate_pb2_grpc.GenerateServiceStub:
        """The stub that sends `request` (one gateway here; a subclass may spread them)."""
        return self._stub

    def build_request(self, request: BenchRequest) -> generate_pb2.GenerateRequest:
        message = generate_pb2.GenerateRequest(
            sampling=common_pb2.SamplingParams(max_tokens=request.output_len, ignore_eos=self.ignore_eos,
                                               temperature=self.temperature),
            request_id=f"{self.request_id_prefix}-{next(self._ids)}", model=self.model,
            # Token ids make the per-chunk token count exact (a text delta may be empty
            # while a multi-byte character is incomplete).
            output=generate_pb2.OutputOptions(return_token_ids=True))
        if isinstance(request.prompt, str):
            message.text = request.prompt
        else:
            message.token_ids.ids.extend(request.prompt)
        if request.structured_output:  # vLLM's structured_outputs object, as the gateway maps it
            message.sampling.structured_output.CopyFrom(
                structured_output_to_pb(StructuredOutputsParams(**request.structured_output)))
        return message

    async def stream(self, request: BenchRequest) -> AsyncIterator[tuple[float, int]]:
        async for arrival, response in self.stream_messages(request):
            yield arrival, len(response.token_ids)

    async def stream_messages(self, request: BenchRequest
                              ) -> AsyncIterator[tuple[float, generate_pb2.GenerateResponse]]:
        """(time.perf_counter() at arrival, the message) per message: its token ids and usage
        too, for a client that reads the answer (a conversation's next turn carries it)."""
        call = self._stub_for(request).GenerateStream(self.build_request(request), timeout=self.timeout_s,
                                                      metadata=self._metadata)
        try:
            async for response in call:
                yield time.perf_counter(), response
        finally:
            call.cancel()  # a no-op once finished; frees the request if we stopped early


class OpenAICompletionsBackend(Backend):
    """POST /v1/completions with stream=true on any OpenAI-compatible server (the gateway's
    HTTP port, vLLM, SGLang, ...), read as server-sent events over one aiohttp session.

    The OpenAI stream carries text, not token ids, so each chunk with text counts as one
    token (as `vllm bench serve` counts them) and the final usage chunk
    (stream_options.include_usage) corrects the total: tokens a chunk did not show (text
    held back until a character is complete) are added to the request's last chunk.
    OPENAI_API_KEY (or PDSERVE_API_KEY), when set, is sent as the bearer token.
    """

    name = "openai"
    path = "/v1/completions"

    def __init__(self, base_url: str, model: str = "", temperature: float = 0.0, ignore_eos: bool = True,
                 timeout_s: float | None = None, return_token_ids: bool = False):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.timeout_s = timeout_s
        self.return_token_ids = return_token_ids  # vLLM's extension: each chunk's token ids beside its text
        self._session = None

    async def open(self) -> None:
        import aiohttp
        # No connection limit: --max-concurrency is the only cap, as with the gRPC backend.
        api_key = os.environ.get("OPENAI_API_KEY") or os.environ.get(API_KEY_ENV)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                              headers={"Authorization": f"Bearer {api_key}"} if api_key else None)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def server_info(self) -> dict | None:
        """model_name and max_model_len from /v1/models (the first model listed)."""
        async with self._session.get(f"{self.base_url}/v1/models") as response:
            body = await response.json(content_type=None)
            if response.status != 200:
                raise OpenAIHTTPError(response.status, body)
        models = body.get("data") or [{}]
        if not self.model:
            self.model = models[0].get("id", "")
        return {"model_name": models[0].get("id", ""), "max_model_len": models[0].get("max_model_len")}

    def build_body(self, request: BenchRequest) -> dict:
        body = {"model": self.model, "prompt": request.prompt, "max_tokens": request.output_len,
                "temperature": self.temperature, "ignore_eos": self.ignore_eos, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.return_token_ids:
            body["return_token_ids"] = True
        if request.structured_output:
            body["structured_outputs"] = request.structured_output  # vLLM's field, which the gateway takes
        return body

    async def stream_chunks(self, request: BenchRequest) -> AsyncIterator[tuple[float, dict]]:
        """(arrival time, chunk) for every chunk of the stream, parsed; an error status or an
        error event raises OpenAIHTTPError."""
        async with self._session.post(f"{self.base_url}{self.path}", json=self.build_body(request)) as response:
            if response.status != 200:
                raise OpenAIHTTPError(response.status, await response.json(content_type=None))
            async for line in response.content:
                arrival = time.perf_counter()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise OpenAIHTTPError(200, chunk)
                yield arrival, chunk

    @staticmethod
    def choice_text(choice: dict) -> str:
        """The text a streamed choice adds."""
        return choice.get("text") or ""

    async def stream(self, request: BenchRequest, observe: Callable[[dict], None] | None = None
                     ) -> AsyncIterator[tuple[float, int]]:
        """(arrival, tokens) per chunk with text; observe, when given, sees every chunk."""
        held: tuple[float, int] | None = None  # the latest text chunk, until the next one or the usage
        num_counted, num_reported = 0, None
        async for arrival, chunk in self.stream_chunks(request):
            if observe is not None:
                observe(chunk)
            if any(self.choice_text(choice) for choice in chunk.get("choices") or ()):
                if held is not None:
                    yield held
                held, num_counted = (arrival, 1), num_counted + 1
            if chunk.get("usage"):
                num_reported = chunk["usage"].get("completion_tokens")
        if held is not None:
            if num_reported is not None and num_reported > num_counted:
                held = (held[0], held[1] + num_reported - num_counted)
            yield held


class OpenAIChatBackend(OpenAICompletionsBackend):
    """POST /v1/chat/completions with stream=true (vLLM's openai-chat backend): a request's
    messages, or its text prompt as one user message, through the server's chat template;
    tokens counted as OpenAICompletionsBackend counts them, from the deltas' content."""

    name = "openai-chat"
    path = "/v1/chat/completions"

    def build_body(self, request: BenchRequest) -> dict:
        if request.messages is None and not isinstance(request.prompt, str):
            raise ValueError("the chat API takes text: a token-id prompt cannot be a message")
        body = super().build_body(request)
        del body["prompt"]
        body["messages"] = request.messages or [{"role": "user", "content": request.prompt}]
        return body

    @staticmethod
    def choice_text(choice: dict) -> str:
        return (choice.get("delta") or {}).get("content") or ""


class OpenAIHTTPError(Exception):
    """An error status, or an error event in the stream, with OpenAI's error body."""

    def __init__(self, status: int, body):
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else str(body)
        super().__init__(f"HTTP {status}: {message}" if status != 200 else message)


def describe_error(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


async def send_one(backend: Backend, request: BenchRequest, benchmark_start: float) -> RequestOutcome:
    outcome = RequestOutcome(prompt_len=request.prompt_len)
    sent = time.perf_counter()
    outcome.start_s = sent - benchmark_start
    try:
        async for arrival, num_tokens in backend.stream(request):
            if num_tokens > 0:  # e.g. a closing message with only finish_reason and usage
                outcome.chunk_offsets_s.append(arrival - sent)
                outcome.chunk_tokens.append(num_tokens)
    except Exception as error:  # noqa: BLE001 -- any failure is one failed request, not a crash
        outcome.error = describe_error(error)
    if not outcome.error and not outcome.chunk_offsets_s:
        outcome.error = "the stream ended without a single token"
    return outcome


async def probe(backend: Backend, request: BenchRequest) -> RequestOutcome:
    """One short request before measuring, to fail fast on a wrong address or model.
    The prompt is reversed so it does not warm the prefix cache for a measured request."""
    reversed_prompt = request.prompt[::-1]
    return await send_one(backend, BenchRequest(reversed_prompt, request.prompt_len,
                                                min(request.output_len, 4)), time.perf_counter())


async def run_benchmark(backend: Backend, requests: Sequence[BenchRequest], request_rate: float,
                        burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                        progress: bool = False) -> tuple[list[RequestOutcome], float]:
    """Send `requests` on the arrival schedule; return their outcomes (in send order)
    and the benchmark's wall duration in seconds."""
    from tqdm import tqdm

    offsets = send_offsets(len(requests), request_rate, burstiness, seed)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, unit="req",
               desc=f"rate {request_rate:g}/s")

    async def paced(request: BenchRequest) -> RequestOutcome:
        if slots is None:
            outcome = await send_one(backend, request, start)
        else:
            async with slots:
                outcome = await send_one(backend, request, start)
        bar.update(1)
        return outcome

    tasks = []
    start = time.perf_counter()
    try:
        for request, offset in zip(requests, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(paced(request)))
        outcomes = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # only matters when we are being cancelled ourselves
        bar.close()
    return list(outcomes), time.perf_counter() - start

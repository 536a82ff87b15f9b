"""The load generator: a backend interface, the gRPC backend, and the pacing loop.

A backend turns one BenchRequest into a stream of (arrival time, tokens in that
chunk) pairs; everything else (timing, pacing, concurrency, metrics) is shared, so an
OpenAI-compatible HTTP backend only has to implement `stream` (and `server_info` if
it can say what it serves).

Timing follows vLLM: a request's send time is taken after it gets its concurrency
slot, just before the call, so --max-concurrency queueing is not counted as TTFT;
chunk times are taken the moment each message is handed to us. One gRPC channel
(one HTTP/2 connection) carries every request, as vLLM shares one HTTP session.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Sequence

import grpc
from google.protobuf.json_format import MessageToDict

from gateway.bench_serve.arrivals import send_offsets
from gateway.bench_serve.datasets import BenchRequest
from gateway.bench_serve.metrics import RequestOutcome
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
    """pdserve.v1.GenerateService/GenerateStream on the gateway."""

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
        response = await self._stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=30)
        return MessageToDict(response, preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)

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
        return message

    async def stream(self, request: BenchRequest) -> AsyncIterator[tuple[float, int]]:
        call = self._stub.GenerateStream(self.build_request(request), timeout=self.timeout_s)
        try:
            async for response in call:
                yield time.perf_counter(), len(response.token_ids)
        finally:
            call.cancel()  # a no-op once finished; frees the request if we stopped early


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

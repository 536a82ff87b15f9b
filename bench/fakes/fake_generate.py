"""An in-process fake GenerateService, and the client's self-check built on it.

The fake streams pre-set token ids with no model behind them: as fast as gRPC takes
them, or paced (a delay before the first token and between tokens), optionally
failing every k-th request. It is what the end-to-end tests run the client against,
and what `pdserve bench serve --self-check` uses to measure how many streamed
tokens per second the client itself can take: the benchmark must not be the
bottleneck of the stack it measures.

    async with FakeGenerateService(delay_s=0.001) as fake:
        backend = GrpcGenerateBackend(fake.address)
"""
from __future__ import annotations

import asyncio
import itertools
import os
import time

import grpc
from grpc import aio

from bench.serve.client import GrpcGenerateBackend, run_benchmark
from bench.serve.datasets import BenchRequest
from bench.serve.metrics import compute_metrics
from protos.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

FAKE_VOCAB_SIZE = 1000
FAKE_EOS_ID = 2
FAKE_TOKEN_IDS = tuple(range(100, 164))  # cycled through as the "generated" tokens


class FakeGenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, first_token_delay_s: float = 0.0, delay_s: float = 0.0, fail_every: int = 0,
                 max_model_len: int = 4096):
        self.first_token_delay_s = first_token_delay_s
        self.delay_s = delay_s  # between tokens
        self.fail_every = fail_every  # every k-th request fails with UNAVAILABLE; 0: never
        self.max_model_len = max_model_len
        self.requests: list[generate_pb2.GenerateRequest] = []
        self._count = itertools.count(1)
        # Built once per length so that the fake spends its CPU on gRPC, not on protobuf.
        self._scripts: dict[tuple[int, int], list[generate_pb2.GenerateResponse]] = {}

    def _script(self, prompt_tokens: int, max_tokens: int) -> list[generate_pb2.GenerateResponse]:
        key = (prompt_tokens, max_tokens)
        if key not in self._scripts:
            script = []
            for i in range(max_tokens):
                token = FAKE_TOKEN_IDS[i % len(FAKE_TOKEN_IDS)]
                last = i == max_tokens - 1
                script.append(generate_pb2.GenerateResponse(
                    text=f" t{token}", token_ids=[token],
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED,
                    usage=generate_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=i + 1),
                    decode_instance_id="fake"))
            self._scripts[key] = script
        return self._scripts[key]

    async def GenerateStream(self, request, context):
        self.requests.append(request)
        number = next(self._count)
        if self.fail_every and number % self.fail_every == 0:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"injected failure (request {number})")
        prompt_tokens = len(request.token_ids.ids) if request.HasField("token_ids") else len(request.text.split())
        max_tokens = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
        if self.first_token_delay_s:
            await asyncio.sleep(self.first_token_delay_s)
        for i, response in enumerate(self._script(prompt_tokens, max_tokens)):
            if i and self.delay_s:
                await asyncio.sleep(self.delay_s)
            yield response

    async def ModelInfo(self, request, context):
        return generate_pb2.ModelInfoResponse(
            model_name="fake", max_model_len=self.max_model_len, vocab_size=FAKE_VOCAB_SIZE,
            block_size=16, eos_token_ids=[FAKE_EOS_ID], num_prefill_instances=1,
            num_decode_instances=1, placement_policy="fake")


class FakeGenerateService:
    """A grpc.aio server on 127.0.0.1 (a free port) serving FakeGenerateServicer."""

    def __init__(self, **servicer_options):
        self.servicer = FakeGenerateServicer(**servicer_options)
        self.address = ""
        self._server: aio.Server | None = None

    async def start(self) -> str:
        self._server = aio.server()
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(self.servicer, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)

    async def __aenter__(self) -> "FakeGenerateService":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()


async def measure_client_capacity(num_requests: int = 64, output_len: int = 256,
                                  max_concurrency: int | None = 32) -> dict:
    """Streamed tokens per second the client sustains against the fake, one token per
    message, all requests at once. The fake runs in this process and on this event
    loop, so it takes some of the same CPU: both figures are lower bounds on the client.
    client_tokens_per_s is over wall time (it drops when other work shares the cores);
    tokens_per_cpu_s is over this process's CPU time: what one free core sustains."""
    requests = [BenchRequest(list(range(10, 42)), 32, output_len) for _ in range(num_requests)]
    async with FakeGenerateService() as fake:
        async with GrpcGenerateBackend(fake.address, request_id_prefix="self-check") as backend:
            cpu_before = time.process_time()
            outcomes, duration = await run_benchmark(backend, requests, float("inf"),
                                                     max_concurrency=max_concurrency)
            cpu_s = time.process_time() - cpu_before
    metrics = compute_metrics(outcomes, duration)
    return {"num_requests": num_requests, "output_len": output_len, "max_concurrency": max_concurrency,
            "tokens_per_message": 1, "duration_s": duration, "failed": metrics["failed"],
            "total_output_tokens": metrics["total_output_tokens"],
            "client_tokens_per_s": metrics["output_throughput"],
            "process_cpu_s": cpu_s, "tokens_per_cpu_s": metrics["total_output_tokens"] / cpu_s,
            "cpu_count": os.cpu_count(),
            "median_itl_ms": metrics["median_itl_ms"], "p99_itl_ms": metrics["p99_itl_ms"]}

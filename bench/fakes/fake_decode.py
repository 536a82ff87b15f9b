"""A synthetic decode instance: streams scripted token ids as fast as asked, no model.

For the two jobs a real decode instance cannot do: measuring the gateway's own
overhead per streamed token (bench.overhead), and injecting failures
(an error status after k tokens) in tests. It registers and heartbeats like a
real instance (common.service.registration.RegistryClient) and records what it was sent and
which calls were cancelled, so tests can check what the gateway did.

    fake = FakeDecode("decode-fake", gateway_address, token_ids=[...])
    await fake.start()  # serving and registered
    ...
    await fake.stop()
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from grpc import aio

from common.service.keepalive import KEEPALIVE_SERVER_OPTIONS
from common.service.registration import InstanceLoad, InstanceSpec, RegistryClient
from protos.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, embedding_pb2, embedding_pb2_grpc


@dataclass
class Failure:
    """Abort each Decode call with `code` after sending `after_tokens` tokens; code None: end
    the stream there without a status, the request unfinished."""

    code: grpc.StatusCode | None
    after_tokens: int = 0
    details: str = "injected failure"


class FakeDecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, instance_id: str, token_ids: Sequence[int], tokens_per_message: int = 1,
                 delay_s: float = 0.0, failure: Failure | None = None, num_cached_tokens: int = 0,
                 record_send_times: bool = False):
        self.instance_id = instance_id
        self.token_ids = list(token_ids)  # cycled through until max_tokens
        self.tokens_per_message = tokens_per_message
        self.delay_s = delay_s  # between messages; 0: as fast as the stream takes them
        self.failure = failure
        self.num_cached_tokens = num_cached_tokens
        self.requests: list[decode_pb2.DecodeRequest] = []
        self.metadata: list[dict[str, str]] = []  # each call's gRPC metadata (trace context ...)
        self.running: set[str] = set()
        self.cancelled: list[str] = []  # request ids whose call ended before they finished
        # request id -> time.perf_counter() as each message was handed to gRPC (benchmarks)
        self.send_times: dict[str, list[float]] | None = {} if record_send_times else None

    async def Decode(self, request, context):
        self.requests.append(request)
        self.metadata.append(_text_metadata(context))
        self.running.add(request.request_id)
        # Unset: the SamplingParams default; 0 (no limit): one pass over the script.
        max_tokens = (request.sampling.max_tokens or len(self.token_ids)
                      if request.sampling.HasField("max_tokens") else 16)
        # A migrated request continues the script after the output it brings, which counts
        # toward max_tokens as on an engine.
        num_resumed = len(request.resumed_token_ids)
        script = itertools.islice(itertools.cycle(self.token_ids), num_resumed, None)
        sent, finished = num_resumed, False
        send_times = None if self.send_times is None else self.send_times.setdefault(request.request_id, [])
        try:
            while sent < max_tokens:
                if self.failure is not None and sent - num_resumed >= self.failure.after_tokens:
                    if self.failure.code is None:
                        return
                    await context.abort(self.failure.code, self.failure.details)
                count = min(self.tokens_per_message, max_tokens - sent)
                sent += count
                last = sent == max_tokens
                if send_times is not None:
                    send_times.append(time.perf_counter())
                token_ids = [next(script) for _ in range(count)]
                yield decode_pb2.DecodeResponse(
                    request_id=request.request_id, token_ids=token_ids,
                    logprobs=[fake_logprob(t, request.sampling.logprobs) for t in token_ids]
                    if request.sampling.HasField("logprobs") else [],
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED,
                    num_cached_tokens=self.num_cached_tokens, prefill_instance_id=request.prefill_instance_id,
                    decode_instance_id=self.instance_id)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
            finished = True
        finally:
            self.running.discard(request.request_id)
            if not finished and self.failure is None:
                self.cancelled.append(request.request_id)

    async def Abort(self, request, context):
        return decode_pb2.AbortResponse()

    async def Stats(self, request, context):
        return common_pb2.StatsResponse(instance_id=self.instance_id, load=InstanceLoad(
            num_running_requests=len(self.running), num_free_blocks=1000, num_total_blocks=1000).to_pb())


def _text_metadata(context) -> dict[str, str]:
    return {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}


def fake_logprob(token_id: int, num_top: int) -> common_pb2.TokenLogprob:
    """The scripted token as the most likely (logprob -0.5), then the next ids, each 0.5 less
    likely: logprobs of the shape an engine sends, for what reads them (beam search)."""
    return common_pb2.TokenLogprob(token_id=token_id, logprob=-0.5, top_token_ids=range(token_id, token_id + num_top),
                                   top_logprobs=[-0.5 * (i + 1) for i in range(num_top)])


# What the fake's embeddings hold: a few values made from the prompt, so a test can tell inputs apart.
FAKE_EMBEDDING_SIZE = 4


def fake_embedding(prompt_token_ids: Sequence[int]) -> list[float]:
    """[number of tokens, first id, last id, sum of ids] (float32-exact for small prompts)."""
    return [float(len(prompt_token_ids)), float(prompt_token_ids[0]), float(prompt_token_ids[-1]),
            float(sum(prompt_token_ids))]


class FakeEmbeddingServicer(embedding_pb2_grpc.EmbeddingServiceServicer):
    """Embed beside the fake's Decode: fake_embedding of the prompt, its failure injected too."""

    def __init__(self, decode: FakeDecodeServicer):
        self.decode = decode
        self.requests: list[embedding_pb2.EmbedRequest] = []
        self.metadata: list[dict[str, str]] = []  # each call's gRPC metadata (trace context ...)

    async def Embed(self, request, context):
        self.requests.append(request)
        self.metadata.append(_text_metadata(context))
        failure = self.decode.failure
        if failure is not None:
            await context.abort(failure.code, failure.details)
        if self.decode.delay_s:
            await asyncio.sleep(self.decode.delay_s)
        return embedding_pb2.EmbedResponse(request_id=request.request_id,
                                           embedding=fake_embedding(request.prompt_token_ids),
                                           num_cached_tokens=self.decode.num_cached_tokens,
                                           instance_id=self.decode.instance_id)


class FakeDecode:
    """A FakeDecodeServicer (and FakeEmbeddingServicer) on its own server on 127.0.0.1,
    registered with a gateway."""

    def __init__(self, instance_id: str, gateway_address: str, max_model_len: int = 8192,
                 model_name: str = "", block_size: int = 16, registry_token: str | None = None,
                 lora_names: tuple[str, ...] = (), **servicer_kwargs):
        self.servicer = FakeDecodeServicer(instance_id, **servicer_kwargs)
        # The gateway pings its decode instances every 0.4 s: allowed, as a real instance's server does.
        self._server = aio.server(options=KEEPALIVE_SERVER_OPTIONS)
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(self.servicer, self._server)
        self.embedding_servicer = FakeEmbeddingServicer(self.servicer)
        embedding_pb2_grpc.add_EmbeddingServiceServicer_to_server(self.embedding_servicer, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.spec = InstanceSpec(instance_id=instance_id, role="decode", grpc_address=self.address,
                                 block_size=block_size, num_total_blocks=1000, model_name=model_name,
                                 max_model_len=max_model_len, lora_names=tuple(lora_names))
        self._registry_client = RegistryClient(gateway_address, self.spec, self._load, token=registry_token)
        self._registration: asyncio.Task | None = None

    def _load(self) -> InstanceLoad:
        return InstanceLoad(num_running_requests=len(self.servicer.running), num_free_blocks=1000,
                            num_total_blocks=1000)

    async def start(self) -> None:
        await self._server.start()
        self._registration = asyncio.create_task(self._registry_client.run())
        registered = asyncio.create_task(self._registry_client.registered.wait())
        await asyncio.wait({self._registration, registered}, return_when=asyncio.FIRST_COMPLETED)
        if not registered.done():  # the gateway refused it (other model, token): say why
            registered.cancel()
            await self._server.stop(None)
            self._registration.result()

    async def stop(self, grace_s: float | None = None) -> None:
        if self._registration is not None:
            self._registration.cancel()
            await asyncio.gather(self._registration, return_exceptions=True)
        await self._server.stop(grace_s)


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.fakes.fake_decode --gateway ADDR`: a fake decode process (for tests
    that need one to die for real, e.g. SIGKILL mid-stream)."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m bench.fakes.fake_decode")
    parser.add_argument("--gateway", required=True, help="the gateway's registry address")
    parser.add_argument("--model-name", required=True, help="the gateway's served model name")
    parser.add_argument("--instance-id", default="decode-fake")
    parser.add_argument("--delay-s", type=float, default=0.0, help="between messages")
    parser.add_argument("--token-ids", default="1000,1001,1002", help="comma-separated script")
    args = parser.parse_args(argv)

    async def serve() -> None:
        fake = FakeDecode(args.instance_id, args.gateway, model_name=args.model_name, delay_s=args.delay_s,
                          token_ids=[int(t) for t in args.token_ids.split(",")])
        await fake.start()
        print(f"PDSERVE_READY role=decode grpc={fake.address} instance={args.instance_id}", flush=True)
        await asyncio.Event().wait()  # until killed
    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

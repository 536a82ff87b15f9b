"""Reusing a request id right after cancelling its stream (gateway.request_ids): the
re-sent request is served once the cancel has gone through, at the gateway and on the
decode instance, or refused with the documented ALREADY_EXISTS message and a
`retry-after-ms` hint; never an unexplained ALREADY_EXISTS. Real gRPC gateway on
127.0.0.1 with a fake decode instance that, like the real one, refuses an id it still
holds and lets go of a cancelled one only a moment after the cancel."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

import bench.fakes.fake_decode as fake_decode
from common.engine.sampling_params import SamplingParams
from gateway.admission import RETRY_AFTER_METADATA
from gateway.client import build_generate_request
from gateway.core import GatewaySettings
from protos.pdserve.v1 import generate_pb2_grpc
from tests.support.background_gateway import BackgroundGateway

REFUSAL_START = "request_id 'reused' is still held by another request"
INSTANCE_RELEASE_DELAY_S = 0.02  # how long the fake takes to let go of a cancelled id


class IdGatedDecodeServicer(fake_decode.FakeDecodeServicer):
    """Holds each request id from its call's start until a moment after its call ends,
    as a decode instance's engine does, and refuses a call whose id it holds."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held: set[str] = set()
        self.refused: list[str] = []

    async def Decode(self, request, context):
        if request.request_id in self.held:
            self.refused.append(request.request_id)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request id {request.request_id!r} is already in flight")
        self.held.add(request.request_id)
        try:
            async for response in super().Decode(request, context):
                yield response
        finally:
            asyncio.get_running_loop().call_later(INSTANCE_RELEASE_DELAY_S, self.held.discard, request.request_id)


@pytest.fixture()
def gw(monkeypatch):
    monkeypatch.setattr(fake_decode, "FakeDecodeServicer", IdGatedDecodeServicer)
    with BackgroundGateway(GatewaySettings(heartbeat_timeout_s=30.0)) as gateway:
        gateway.fake = gateway.add_fake_decode("decode-0", token_ids=[1000, 1001], delay_s=0.01)
        yield gateway


def stream_request(max_tokens: int = 200):
    return build_generate_request("Hello", SamplingParams(max_tokens=max_tokens), request_id="reused")


def test_a_cancelled_ids_reuse_is_served_or_told_to_retry_never_refused_unexplained(gw):
    accepted, told_to_retry = 0, 0
    with grpc.insecure_channel(gw.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        call = stub.GenerateStream(stream_request(), timeout=30)
        for _ in range(40):
            next(call)  # running: the decode instance holds the id
            call.cancel()
            call = stub.GenerateStream(stream_request(), timeout=30)  # at once, same id
            try:
                next(call)
                accepted += 1
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.ALREADY_EXISTS, error
                assert error.details().startswith(REFUSAL_START) and "retry after" in error.details()
                assert int(dict(error.trailing_metadata())[RETRY_AFTER_METADATA]) > 0
                told_to_retry += 1
                call = stub.GenerateStream(stream_request(), timeout=30)
        call.cancel()
    assert accepted + told_to_retry == 40
    # The instance did refuse re-sends it still held (the race is real) and the gateway
    # absorbed every one of them within the release window.
    assert accepted == 40 and gw.call(lambda: len(gw.fake.servicer.refused)) > 0


def test_an_id_held_by_a_running_request_is_refused_after_the_bounded_wait_with_a_hint(gw):
    with grpc.insecure_channel(gw.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        running = stub.GenerateStream(stream_request(max_tokens=1000), timeout=30)
        next(running)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as error:
            next(stub.GenerateStream(stream_request(), timeout=30))
        waited_s = time.monotonic() - started
        assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert error.value.details().startswith(REFUSAL_START) and "at this gateway" in error.value.details()
        assert dict(error.value.trailing_metadata())[RETRY_AFTER_METADATA] == "1000"
        release_wait_s = gw.gateway.request_ids.release_wait_s
        assert release_wait_s <= waited_s < release_wait_s + 5
        assert next(running).text is not None  # the first request is untouched
        running.cancel()


def test_a_finished_ids_reuse_is_served_at_once(gw):
    with grpc.insecure_channel(gw.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for _ in range(5):
            responses = list(stub.GenerateStream(stream_request(max_tokens=3), timeout=30))
            assert responses[-1].finish_reason

"""No request outlives its instance: a real decode process (bundled model) frozen with
SIGSTOP while requests without a client deadline stream from it. With the gateway's
default settings every call running there ends (UNAVAILABLE) within two heartbeat
periods of the freeze: the channel's keepalive finds the instance silent, and the gateway
drops it and ends the calls still running there, instead of leaving them to wait out the
freeze. A request that had no token yet is placed on another decode instance instead."""
from __future__ import annotations

import asyncio
import importlib.util
import signal
import threading
import time

import grpc
import pytest
from grpc import aio

from common.cli.processes import ManagedProcess
from common.service.registration import InstanceLoad, InstanceSpec
from gateway.client import Client
from gateway.core import GatewaySettings
from gateway.routing.dispatcher import PROBE_TIMEOUT_S
from gateway.routing.inflight_calls import InFlightCalls
from gateway.routing.registry import InstanceRegistry
from protos.pdserve.v1 import decode_pb2_grpc
from tests.support.background_gateway import BackgroundGateway

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("decode_service.main") is None, reason="decode_service not built yet")]

NUM_REQUESTS = 4


class FakeStream:
    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


@pytest.mark.parametrize("reason, failed", [("expired", True), ("unresponsive", True), ("deregistered", False)])
def test_only_a_dead_instance_has_its_calls_failed(reason, failed):
    registry = InstanceRegistry()
    calls = InFlightCalls(registry)
    instance = registry.register(InstanceSpec("d0", "decode", "127.0.0.1:1"))
    stream = FakeStream()
    with calls.tracking(instance, stream) as call:
        registry._remove("d0", reason)
        # A clean deregistration is a drain: the instance finishes what it runs.
        assert (stream.cancelled, call.lost_reason) == ((True, reason) if failed else (False, None))
    assert calls.count("d0") == 0


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s}s"
        time.sleep(0.02)


@pytest.mark.timing
def test_requests_on_a_frozen_decode_end_within_two_heartbeat_periods(tmp_path):
    settings = GatewaySettings()
    two_periods_s = 2 * settings.heartbeat_interval_s
    with BackgroundGateway(settings) as gw:
        decode = ManagedProcess("decode-0", [
            "decode", "--gateway", gw.registry_address, "--port", "0", "--instance-id", "decode-0",
            "--kv-cache-memory", "256MiB", "--log-level", "WARNING"], log_dir=tmp_path, echo=False)
        try:
            decode.wait_ready(120)
            registry = gw.gateway.registry
            wait_until(lambda: gw.call(lambda: registry.get("decode-0")) is not None, 30, "registration")
            removals: list[tuple[str, str]] = []  # (instance id, reason)
            gw.call(lambda: registry.subscribe(on_removed=lambda i, reason: removals.append((i.instance_id, reason))))
            outcomes: list[tuple[grpc.StatusCode, float]] = []
            streaming = threading.Barrier(NUM_REQUESTS + 1)

            def request(client: Client) -> None:
                # No deadline: only the gateway can end this call.
                # Long enough to outlast the test; the pool holds all of them at once.
                stream = client.generate_stream("Count to a thousand:", max_tokens=600, ignore_eos=True)
                try:
                    next(stream)
                    streaming.wait(60)
                    for _ in stream:
                        pass
                    outcomes.append((grpc.StatusCode.OK, time.monotonic()))
                except grpc.RpcError as e:
                    outcomes.append((e.code(), time.monotonic()))
                    streaming.abort()  # one that failed early makes the test fail now, with its status

            with Client(gw.address) as client:
                threads = [threading.Thread(target=request, args=(client,), daemon=True)
                           for _ in range(NUM_REQUESTS)]
                for thread in threads:
                    thread.start()
                try:
                    streaming.wait(60)  # every request has a token: they run on decode-0
                except threading.BrokenBarrierError:
                    pytest.fail(f"not every request got a first token: {outcomes}")
                decode.process.send_signal(signal.SIGSTOP)
                stopped_at = time.monotonic()
                for thread in threads:
                    thread.join(settings.heartbeat_timeout_s + 2 * settings.heartbeat_interval_s)
                    assert not thread.is_alive(), "a request outlived its instance"
                # No longer placeable either: dropped by the probe that a failed call starts,
                # not left until its heartbeats time out. The probe fails at its own deadline.
                wait_until(lambda: gw.call(lambda: registry.get("decode-0")) is None, PROBE_TIMEOUT_S + 1.0,
                           "the gateway to drop the frozen instance")
                assert removals == [("decode-0", "unresponsive")]
            assert [code for code, _ in outcomes] == [grpc.StatusCode.UNAVAILABLE] * NUM_REQUESTS
            ended_after_s = max(t for _, t in outcomes) - stopped_at
            assert ended_after_s <= two_periods_s, f"the last request ended {ended_after_s:.2f}s after the freeze"
        finally:
            decode.process.send_signal(signal.SIGCONT)
            decode.stop()


class _SilentDecode(decode_pb2_grpc.DecodeServiceServicer):
    """Accepts Decode calls and never answers them: a request there has streamed no token."""

    def __init__(self):
        self.received = asyncio.Event()

    async def Decode(self, request, context):
        self.received.set()
        await asyncio.Event().wait()
        yield  # pragma: no cover - never reached; makes this a streaming handler


def test_a_request_with_no_token_yet_is_placed_again_when_its_instance_is_dropped():
    with BackgroundGateway() as gw:
        gw.add_fake_decode("decode-b", token_ids=[1000, 1001])

        async def start_silent():
            servicer = _SilentDecode()
            server = aio.server()
            decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
            address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            # "decode-a" sorts first: equally loaded, placement picks it.
            gw.gateway.registry.register(InstanceSpec("decode-a", "decode", address, block_size=16,
                                                      num_total_blocks=1000, model_name=gw.gateway.model.name))
            return servicer, server
        silent, server = gw.call(start_silent())
        try:
            with Client(gw.address, timeout=30) as client:
                stream = client.generate_stream("hi", max_tokens=2)
                gw.call(asyncio.wait_for(silent.received.wait(), 10))
                assert gw.call(lambda: gw.gateway.dispatcher._calls.count("decode-a")) == 1
                gw.call(lambda: gw.gateway.registry.drop_unresponsive("decode-a"))
                deltas = list(stream)
            assert {d.decode_instance_id for d in deltas} == {"decode-b"}
            assert deltas[-1].finish_reason == "length"
        finally:
            gw.call(server.stop(0))

"""Readiness vs liveness on a real gateway (gRPC health and HTTP) with fake decode
instances: readiness follows the registry both ways, within one heartbeat period of the
registry's change; liveness stays SERVING throughout."""
from __future__ import annotations

import http.client
import json
import time

import pytest

from common.cli.health import check
from common.service.registration import InstanceSpec
from gateway.core import GatewaySettings
from gateway.openai_api.server import OpenAIServer
from protos.serving import GENERATE_SERVICE
from tests.support.background_gateway import BackgroundGateway

HEARTBEAT_S = 0.5
TIMEOUT_S = 1.5


@pytest.fixture()
def gw():
    settings = GatewaySettings(heartbeat_interval_s=HEARTBEAT_S, heartbeat_timeout_s=TIMEOUT_S)
    with BackgroundGateway(settings) as gateway:
        server = gateway.call(lambda: OpenAIServer(gateway.gateway, port=0))
        gateway.http_address = gateway.call(server.start())
        try:
            yield gateway
        finally:
            gateway.call(server.stop())


def get(address: str, path: str) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(*address.split(":"), timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def wait_until(condition, within_s: float, what: str) -> float:
    """Seconds it took `condition` to hold; fails past within_s."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < within_s, f"{what} not within {within_s}s"
        time.sleep(0.01)
    return time.monotonic() - start


def readiness(gw) -> str:
    return check(gw.address, GENERATE_SERVICE)


def assert_live(gw) -> None:
    assert check(gw.address) == "SERVING"
    assert get(gw.http_address, "/health") == (200, {"status": "ok"})


def test_not_ready_until_a_decode_registers_and_again_once_the_last_one_leaves(gw):
    assert_live(gw)
    assert readiness(gw) == "NOT_SERVING"
    assert get(gw.http_address, "/ready") == (503, {"status": "not ready",
                                                    "reason": "no decode instance is registered"})
    first = gw.add_fake_decode("decode-0", token_ids=[1])  # registered when this returns
    wait_until(lambda: readiness(gw) == "SERVING", HEARTBEAT_S, "ready after a register")
    assert get(gw.http_address, "/ready") == (200, {"status": "ready"})
    second = gw.add_fake_decode("decode-1", token_ids=[1])
    gw.remove_fake_decode(first)  # deregisters; one decode instance is left
    assert readiness(gw) == "SERVING"
    gw.remove_fake_decode(second)
    wait_until(lambda: readiness(gw) == "NOT_SERVING", HEARTBEAT_S, "not ready after the last deregister")
    assert get(gw.http_address, "/ready")[0] == 503
    assert_live(gw)
    gw.add_fake_decode("decode-2", token_ids=[1])
    wait_until(lambda: readiness(gw) == "SERVING", HEARTBEAT_S, "ready again")
    assert_live(gw)


def test_a_decode_that_stops_heartbeating_makes_the_gateway_not_ready_once_dropped(gw):
    # Registered straight into the registry: no heartbeat ever follows, as for a frozen instance.
    spec = InstanceSpec(instance_id="decode-frozen", role="decode", grpc_address="127.0.0.1:1", block_size=16,
                        num_total_blocks=100, max_model_len=4096, model_name=gw.gateway.model.name)
    gw.call(lambda: gw.gateway.registry.register(spec))
    registered_at = time.monotonic()
    assert readiness(gw) == "SERVING"
    wait_until(lambda: gw.call(lambda: gw.gateway.registry.get("decode-frozen")) is None,
               TIMEOUT_S + 3 * HEARTBEAT_S + 1.0, "the registry to drop the instance")
    dropped_at = time.monotonic()
    wait_until(lambda: readiness(gw) == "NOT_SERVING", HEARTBEAT_S, "not ready after the expiry")
    assert dropped_at - registered_at >= TIMEOUT_S
    assert_live(gw)


def test_draining_is_not_ready_while_liveness_reports_the_drain_over_http(gw):
    gw.add_fake_decode("decode-0", token_ids=[1])
    wait_until(lambda: readiness(gw) == "SERVING", HEARTBEAT_S, "ready")
    gw.call(lambda: setattr(gw.gateway, "draining", True))
    wait_until(lambda: readiness(gw) == "NOT_SERVING", HEARTBEAT_S, "not ready while draining")
    assert get(gw.http_address, "/ready") == (503, {"status": "not ready", "reason": "the gateway is draining"})

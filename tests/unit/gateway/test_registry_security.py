"""The registry as an attacker meets it, on a real gateway with a registry token: it is
not on the public port, a call without the token (or with another) is UNAUTHENTICATED
and no user request ever reaches the process that tried, registrations that disagree
with the gateway's model are refused, and one instance cannot deregister or heartbeat
for another's id."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.fakes.fake_decode import FakeDecode
from common.service.registration import InstanceLoad, InstanceSpec
from gateway.client import Client
from protos.pdserve.v1 import registry_pb2, registry_pb2_grpc
from tests.support.background_gateway import BackgroundGateway

TOKEN = "s3cret-registry-token"
TOKENS = [1000, 1001, 1002]


@pytest.fixture()
def gw():
    with BackgroundGateway(registry_token=TOKEN) as gateway:
        yield gateway


def spec(gw, instance_id: str, address: str = "127.0.0.1:1", **overrides) -> InstanceSpec:
    values = dict(instance_id=instance_id, role="decode", grpc_address=address, block_size=16,
                  num_total_blocks=100, model_name=gw.gateway.model.name, max_model_len=4096)
    return InstanceSpec(**{**values, **overrides})


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def call(address: str, method: str, request, metadata=()):
    with grpc.insecure_channel(address) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        return getattr(stub, method)(request, timeout=10, metadata=metadata)


def status_of(address: str, method: str, request, metadata=()) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call(address, method, request, metadata)
    return error.value.code()


def test_the_public_port_does_not_serve_the_registry(gw):
    assert gw.registry_address != gw.address
    request = spec(gw, "intruder").to_pb()
    assert status_of(gw.address, "Register", request, bearer(TOKEN)) == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("metadata", [(), bearer("wrong-token"), (("authorization", TOKEN),)],
                         ids=["none", "wrong", "not-bearer"])
def test_registry_calls_without_the_token_are_unauthenticated(gw, metadata):
    address = gw.registry_address
    assert status_of(address, "Register", spec(gw, "intruder").to_pb(), metadata) == grpc.StatusCode.UNAUTHENTICATED
    assert status_of(address, "Heartbeat", registry_pb2.HeartbeatRequest(instance_id="intruder"),
                     metadata) == grpc.StatusCode.UNAUTHENTICATED
    assert status_of(address, "Deregister", registry_pb2.DeregisterRequest(instance_id="intruder"),
                     metadata) == grpc.StatusCode.UNAUTHENTICATED
    assert gw.call(lambda: gw.gateway.registry.get("intruder")) is None


def test_no_user_request_reaches_a_process_that_registered_without_the_token(gw):
    honest = gw.add_fake_decode("decode-honest", token_ids=TOKENS)

    async def start_intruder() -> FakeDecode:
        # A real decode server, registered with a wrong token: "decode-a" sorts first, so
        # placement would pick it if it were registered.
        intruder = FakeDecode("decode-a", gw.registry_address, model_name=gw.gateway.model.name,
                              registry_token="guessed", token_ids=[9])
        await intruder._server.start()
        registration = asyncio.create_task(intruder._registry_client.run())
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await asyncio.wait_for(registration, 10)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        return intruder
    intruder = gw.call(start_intruder())
    try:
        with Client(gw.address, timeout=10) as client:
            results = [client.generate("hi", max_tokens=3) for _ in range(6)]
        assert {r.decode_instance_id for r in results} == {"decode-honest"}
        assert not intruder.servicer.requests and len(honest.servicer.requests) == 6
    finally:
        gw.call(intruder._server.stop(0))


@pytest.mark.parametrize("overrides, field", [({"model_name": "another-model"}, "model_name"),
                                              ({"block_size": 32}, "block_size"),
                                              ({"max_model_len": 2 ** 20}, "max_model_len")])  # the model's: 8192
def test_registrations_that_disagree_with_the_gateway_are_invalid_argument(gw, overrides, field):
    with pytest.raises(grpc.RpcError) as error:
        call(gw.registry_address, "Register", spec(gw, "decode-odd", **overrides).to_pb(), bearer(TOKEN))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in error.value.details()
    assert gw.call(lambda: gw.gateway.registry.get("decode-odd")) is None


def test_a_smaller_max_model_len_is_accepted_and_caps_requests(gw):
    call(gw.registry_address, "Register", spec(gw, "decode-short", max_model_len=512).to_pb(), bearer(TOKEN))
    assert gw.call(lambda: gw.gateway.max_model_len) == 512


def test_one_instance_cannot_deregister_or_heartbeat_for_another(gw):
    victim = call(gw.registry_address, "Register", spec(gw, "decode-victim").to_pb(), bearer(TOKEN))
    other = call(gw.registry_address, "Register", spec(gw, "decode-other", "127.0.0.1:2").to_pb(), bearer(TOKEN))
    assert victim.instance_secret and victim.instance_secret != other.instance_secret
    for secret in ("", other.instance_secret):
        assert status_of(gw.registry_address, "Deregister", registry_pb2.DeregisterRequest(
            instance_id="decode-victim", instance_secret=secret), bearer(TOKEN)) == grpc.StatusCode.PERMISSION_DENIED
        assert status_of(gw.registry_address, "Heartbeat", registry_pb2.HeartbeatRequest(
            instance_id="decode-victim", instance_secret=secret), bearer(TOKEN)) == grpc.StatusCode.PERMISSION_DENIED
    # Nor take its id from another address while it lives.
    assert status_of(gw.registry_address, "Register", spec(gw, "decode-victim", "127.0.0.1:3").to_pb(),
                     bearer(TOKEN)) == grpc.StatusCode.ALREADY_EXISTS
    assert gw.call(lambda: gw.gateway.registry.get("decode-victim").spec.grpc_address) == "127.0.0.1:1"
    # Its own secret works.
    beat = call(gw.registry_address, "Heartbeat", registry_pb2.HeartbeatRequest(
        instance_id="decode-victim", instance_secret=victim.instance_secret, load=InstanceLoad().to_pb()),
        bearer(TOKEN))
    assert not beat.reregister
    call(gw.registry_address, "Deregister", registry_pb2.DeregisterRequest(
        instance_id="decode-victim", instance_secret=victim.instance_secret), bearer(TOKEN))
    assert gw.call(lambda: gw.gateway.registry.get("decode-victim")) is None


@pytest.mark.parametrize("argv, refused", [
    ([], False), (["--host", "::1"], False), (["--registry-host", "localhost"], False),
    (["--host", "0.0.0.0"], True), (["--registry-host", "10.0.0.7"], True),
    (["--host", "0.0.0.0", "--registry-token", TOKEN], False),
    (["--host", "0.0.0.0", "--insecure-registry"], False),
])
def test_a_registry_beyond_loopback_needs_a_token_or_insecure_registry(argv, refused, monkeypatch):
    from gateway.main import build_parser, registry_listen_address
    monkeypatch.delenv("PDSERVE_REGISTRY_TOKEN", raising=False)
    args = build_parser().parse_args(argv)
    if refused:
        with pytest.raises(ValueError, match="PDSERVE_REGISTRY_TOKEN"):
            registry_listen_address(args)
    else:
        host, port = registry_listen_address(args)
        assert port == 50054


def test_the_gateway_process_refuses_to_start_an_open_registry(monkeypatch):
    from gateway.main import main
    monkeypatch.delenv("PDSERVE_REGISTRY_TOKEN", raising=False)
    assert main(["--host", "0.0.0.0", "--port", "0", "--http-port", "off"]) == 2

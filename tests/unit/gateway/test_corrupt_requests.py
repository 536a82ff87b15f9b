"""Bytes that are not a request message get INVALID_ARGUMENT from the gateway (every
server shares the interceptor that does it, common.service.errors), not UNKNOWN."""
from __future__ import annotations

import grpc
import pytest

from common.service.registration import InstanceSpec
from tests.support.background_gateway import BackgroundGateway

# A field header announcing a length-delimited field longer than the message; and an
# invalid wire type: both are DecodeErrors for any message.
CORRUPT = [b"\x0a\xff\xff\xff\xff\x0f", b"\x0f", b"\x12\x05ab"]


@pytest.fixture(scope="module")
def gw():
    with BackgroundGateway() as gateway:
        gateway.add_fake_decode("decode-0", token_ids=[1000, 1001])
        yield gateway


@pytest.mark.parametrize("payload", CORRUPT)
@pytest.mark.parametrize("method, streaming", [("/pdserve.v1.GenerateService/Generate", False),
                                               ("/pdserve.v1.GenerateService/GenerateStream", True),
                                               ("/pdserve.v1.RegistryService/Register", False)])
def test_a_corrupt_message_is_invalid_argument(gw, method, streaming, payload):
    address = gw.registry_address if "Registry" in method else gw.address
    with grpc.insecure_channel(address) as channel:
        # No serializers: the bytes go on the wire as they are.
        call = channel.unary_stream(method) if streaming else channel.unary_unary(method)
        with pytest.raises(grpc.RpcError) as error:
            result = call(payload, timeout=10)
            if streaming:
                list(result)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert "not valid protobuf" in error.value.details() and method in error.value.details()


def test_the_gateway_still_serves_after_corrupt_messages(gw):
    with grpc.insecure_channel(gw.address) as channel:
        call = channel.unary_unary("/pdserve.v1.GenerateService/Generate")
        for payload in CORRUPT:
            with pytest.raises(grpc.RpcError):
                call(payload, timeout=10)
    from gateway.client import Client
    with Client(gw.address, timeout=10) as client:
        assert client.generate("hi", max_tokens=2).finish_reason == "length"
    spec = InstanceSpec(instance_id="x", role="decode", grpc_address="127.0.0.1:1", block_size=16,
                        model_name=gw.gateway.model.name)
    with grpc.insecure_channel(gw.registry_address) as channel:  # a valid message still parses
        register = channel.unary_unary("/pdserve.v1.RegistryService/Register")
        assert register(spec.to_pb().SerializeToString(), timeout=10)

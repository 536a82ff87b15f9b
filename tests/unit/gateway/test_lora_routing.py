"""LoRA adapters through the gateway, on a real in-process gateway with synthetic decode
instances that register the adapters they serve: a request whose model is an adapter goes
only to an instance that serves it, with the adapter's name on the Decode and Embed calls;
the base model's requests go anywhere; /v1/models lists the adapters beside the base model;
an adapter no instance serves is refused as any unknown model is (gRPC INVALID_ARGUMENT,
HTTP 404), and one whose instances are all gone is UNAVAILABLE."""
from __future__ import annotations

import grpc
import pytest

from gateway.client import Client
from tests.unit.gateway.openai_api.test_server import MODEL, TOKENS, http_gateway, post, wait_for


@pytest.fixture(scope="module")
def gw():
    with http_gateway() as gateway:
        gateway.plain = gateway.add_fake_decode("decode-plain", token_ids=TOKENS)
        gateway.sql = gateway.add_fake_decode("decode-sql", token_ids=TOKENS, lora_names=("sql-lora", "chat-lora"))
        yield gateway


def lora_of(msg) -> str | None:
    return msg.lora_name if msg.HasField("lora_name") else None


def test_an_adapters_requests_go_to_the_instances_that_serve_it(gw):
    with Client(gw.address, timeout=30) as client:
        for _ in range(4):  # the least-loaded policy alone would spread these over both instances
            result = client.generate("Hello", model="sql-lora")
            assert result.decode_instance_id == "decode-sql"
        assert lora_of(gw.sql.servicer.requests[-1]) == "sql-lora"
        client.embed("Hello", model="chat-lora")
        assert lora_of(gw.sql.embedding_servicer.requests[-1]) == "chat-lora"
        base = [client.generate("Hello").decode_instance_id for _ in range(4)]
        assert "decode-plain" in base  # the base model runs anywhere
        assert all(lora_of(r) is None for r in gw.plain.servicer.requests)


def test_http_lists_and_takes_the_adapters(gw):
    status, models = post(gw.http_address, "/v1/models", b"", method="GET")
    assert status == 200
    assert [m["id"] for m in models["data"]] == [MODEL, "chat-lora", "sql-lora"]
    assert models["data"][2]["parent"] == MODEL and "parent" not in models["data"][0]
    status, card = post(gw.http_address, "/v1/models/sql-lora", b"", method="GET")
    assert status == 200 and card["id"] == "sql-lora"
    status, body = post(gw.http_address, "/v1/completions", {"model": "sql-lora", "prompt": "Hi", "max_tokens": 2})
    assert status == 200 and body["model"] == "sql-lora", body
    assert lora_of(gw.sql.servicer.requests[-1]) == "sql-lora"
    status, body = post(gw.http_address, "/v1/embeddings", {"model": "chat-lora", "input": "Hi"})
    assert status == 200 and body["model"] == "chat-lora"


def test_an_adapter_no_instance_serves_is_refused(gw):
    status, body = post(gw.http_address, "/v1/completions", {"model": "nobody-lora", "prompt": "Hi"})
    assert status == 404 and body["error"]["param"] == "model"
    with Client(gw.address, timeout=30) as client:
        with pytest.raises(grpc.RpcError) as error:
            client.generate("Hello", model="nobody-lora")
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "LoRA adapters chat-lora, sql-lora" in error.value.details()


def test_an_adapter_whose_instances_left_is_no_longer_served():
    with http_gateway() as gw:
        gw.add_fake_decode("decode-plain", token_ids=TOKENS)
        only = gw.add_fake_decode("decode-sql", token_ids=TOKENS, lora_names=("sql-lora",))
        with Client(gw.address, timeout=30) as client:
            assert client.generate("Hello", model="sql-lora").decode_instance_id == "decode-sql"
            gw.call(only.stop())
            gw.call(lambda: gw.gateway.registry.deregister("decode-sql"))  # whether or not its client did
            wait_for(lambda: "sql-lora" not in gw.gateway.registry.lora_names(), what="the adapter's instance gone")
            with pytest.raises(grpc.RpcError) as error:
                client.generate("Hello", model="sql-lora")
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not served here" in error.value.details()
            assert client.generate("Hello").decode_instance_id == "decode-plain"

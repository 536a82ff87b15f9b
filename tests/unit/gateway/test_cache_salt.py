"""cache_salt (vLLM's) through the gateway, on a real in-process gateway with the synthetic
instance: every request form carries its salt to the instance (gRPC Generate and Embed;
HTTP completions, chat, embeddings, score), an unsalted request carries none, and a salt
out of vLLM's bounds is refused at either edge before anything reaches an instance. That
the salt keeps cached blocks apart is the engine's (tests/unit/common/engine/test_llm.py)
and the stack's (tests/integration/test_stack.py)."""
from __future__ import annotations

import grpc
import pytest

from gateway.client import Client
from tests.unit.gateway.openai_api.test_server import MODEL, TOKENS, http_gateway, post

SALT = "ZmpkA3qLx0-tenant-7"


@pytest.fixture(scope="module")
def gw():
    with http_gateway(token_ids=TOKENS) as gateway:
        yield gateway


def decode_requests(gw):
    return gw.fake.servicer.requests


def embed_requests(gw):
    return gw.fake.embedding_servicer.requests


def salt_of(msg) -> str | None:
    return msg.cache_salt if msg.HasField("cache_salt") else None


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "n": 2}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
])
def test_generation_requests_carry_their_salt_to_the_instance(gw, path, body):
    before = len(decode_requests(gw))
    status, response = post(gw.http_address, path, {**body, "cache_salt": SALT})
    assert status == 200, response
    sent = decode_requests(gw)[before:]
    assert len(sent) == body.get("n", 1) and all(salt_of(r) == SALT for r in sent)
    status, response = post(gw.http_address, path, body)
    assert status == 200 and salt_of(decode_requests(gw)[-1]) is None


def test_embedding_and_score_requests_carry_their_salt(gw):
    before = len(embed_requests(gw))
    assert post(gw.http_address, "/v1/embeddings", {"input": ["a", "b"], "cache_salt": SALT})[0] == 200
    assert post(gw.http_address, "/score", {"queries": "a", "documents": ["b"], "cache_salt": SALT})[0] == 200
    sent = embed_requests(gw)[before:]
    assert len(sent) == 4 and all(salt_of(r) == SALT for r in sent)


def test_grpc_calls_carry_their_salt(gw):
    with Client(gw.address, timeout=30) as client:
        before = len(decode_requests(gw))
        client.generate("Hello", cache_salt=SALT)
        assert salt_of(decode_requests(gw)[before]) == SALT
        client.generate("Hello")
        assert salt_of(decode_requests(gw)[-1]) is None
        client.embed("Hello", cache_salt=SALT)
        assert salt_of(embed_requests(gw)[-1]) == SALT


BAD_SALTS = [("", "non-empty"), ("a/b", "must not contain"), ("x" * 129, "at most 128"), ("a\\b", "must not contain"),
             ("a@b", "must not contain")]


@pytest.mark.parametrize("salt, message", BAD_SALTS + [(5, "must be a string")])
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": "Hello"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/embeddings", {"input": "Hello"}),
    ("/rerank", {"query": "a", "documents": ["b"]}),
])
def test_a_bad_salt_is_a_400_naming_it_over_http(gw, salt, message, path, body):
    before = (len(decode_requests(gw)), len(embed_requests(gw)))
    status, response = post(gw.http_address, path, {**body, "cache_salt": salt})
    assert status == 400 and response["error"]["param"] == "cache_salt", response
    assert message in response["error"]["message"]
    assert (len(decode_requests(gw)), len(embed_requests(gw))) == before


@pytest.mark.parametrize("salt, message", BAD_SALTS)
def test_a_bad_salt_is_invalid_argument_over_grpc(gw, salt, message):
    before = (len(decode_requests(gw)), len(embed_requests(gw)))
    with Client(gw.address, timeout=30) as client:
        for call in (client.generate, client.embed):
            with pytest.raises(grpc.RpcError) as error:
                call("Hello", cache_salt=salt)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.value.details()
    assert (len(decode_requests(gw)), len(embed_requests(gw))) == before

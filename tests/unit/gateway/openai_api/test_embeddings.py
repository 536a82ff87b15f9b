"""POST /v1/embeddings and gRPC Embed on a real in-process gateway with the synthetic
instance (bench.fakes.fake_decode, whose Embed answers fake_embedding of the prompt it
got): the official `openai` client's call (base64 by default), what reaches the
instance, the errors and their fields, and the counts in pdserve_embeddings_total. The
real model is in tests/integration/test_embeddings_stack.py."""
from __future__ import annotations

import base64
import struct
import urllib.request

import grpc
import pytest

from bench.fakes.fake_decode import Failure, fake_embedding
from common.engine.pooling_params import PoolingParams
from common.text.chat_template import ChatTemplateOptions
from gateway.client import Client
from gateway.openai_api.embeddings import MAX_EMBEDDING_INPUTS
from tests.unit.gateway.openai_api.test_server import MODEL, TOKENS, http_gateway, post

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def gw():
    with http_gateway(token_ids=TOKENS) as gateway:
        yield gateway


def embed_requests(gw):
    return gw.fake.embedding_servicer.requests


def tokenize(gw, text: str, add_special_tokens: bool = True) -> list[int]:
    return gw.gateway.model.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def test_the_openai_client_gets_each_inputs_embedding_in_order(gw):
    client = openai.OpenAI(base_url=f"http://{gw.http_address}/v1", api_key="unused", max_retries=0, timeout=30)
    inputs = ["The capital of France", "is Paris", "and not Lyon"]
    response = client.embeddings.create(model=MODEL, input=inputs)  # base64 on the wire, decoded by the client
    assert [d.index for d in response.data] == [0, 1, 2]
    for data, text in zip(response.data, inputs):
        assert data.embedding == fake_embedding(tokenize(gw, text))
    assert response.usage.prompt_tokens == sum(len(tokenize(gw, t)) for t in inputs)
    assert response.model == MODEL


def test_float_encoding_token_ids_and_what_reaches_the_instance(gw):
    before = len(embed_requests(gw))
    status, body = post(gw.http_address, "/v1/embeddings", {
        "input": [[5, 6, 7, 8], [9, 10]], "encoding_format": "float", "use_activation": False, "priority": -3,
        "truncate_prompt_tokens": 3, "request_id": "mine"})
    assert status == 200, body
    assert body["object"] == "list" and body["id"].startswith("embd-")
    assert [d["embedding"] for d in body["data"]] == [fake_embedding([6, 7, 8]), fake_embedding([9, 10])]
    assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}
    sent = sorted(embed_requests(gw)[before:], key=lambda r: r.request_id)
    assert [r.request_id for r in sent] == ["mine-0", "mine-1"]
    assert [list(r.prompt_token_ids) for r in sent] == [[6, 7, 8], [9, 10]]
    assert all(r.priority == -3 and r.pooling.normalize is False for r in sent)


def test_base64_is_little_endian_float32(gw):
    status, body = post(gw.http_address, "/v1/embeddings", {"model": MODEL, "input": [3, 4, 5],
                                                             "encoding_format": "base64"})
    assert status == 200, body
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == fake_embedding([3, 4, 5])


def test_messages_are_rendered_without_a_generation_prompt(gw):
    messages = [{"role": "user", "content": "Hello there"}]
    status, body = post(gw.http_address, "/v1/embeddings", {"messages": messages, "encoding_format": "float"})
    assert status == 200, body
    expected = gw.gateway.model.tokenizer.apply_chat_template(messages,
                                                              ChatTemplateOptions(add_generation_prompt=False))
    assert list(embed_requests(gw)[-1].prompt_token_ids) == expected
    assert body["data"][0]["embedding"] == fake_embedding(expected)


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[1, 2], 5]}, "input[1]"),
    ({"input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}, "input"),
    ({}, "input"),
    ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, "input"),
    ({"input": "x", "normalize": True}, "normalize"),
    ({"input": "x", "encoding_format": "bytes"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "add_generation_prompt": True}, "add_generation_prompt"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "x", "embed_dtype": "float16"}, "embed_dtype"),
    ({"input": "x", "no_such_field": 1}, "no_such_field"),
    ({"input": [10**6]}, "input"),  # out of the vocabulary: the gateway's check
    ({"input": "x", "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),  # past max_model_len
])
def test_bad_requests_are_400_naming_the_field(gw, body, param):
    before = len(embed_requests(gw))
    status, response = post(gw.http_address, "/v1/embeddings", body)
    assert status == 400, response
    assert response["error"]["param"] == param, response
    assert len(embed_requests(gw)) == before  # nothing reached the instance


def test_another_model_is_404(gw):
    status, body = post(gw.http_address, "/v1/embeddings", {"model": "other", "input": "x"})
    assert status == 404 and body["error"]["param"] == "model"


@pytest.mark.parametrize("code, http_status", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.INTERNAL, 500)])
def test_an_instances_status_becomes_its_http_code(code, http_status):
    with http_gateway(token_ids=TOKENS, failure=Failure(code, details="refused by the instance")) as gw:
        status, body = post(gw.http_address, "/v1/embeddings", {"input": ["a", "b"]})
        assert status == http_status, body
        assert "refused by the instance" in body["error"]["message"]
        assert body["error"]["param"] == ("input" if code == grpc.StatusCode.INVALID_ARGUMENT else None)


def test_an_instance_gone_is_retried_on_another():
    with http_gateway() as gw:
        gone = gw.add_fake_decode("decode-0", token_ids=TOKENS, failure=Failure(grpc.StatusCode.UNAVAILABLE))
        alive = gw.add_fake_decode("decode-1", token_ids=TOKENS)
        status, body = post(gw.http_address, "/v1/embeddings", {"input": [7, 8], "encoding_format": "float"})
        assert status == 200, body
        assert body["data"][0]["embedding"] == fake_embedding([7, 8])
        assert len(gone.embedding_servicer.requests) == 1 and len(alive.embedding_servicer.requests) == 1


def test_no_instance_is_503():
    with http_gateway() as gw:
        status, body = post(gw.http_address, "/v1/embeddings", {"input": "x"})
        assert status == 503 and "no prefill or decode instance" in body["error"]["message"]


def test_grpc_embed_and_its_refusals(gw):
    with Client(gw.address, timeout=30) as client:
        result = client.embed("Hello world", pooling=PoolingParams(normalize=False), request_id="g1")
        assert result.request_id == "g1" and result.instance_id == "decode-0"
        assert result.embedding == fake_embedding(tokenize(gw, "Hello world"))
        assert result.usage.prompt_tokens == len(tokenize(gw, "Hello world")) and result.usage.completion_tokens == 0
        messages = [{"role": "user", "content": "Hi"}]
        chat = client.embed(messages)
        assert chat.embedding == fake_embedding(gw.gateway.model.tokenizer.apply_chat_template(
            messages, ChatTemplateOptions(), add_special_tokens=False))
        assert client.embed([1, 2, 3, 4], truncate_prompt_tokens=2).embedding == fake_embedding([3, 4])
        for bad, message in (({"model": "other"}, "is not served here"),
                             ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be -1")):
            with pytest.raises(grpc.RpcError) as error:
                client.embed("x", **bad)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.value.details()


def embeddings_by_status(gw) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{gw.server.metrics_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith('pdserve_embeddings_total{status="')}


def test_embeddings_are_counted_by_status_refusals_too():
    with http_gateway(token_ids=TOKENS, with_metrics=True) as gw:
        assert post(gw.http_address, "/v1/embeddings", {"input": ["a", "b", "c"]})[0] == 200
        assert post(gw.http_address, "/v1/embeddings", {"input": "a", "dimensions": 0})[0] == 400
        assert post(gw.http_address, "/v1/embeddings", {"input": [10**6]})[0] == 400
        with Client(gw.address, timeout=30) as client:
            client.embed("d")
        counted = embeddings_by_status(gw)
    assert counted == {"OK": 4.0, "INVALID_ARGUMENT": 2.0}

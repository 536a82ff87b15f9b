"""--api-key on both public APIs of a real in-process gateway (real gRPC, real uvicorn on
127.0.0.1): without one of the keys, GenerateService calls are UNAUTHENTICATED and the HTTP
API's guarded routes 401 (counted as refusals, never reaching decode); with one, served;
probes stay open."""
from __future__ import annotations

import grpc
import pytest

from gateway.api_keys import ApiKeys, parse_api_keys
from gateway.client import Client
from gateway.core import GatewaySettings
from gateway.openai_api.server import OpenAIServer
from tests.support.background_gateway import BackgroundGateway
from tests.unit.gateway.openai_api.test_http_refusal_metrics import requests_by_status
from tests.unit.gateway.openai_api.test_server import MODEL, TOKENS, post

openai = pytest.importorskip("openai")
KEYS = ["key-one", "key-two"]


@pytest.fixture(scope="module")
def gw():
    with BackgroundGateway(GatewaySettings(heartbeat_timeout_s=30.0), api_keys=KEYS, metrics_port=0) as gateway:
        gateway.fake = gateway.add_fake_decode("decode-0", token_ids=TOKENS)
        server = gateway.server.openai_http = gateway.call(
            lambda: OpenAIServer(gateway.gateway, port=0, api_keys=gateway.server.api_keys))
        gateway.http_address = gateway.call(server.start())
        yield gateway
        gateway.call(server.stop())


def test_keys_match_whole_and_only_as_bearer():
    keys = ApiKeys(parse_api_keys(" key-one , key-two "))
    assert keys.accepts("Bearer key-one") and keys.accepts(b"bearer key-two")
    for presented in (None, "", "Bearer", "Bearer key", "Bearer key-one2", "Basic key-one", "key-one"):
        assert not keys.accepts(presented), presented
    with pytest.raises(ValueError, match="at least one"):
        parse_api_keys(" , ")
    assert parse_api_keys("") == []  # an unset compose variable: no key


def test_grpc_calls_need_a_key(gw, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    calls_before, before = len(gw.fake.servicer.requests), requests_by_status(gw).get("UNAUTHENTICATED", 0)
    for api_key in (None, "wrong"):
        with Client(gw.address, timeout=10, api_key=api_key) as client:
            for call in (lambda: client.generate("hi", max_tokens=2), lambda: list(client.generate_stream("hi")),
                         client.model_info):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "--api-key" in refused.value.details()
    assert len(gw.fake.servicer.requests) == calls_before  # nothing reached decode
    with Client(gw.address, timeout=10, api_key="key-two") as client:
        assert client.generate("hi", max_tokens=2).usage.completion_tokens == 2
    monkeypatch.setenv("PDSERVE_API_KEY", "key-one")
    with Client(gw.address, timeout=10) as client:  # the environment's key
        assert client.model_info().model_name == MODEL
    assert requests_by_status(gw)["UNAUTHENTICATED"] - before >= 4  # Generate and GenerateStream, twice


def test_http_routes_need_a_key_and_probes_do_not(gw):
    base = f"http://{gw.http_address}/v1"
    for api_key in ("missing", "wrong"):
        client = openai.OpenAI(base_url=base, api_key=api_key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    before = requests_by_status(gw).get("UNAUTHENTICATED", 0)
    for path, body in (("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
                       ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        status, error = post(gw.http_address, path, body)
        assert status == 401 and error["error"]["type"] == "authentication_error"
    assert requests_by_status(gw)["UNAUTHENTICATED"] - before == 1  # the chat request; tokenizing is not one
    for path in ("/health", "/version", "/openapi.json"):
        assert post(gw.http_address, path, b"", method="GET")[0] == 200
    client = openai.OpenAI(base_url=base, api_key="key-one", max_retries=0)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_pdserve_up_waits_for_its_instances_with_the_gateways_key(monkeypatch):
    from common.cli.up import LocalStack
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    assert LocalStack(1, 1, passthrough=["--api-key", "k1,k2"]).api_key == "k1"
    assert LocalStack(1, 1, passthrough=["--api-key=k3"]).api_key == "k3"
    assert LocalStack(1, 1).api_key is None
    monkeypatch.setenv("PDSERVE_API_KEY", "k4")
    assert LocalStack(1, 1).api_key == "k4"


def test_the_serving_benchmarks_clients_send_the_environments_key(gw, monkeypatch):
    import asyncio

    from bench.serve.client import GrpcGenerateBackend, OpenAICompletionsBackend, OpenAIHTTPError
    from bench.serve.datasets import BenchRequest

    async def one_request(backend) -> int:
        await backend.open()
        try:
            await backend.server_info()
            return sum([n async for _, n in backend.stream(BenchRequest([5, 6, 7], 3, 2))])
        finally:
            await backend.close()

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    with pytest.raises(grpc.RpcError):
        asyncio.run(one_request(GrpcGenerateBackend(gw.address, model=MODEL)))
    with pytest.raises(OpenAIHTTPError):
        asyncio.run(one_request(OpenAICompletionsBackend(f"http://{gw.http_address}/v1", model=MODEL)))
    monkeypatch.setenv("PDSERVE_API_KEY", "key-two")
    assert asyncio.run(one_request(GrpcGenerateBackend(gw.address, model=MODEL))) == 2
    assert asyncio.run(one_request(OpenAICompletionsBackend(f"http://{gw.http_address}/v1", model=MODEL))) == 2


def test_embeddings_need_a_key_on_both_edges_and_refusals_count_as_embeddings(gw):
    from tests.unit.gateway.openai_api.test_embeddings import embeddings_by_status
    before = embeddings_by_status(gw).get("UNAUTHENTICATED", 0)
    embeds_before = len(gw.fake.embedding_servicer.requests)
    with Client(gw.address, timeout=10, api_key="wrong") as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.embed("hi")
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    status, error = post(gw.http_address, "/v1/embeddings", {"input": "hi"})
    assert status == 401 and error["error"]["code"] == "invalid_api_key"
    assert len(gw.fake.embedding_servicer.requests) == embeds_before  # nothing reached the instance
    assert embeddings_by_status(gw)["UNAUTHENTICATED"] - before == 2
    client = openai.OpenAI(base_url=f"http://{gw.http_address}/v1", api_key="key-one", max_retries=0)
    assert len(client.embeddings.create(model=MODEL, input=["a", "b"]).data) == 2


def test_score_and_rerank_need_a_key_and_refusals_count_as_embeddings(gw):
    import http.client
    import json

    from tests.unit.gateway.openai_api.test_embeddings import embeddings_by_status

    def post_with(path: str, api_key: str | None) -> int:
        connection = http.client.HTTPConnection(*gw.http_address.split(":"), timeout=30)
        headers = {"content-type": "application/json",
                   **({"authorization": f"Bearer {api_key}"} if api_key else {})}
        try:
            body = {"query": "a", "documents": ["b"]} if "rerank" in path else {"queries": "a", "documents": ["b"]}
            connection.request("POST", path, body=json.dumps(body), headers=headers)
            return connection.getresponse().status
        finally:
            connection.close()
    before = embeddings_by_status(gw).get("UNAUTHENTICATED", 0)
    embeds_before = len(gw.fake.embedding_servicer.requests)
    paths = ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")
    assert [post_with(path, None) for path in paths] == [401] * 5
    assert post_with("/score", "wrong") == 401
    assert len(gw.fake.embedding_servicer.requests) == embeds_before  # nothing reached the instance
    assert embeddings_by_status(gw)["UNAUTHENTICATED"] - before == 6
    assert [post_with(path, "key-two") for path in paths] == [200] * 5

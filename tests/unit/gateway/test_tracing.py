"""The gateway's spans (common.service.tracing) over real OTLP/gRPC to a receiver on loopback:
a request's `generate` span continues the caller's trace (gRPC metadata or HTTP header) and
hands its own context to the Decode call, with the synthetic decode (bench.fakes.fake_decode)."""
from __future__ import annotations

import http.client
import json

import grpc
import pytest

from bench.fakes.fake_decode import Failure
from common.service.tracing import Tracing
from gateway.client import build_generate_request
from gateway.core import GatewaySettings
from gateway.openai_api.server import OpenAIServer
from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc
from tests.support.background_gateway import BackgroundGateway
from tests.support.otlp_collector import CALLER_SPAN_ID, CALLER_TRACE_ID, CALLER_TRACEPARENT, OtlpCollector

TOKENS = [504, 3458, 314, 4649]


@pytest.fixture
def traced():
    """(collector, gateway, the gateway's HTTP address); each test adds its decode instances."""
    with OtlpCollector() as collector:
        tracing = Tracing("gateway", "gw-test", collector.endpoint)
        with BackgroundGateway(GatewaySettings(heartbeat_timeout_s=30.0), tracing=tracing) as gw:
            server = gw.call(lambda: OpenAIServer(gw.gateway, port=0))
            http_address = gw.call(server.start())
            try:
                yield collector, gw, http_address
            finally:
                gw.call(server.stop())


def _check_generate_span(collector, gw, request_id: str) -> None:
    (span,) = collector.wait_for(lambda spans: any(s.attributes.get("gen_ai.request.id") == request_id
                                                    for s in spans))
    assert (span.name, span.service, span.trace_id, span.parent_span_id) == (
        "generate", "pdserve-gateway", CALLER_TRACE_ID, CALLER_SPAN_ID)
    assert (span.attributes["gen_ai.usage.completion_tokens"], span.attributes["pdserve.decode"],
            span.attributes["pdserve.status"]) == (len(TOKENS), "decode-0", "OK")
    assert span.attributes["gen_ai.latency.time_to_first_token"] > 0 and not span.is_error
    assert span.attributes["pdserve.migrations"] == 0
    # The decode instance's span will be this one's child.
    sent = gw.fakes[0].servicer.metadata[-1]
    assert sent["traceparent"] == f"00-{CALLER_TRACE_ID}-{span.span_id}-01"


def test_a_grpc_generate_span_continues_the_callers_trace_and_parents_the_decode_call(traced):
    collector, gw, _ = traced
    gw.add_fake_decode("decode-0", token_ids=TOKENS)
    with grpc.insecure_channel(gw.address) as channel:
        request = build_generate_request("hi", None, request_id="req-grpc")
        request.sampling.max_tokens = len(TOKENS)
        generate_pb2_grpc.GenerateServiceStub(channel).Generate(
            request, timeout=10, metadata=(("traceparent", CALLER_TRACEPARENT),))
    _check_generate_span(collector, gw, "req-grpc")


def test_an_http_completion_span_continues_the_traceparent_header(traced):
    collector, gw, http_address = traced
    gw.add_fake_decode("decode-0", token_ids=TOKENS)
    host, port = http_address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request("POST", "/v1/completions", json.dumps({"model": gw.gateway.model.name, "prompt": "hi",
                                                                "max_tokens": len(TOKENS)}),
                       {"Content-Type": "application/json", "traceparent": CALLER_TRACEPARENT})
    response = connection.getresponse()
    assert response.status == 200, response.read()
    request_id = json.loads(response.read())["id"]
    _check_generate_span(collector, gw, request_id)


def test_a_request_without_a_trace_context_starts_a_trace_and_a_failure_is_an_error_span(traced):
    collector, gw, _ = traced
    gw.add_fake_decode("decode-0", token_ids=TOKENS)
    with grpc.insecure_channel(gw.address) as channel, pytest.raises(grpc.RpcError):
        request = build_generate_request("hi", None, request_id="req-bad")
        request.sampling.max_tokens = 10 ** 7  # past the model's length: refused as the request is prepared
        generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=10)
    (span,) = collector.wait_for(lambda spans: any(s.attributes.get("gen_ai.request.id") == "req-bad"
                                                    for s in spans))
    assert span.parent_span_id == "" and span.is_error
    assert span.attributes["pdserve.status"] == "INVALID_ARGUMENT"


def test_a_migrated_request_stays_one_trace_with_both_decode_calls_under_its_span(traced):
    collector, gw, _ = traced
    lost = gw.add_fake_decode("decode-a", token_ids=TOKENS,
                              failure=Failure(grpc.StatusCode.UNAVAILABLE, after_tokens=2))
    spare = gw.add_fake_decode("decode-b", token_ids=TOKENS)
    with grpc.insecure_channel(gw.address) as channel:
        request = build_generate_request("hi", None, request_id="req-moved")
        request.sampling.max_tokens = len(TOKENS)
        generate_pb2_grpc.GenerateServiceStub(channel).Generate(
            request, timeout=10, metadata=(("traceparent", CALLER_TRACEPARENT),))
    (span,) = collector.wait_for(lambda spans: any(s.attributes.get("gen_ai.request.id") == "req-moved"
                                                    for s in spans))
    assert (span.attributes["pdserve.migrations"], span.attributes["pdserve.decode"]) == (1, "decode-b")
    parent = f"00-{CALLER_TRACE_ID}-{span.span_id}-01"
    assert [lost.servicer.metadata[0]["traceparent"], spare.servicer.metadata[0]["traceparent"]] == [parent] * 2


def test_an_http_embedding_span_continues_the_traceparent_header_and_parents_the_embed_call(traced):
    collector, gw, http_address = traced
    fake = gw.add_fake_decode("decode-0", token_ids=TOKENS)
    host, port = http_address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request("POST", "/v1/embeddings", json.dumps({"model": gw.gateway.model.name, "input": "hi",
                                                             "request_id": "emb-1"}),
                       {"Content-Type": "application/json", "traceparent": CALLER_TRACEPARENT})
    response = connection.getresponse()
    assert response.status == 200, response.read()
    (span,) = collector.wait_for(lambda spans: any(s.attributes.get("gen_ai.request.id") == "emb-1" for s in spans))
    assert (span.name, span.trace_id, span.parent_span_id) == ("embed", CALLER_TRACE_ID, CALLER_SPAN_ID)
    assert (span.attributes["pdserve.instance"], span.attributes["pdserve.status"]) == ("decode-0", "OK")
    assert fake.embedding_servicer.metadata[-1]["traceparent"] == f"00-{CALLER_TRACE_ID}-{span.span_id}-01"


def test_every_step_of_a_beam_search_is_a_span_of_the_callers_trace(traced):
    collector, gw, _ = traced
    gw.add_fake_decode("decode-0", token_ids=TOKENS)
    with grpc.insecure_channel(gw.address) as channel:
        request = generate_pb2.BeamSearchRequest(request=build_generate_request("hi", None, request_id="beams"),
                                                 beam_width=2)
        request.request.sampling.max_tokens = 2
        generate_pb2_grpc.GenerateServiceStub(channel).BeamSearch(
            request, timeout=10, metadata=(("traceparent", CALLER_TRACEPARENT),))
    spans = collector.wait_for(lambda spans: sum(s.attributes.get("gen_ai.request.id", "").startswith("beams-beam")
                                                 for s in spans) >= 3)
    steps = [s for s in spans if s.attributes["gen_ai.request.id"].startswith("beams-beam")]
    assert {(s.trace_id, s.parent_span_id) for s in steps} == {(CALLER_TRACE_ID, CALLER_SPAN_ID)}

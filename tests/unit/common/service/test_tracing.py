"""common.service.tracing: spans exported over real OTLP/gRPC to a receiver on loopback."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from common.service.errors import ServiceError
from common.service.logging_setup import logged_request
from common.service.tracing import EXPORT_TIMEOUT_S, NO_TRACING, Tracing, attributes, trace_headers
from tests.support.otlp_collector import CALLER_SPAN_ID, CALLER_TRACE_ID, CALLER_TRACEPARENT, OtlpCollector



@pytest.fixture
def collector():
    with OtlpCollector() as c:
        yield c


def test_trace_headers_are_the_w3c_ones_whatever_their_case():
    assert trace_headers([("Traceparent", CALLER_TRACEPARENT), ("authorization", "Bearer x"),
                          ("tracestate", "a=1"), ("bin-bin", b"\x00")]) == {
        "traceparent": CALLER_TRACEPARENT, "tracestate": "a=1"}
    assert trace_headers({"content-type": "application/json"}) == {} and trace_headers(None) == {}


def test_fields_become_gen_ai_and_pdserve_attributes():
    assert attributes({"prompt_tokens": 7, "finish_reason": "length", "prefill": "prefill-0", "ttft_s": None}) == {
        "pdserve.prompt_tokens": 7, "gen_ai.usage.prompt_tokens": 7, "pdserve.finish_reason": "length",
        "gen_ai.response.finish_reasons": ["length"], "pdserve.prefill": "prefill-0"}


def test_tracing_off_makes_no_span_and_no_headers():
    assert not NO_TRACING.enabled
    assert NO_TRACING.start("generate", {"traceparent": CALLER_TRACEPARENT}) is None
    assert Tracing.child_headers(None) == {}
    Tracing.finish(None, "OK")


def test_a_span_continues_the_callers_trace_and_hands_its_own_context_on(collector):
    tracing = Tracing("decode", "decode-7", collector.endpoint)
    span = tracing.start("decode", {"traceparent": CALLER_TRACEPARENT}, request_id="req-1", prompt_tokens=5)
    child = Tracing.child_headers(span)
    Tracing.finish(span, "OK", output_tokens=3)
    tracing.shutdown()  # exports what is buffered
    (received,) = collector.wait_for(lambda spans: len(spans) == 1)
    assert (received.name, received.service, received.trace_id, received.parent_span_id) == (
        "decode", "pdserve-decode", CALLER_TRACE_ID, CALLER_SPAN_ID)
    assert child["traceparent"] == f"00-{CALLER_TRACE_ID}-{received.span_id}-01"
    assert received.attributes["gen_ai.request.id"] == "req-1"
    assert (received.attributes["gen_ai.usage.prompt_tokens"], received.attributes["gen_ai.usage.completion_tokens"],
            received.attributes["pdserve.status"]) == (5, 3, "OK")
    assert not received.is_error


class _Context:
    """What logged_request reads of a grpc.aio ServicerContext."""

    def __init__(self, metadata):
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata

    def code(self):
        return None


def test_logged_request_makes_the_rpcs_span_with_its_log_fields_and_error_status(collector):
    tracing = Tracing("prefill", "prefill-0", collector.endpoint)

    async def failing_rpc():
        with logged_request(logging.getLogger("t"), "prefill", "req-2", _Context([("traceparent", CALLER_TRACEPARENT)]),
                            tracing, prompt_tokens=9) as end:
            assert end.span is not None
            end.update(cached_tokens=4)
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")

    with pytest.raises(ServiceError):
        asyncio.run(failing_rpc())
    tracing.shutdown()
    (received,) = collector.wait_for(lambda spans: len(spans) == 1)
    assert (received.name, received.trace_id, received.parent_span_id) == ("prefill", CALLER_TRACE_ID, CALLER_SPAN_ID)
    assert received.is_error and received.attributes["pdserve.status"] == "RESOURCE_EXHAUSTED"
    assert (received.attributes["pdserve.cached_tokens"], received.attributes["gen_ai.usage.prompt_tokens"]) == (4, 9)
    assert received.attributes["gen_ai.latency.e2e"] >= 0


@pytest.mark.timing
def test_a_collector_that_is_down_costs_spans_not_requests_and_delays_exit_by_the_export_timeout_at_most():
    tracing = Tracing("gateway", "gw", "http://127.0.0.1:9")  # nothing listens on the discard port
    span = tracing.start("generate", None, request_id="req-3")
    Tracing.finish(span, "OK")
    started = time.monotonic()
    tracing.shutdown()  # gives up on the export; raises nothing
    assert time.monotonic() - started < EXPORT_TIMEOUT_S + 1.5

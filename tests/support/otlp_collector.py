"""A real OTLP/gRPC trace receiver on 127.0.0.1 for tests: what an OpenTelemetry Collector
would receive from pdserve's services (common.service.tracing).

    with OtlpCollector() as collector:
        ... run services with --otlp-traces-endpoint collector.endpoint ...
        spans = collector.wait_for(lambda spans: len(spans) >= 3)
"""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

# A caller's own trace context (W3C's example ids), as a client that traces would send it.
CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
CALLER_TRACEPARENT = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"


@dataclass
class ReceivedSpan:
    name: str
    service: str  # the resource's service.name
    instance_id: str  # the resource's service.instance.id
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: dict[str, Any] = field(default_factory=dict)
    is_error: bool = False


def _value(any_value) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: "OtlpCollector"):
        self.collector = collector

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        name=span.name, service=resource.get("service.name", ""),
                        instance_id=resource.get("service.instance.id", ""), trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(), parent_span_id=span.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        is_error=span.status.code == span.status.STATUS_CODE_ERROR))
        with self.collector._lock:
            self.collector._spans += received
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpCollector:
    def __init__(self):
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "OtlpCollector":
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(None)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 15.0) -> list[ReceivedSpan]:
        """The spans received once done(spans) holds; AssertionError with what came, past timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not done(spans := self.spans()):
            assert time.monotonic() < deadline, f"spans received: {[(s.service, s.name) for s in spans]}"
            time.sleep(0.05)
        return spans

"""OpenTelemetry traces: a span per request on every service it crosses, one trace per request.

Off unless `--otlp-traces-endpoint` (vLLM's flag; PDSERVE_OTLP_TRACES_ENDPOINT) names an
OTLP/gRPC collector (Jaeger, Tempo, the OpenTelemetry Collector). Then the gateway opens a
`generate` span per request (continuing the client's own W3C `traceparent`, from gRPC
metadata or the HTTP header), the decode instance a `decode` span under it and the prefill
instance a `prefill` span under that: the trace context travels in each hop's gRPC metadata
(`traceparent`, `tracestate`). A span's attributes are the fields of the request's start and
end log lines (`pdserve.*`), plus OpenTelemetry's gen_ai names where one exists, as vLLM
sets them. Spans are exported in batches off the request path; a collector that is down
loses spans, never requests.

Each service holds its own TracerProvider (no global state), so one process may run several.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from typing import TYPE_CHECKING

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

logger = logging.getLogger(__name__)

PROPAGATOR = TraceContextTextMapPropagator()
TRACE_HEADERS = ("traceparent", "tracestate")
EXPORT_TIMEOUT_S = 2.0  # what W3C trace context puts in a carrier
# Log fields that have an OpenTelemetry gen_ai name (vLLM's SpanAttributes); the rest are pdserve.<field>.
GEN_AI_NAMES = {"request_id": "gen_ai.request.id", "model": "gen_ai.response.model",
                "max_tokens": "gen_ai.request.max_tokens", "temperature": "gen_ai.request.temperature",
                "top_p": "gen_ai.request.top_p", "prompt_tokens": "gen_ai.usage.prompt_tokens",
                "output_tokens": "gen_ai.usage.completion_tokens", "ttft_s": "gen_ai.latency.time_to_first_token",
                "duration_s": "gen_ai.latency.e2e", "finish_reason": "gen_ai.response.finish_reasons",
                # The engine's own intervals (common.service.engine_requests.timing_fields).
                "queue_s": "gen_ai.latency.time_in_queue", "prefill_s": "gen_ai.latency.time_in_model_prefill",
                "decode_s": "gen_ai.latency.time_in_model_decode",
                "inference_s": "gen_ai.latency.time_in_model_inference"}


def add_tracing_args(parser) -> None:
    """--otlp-traces-endpoint, the same for the gateway and both workers."""
    parser.add_argument("--otlp-traces-endpoint", default=None,
                        help="send OpenTelemetry traces (a span per request on every service, one trace per "
                             "request) to this OTLP/gRPC collector, e.g. http://127.0.0.1:4317; unset: no tracing")


def trace_headers(metadata: Iterable[tuple[str, Any]] | Mapping[str, Any] | None) -> dict[str, str]:
    """The W3C trace context among gRPC metadata or HTTP headers (empty when there is none)."""
    items = metadata.items() if isinstance(metadata, Mapping) else (metadata or ())
    return {key.lower(): value for key, value in items
            if isinstance(value, str) and key.lower() in TRACE_HEADERS}


def _attribute(value: Any) -> Any:
    """A value OpenTelemetry takes as an attribute (None is dropped by the caller)."""
    return value if isinstance(value, (bool, int, float, str)) else str(value)


def attributes(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Log fields as span attributes: gen_ai names where they exist, pdserve.<field> for all."""
    out = {}
    for key, value in fields.items():
        if value is None:
            continue
        out[f"pdserve.{key}"] = _attribute(value)
        if key in GEN_AI_NAMES:
            out[GEN_AI_NAMES[key]] = [value] if key == "finish_reason" else _attribute(value)
    return out


class Tracing:
    """One service's tracer; every method is a no-op returning None/{} while tracing is off."""

    def __init__(self, service_name: str, instance_id: str, endpoint: str | None = None,
                 exporter: "SpanExporter | None" = None):
        self._provider = None
        self._tracer = None
        if endpoint is None and exporter is None:
            return
        # The SDK only where tracing is on: it costs every process ~0.1 s to import.
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            # A short export timeout: at exit, a collector that is down delays the service this long at most.
            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"),
                                        timeout=EXPORT_TIMEOUT_S)
        self._provider = TracerProvider(resource=Resource.create(
            {"service.name": f"pdserve-{service_name}", "service.instance.id": instance_id}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self._tracer = self._provider.get_tracer("pdserve")
        logger.info("tracing: spans go to %s", endpoint or type(exporter).__name__)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def start(self, name: str, parent_headers: Mapping[str, str] | None, **fields) -> Span | None:
        """A SERVER span named `name`, the child of the trace context in parent_headers (else a
        new trace), with fields as its first attributes; None while tracing is off."""
        if self._tracer is None:
            return None
        parent = PROPAGATOR.extract(parent_headers) if parent_headers else None
        return self._tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes(fields))

    @staticmethod
    def child_headers(span: Span | None) -> dict[str, str]:
        """The carrier that makes the next hop's span a child of `span` ({} for None)."""
        if span is None:
            return {}
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier, context=set_span_in_context(span))
        return carrier

    @staticmethod
    def finish(span: Span | None, status: str, **fields) -> None:
        """End `span` with its end fields; a status other than OK (a gRPC status name) marks it an error."""
        if span is None:
            return
        span.set_attributes(attributes({"status": status, **fields}))
        if status != "OK":
            span.set_status(Status(StatusCode.ERROR, status))
        span.end()

    def shutdown(self) -> None:
        """Export what is buffered and stop (at service exit)."""
        if self._provider is not None:
            self._provider.shutdown()


NO_TRACING = Tracing("off", "")

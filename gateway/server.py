"""The gateway's gRPC servers: GenerateService + health + reflection on the public port,
and RegistryService alone on an internal one (registry_port), which deployments never
publish: whoever can register receives users' prompts, so the registry is not part of
the public surface, and with a registry token every call there must carry it.

Health: "" is liveness (SERVING while the process serves); pdserve.v1.GenerateService
is readiness (gateway.readiness: SERVING only while a decode instance is alive and the
gateway is not draining), pushed to the health service each time it changes. Both go
NOT_SERVING for good when the server stops.

The servicer is a thin edge: protobuf in (gateway.api), Gateway, protobuf out;
a ServiceError becomes its status (common.service.errors.ErrorStatusInterceptor). Used by
`pdserve gateway` (gateway.main) and started in-process by tests:

    server = GatewayServer(load_served_model(None), GatewaySettings(), port=0)
    address = await server.start()   # "127.0.0.1:PORT"; instances register at server.registry_address
    ...

With metrics_port set (0: a free port), it also serves the gateway's Prometheus
metrics (common.service.metrics.GatewayMetrics) on http://metrics_address/metrics.
    await server.stop()
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2

from common.service.errors import ErrorStatusInterceptor, ServiceError
from common.service.keepalive import KEEPALIVE_SERVER_OPTIONS
from common.service.tracing import NO_TRACING, Tracing, trace_headers
from gateway.admission import RETRY_AFTER_METADATA
from gateway.api import (beam_search_input_from_pb, beam_search_result_to_pb, delta_to_pb, deployment_info_to_pb,
                         embed_input_from_pb, embedding_result_to_pb, generate_input_from_pb)
from gateway.api_keys import MISSING_KEY_MESSAGE, ApiKeys
from gateway.beam_search import beam_search_params, run_beam_search
from gateway.core import Gateway, GatewaySettings
from gateway.openai_api.reasoning_parsers import ReasoningParser, make_reasoning_parser
from gateway.reasoning_split import ReasoningSplit, reasoning_split
from gateway.routing.registry import RegistryServicer
from gateway.types import GenerateInput
from gateway.validation import ServedModel
from protos.pdserve.v1 import generate_pb2_grpc, registry_pb2_grpc
from protos.serving import GENERATE_SERVICE, add_health_and_reflection

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 << 20  # larger requests fail with RESOURCE_EXHAUSTED before parsing


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, gateway: Gateway, api_keys: ApiKeys | None = None,
                 reasoning_parser: ReasoningParser | None = None):
        self.gateway = gateway
        self.api_keys = api_keys
        self.reasoning_parser = reasoning_parser  # output.split_reasoning's

    def _authenticate(self, context, counted_as: str | None = "request") -> None:
        """counted_as: what a refused call counts as ("request": a Generate call, "embedding"), or None."""
        if self.api_keys is None:
            return
        if not self.api_keys.accepts(dict(context.invocation_metadata() or ()).get("authorization")):
            # A call refused is still a request, counted under its status.
            if counted_as == "request":
                self.gateway.metrics.request_timer().finish("UNAUTHENTICATED")
            elif counted_as == "embedding":
                self.gateway.metrics.embedding_finished("UNAUTHENTICATED", 0, 0.0)
            raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, MISSING_KEY_MESSAGE)

    async def Generate(self, request, context):
        self._authenticate(context)
        generate_input, split = self._converted(request, context)
        try:
            result = await self.gateway.generate(generate_input, context.time_remaining())
        except ServiceError as e:
            _add_retry_hint(context, e)
            raise
        return delta_to_pb(split.apply(result) if split else result)

    async def GenerateStream(self, request, context):
        self._authenticate(context)
        generate_input, split = self._converted(request, context)
        try:
            async for delta in self.gateway.stream(generate_input, context.time_remaining()):
                yield delta_to_pb(split.apply(delta) if split else delta)
        except ServiceError as e:
            _add_retry_hint(context, e)
            raise

    async def BeamSearch(self, request, context):
        self._authenticate(context)
        try:  # one refused here is still a request, counted under its status
            generate_input, beam_width, length_penalty = beam_search_input_from_pb(request)
            generate_input.trace_headers = trace_headers(context.invocation_metadata())  # each step's spans
            params = beam_search_params(generate_input, beam_width, length_penalty)
        except ServiceError as e:
            self.gateway.metrics.request_timer().finish(e.code.name)
            raise
        try:  # each step's requests are ordinary ones, placed, cancelled and counted by the gateway
            result = await run_beam_search(self.gateway, generate_input, params)
        except ServiceError as e:
            _add_retry_hint(context, e)
            raise
        return beam_search_result_to_pb(result)

    def _converted(self, request, context) -> tuple[GenerateInput, ReasoningSplit | None]:
        """The request in the gateway's types (the caller's trace context from its metadata),
        and its reasoning split if it asks for one; one refused here (a bad sampling field) is
        still a request, counted under its status like those the gateway refuses."""
        try:
            generate_input = generate_input_from_pb(request)
            generate_input.trace_headers = trace_headers(context.invocation_metadata())
            return generate_input, reasoning_split(self.reasoning_parser, generate_input)
        except ServiceError as e:
            self.gateway.metrics.request_timer().finish(e.code.name)
            raise

    async def ModelInfo(self, request, context):
        self._authenticate(context, counted_as=None)
        return deployment_info_to_pb(self.gateway.deployment_info())

    async def Embed(self, request, context):
        self._authenticate(context, counted_as="embedding")
        try:
            embed_input = embed_input_from_pb(request)
            embed_input.trace_headers = trace_headers(context.invocation_metadata())
        except ServiceError as e:  # a bad pooling field: counted like the gateway's refusals
            self.gateway.metrics.embedding_finished(e.code.name, 0, 0.0)
            raise
        try:
            result = await self.gateway.embed(embed_input, context.time_remaining())
        except ServiceError as e:
            _add_retry_hint(context, e)
            raise
        return embedding_result_to_pb(result)


def _add_retry_hint(context, error: ServiceError) -> None:
    """A refusal that says when to retry (admission's AdmissionRefused, a request id still
    held: RequestIdInFlight) carries it as trailing metadata the status goes out with
    (ErrorStatusInterceptor keeps it)."""
    retry_after_s = getattr(error, "retry_after_s", None)
    if retry_after_s is not None:
        context.set_trailing_metadata(((RETRY_AFTER_METADATA, str(round(retry_after_s * 1000))),))


class GatewayServer:
    def __init__(self, model: ServedModel, settings: GatewaySettings, host: str = "127.0.0.1",
                 port: int = 0, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 metrics_port: int | None = None, metrics_host: str | None = None,
                 registry_port: int = 0, registry_host: str | None = None, registry_token: str | None = None,
                 api_keys: list[str] | None = None, reasoning_parser: str | None = None,
                 tracing: Tracing = NO_TRACING):
        self.gateway = Gateway(model, settings, tracing)
        self.host = host
        self.port = port
        self.address = ""
        self.registry_host, self.registry_port = registry_host or host, registry_port
        self.registry_address = ""  # host:port instances register at, once serving
        self.metrics_port, self.metrics_host = metrics_port, metrics_host or host
        self.metrics_address = ""  # host:port once serving, when metrics_port is set
        self._server = aio.server(interceptors=[ErrorStatusInterceptor()], options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),  # a second gateway on a taken port fails instead of sharing it
        ])
        self.api_keys = ApiKeys(api_keys) if api_keys else None  # the HTTP API checks the same keys
        parser = make_reasoning_parser(reasoning_parser) if reasoning_parser else None
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(self.gateway, self.api_keys, parser),
                                                                self._server)
        self._registry_server = aio.server(interceptors=[ErrorStatusInterceptor()], options=[
            ("grpc.so_reuseport", 0), *KEEPALIVE_SERVER_OPTIONS])
        registry_pb2_grpc.add_RegistryServiceServicer_to_server(
            RegistryServicer(self.gateway.registry, registry_token), self._registry_server)
        self._health = None
        self._published_ready = True  # what add_health_and_reflection reports at first
        self._publishing: asyncio.Task | None = None
        self.gateway.readiness.subscribe(self._readiness_changed)

    async def start(self) -> str:
        """Bind, start serving and report SERVING; return the address clients dial."""
        bound_port = self._server.add_insecure_port(f"{self.host}:{self.port}")
        if bound_port == 0:
            raise OSError(f"cannot bind the gateway to {self.host}:{self.port}")
        registry_port = self._registry_server.add_insecure_port(f"{self.registry_host}:{self.registry_port}")
        if registry_port == 0:
            raise OSError(f"cannot bind the gateway's registry to {self.registry_host}:{self.registry_port}")
        if self.metrics_port is not None:  # before anything runs: a taken port fails the start cleanly
            self.metrics_address = self.gateway.metrics.serve(self.metrics_host, self.metrics_port)
        await self.gateway.start()
        # Handlers must all be added before start. The tokenizer is loaded by now, so
        # liveness is SERVING from the first moment; readiness waits for a decode instance.
        self._health = await add_health_and_reflection(self._server, GENERATE_SERVICE)
        self._readiness_changed(self.gateway.readiness.ready)  # no decode instance yet: NOT_SERVING
        await self._registry_server.start()
        await self._server.start()
        self.address = f"{_dialable(self.host)}:{bound_port}"
        self.registry_address = f"{_dialable(self.registry_host)}:{registry_port}"
        logger.info("gateway serving on %s, registry on %s (policy %s)", self.address, self.registry_address,
                    self.gateway.policy.name)
        return self.address

    def _readiness_changed(self, _ready: bool) -> None:
        if self._health is not None and (self._publishing is None or self._publishing.done()):
            self._publishing = asyncio.get_running_loop().create_task(self._publish_readiness())

    async def _publish_readiness(self) -> None:
        """Bring GenerateService's health status to the gateway's readiness. One writer at
        a time, looping until they agree, so changes that come while a status is being
        written (listeners are synchronous, HealthServicer.set is not) are never reordered."""
        readiness = self.gateway.readiness
        while self._published_ready != (ready := readiness.ready):
            status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            await self._health.set(GENERATE_SERVICE, status)
            self._published_ready = ready

    async def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Report NOT_SERVING, refuse new requests, let those in flight finish for up
        to drain_timeout_s, then stop (instances keep running and re-register with
        the next gateway)."""
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        await self.gateway.drain(drain_timeout_s)
        if self._publishing is not None:
            self._publishing.cancel()
        await self._server.stop(grace=1.0)
        await self._registry_server.stop(grace=1.0)
        await self.gateway.close()
        self.gateway.metrics.close()


def _dialable(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "[::]", "") else host

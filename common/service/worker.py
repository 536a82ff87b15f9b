"""What the prefill and decode worker services share: flags, the request gate
(ready / draining / in-flight count), request validation, and the process
lifecycle: load the engine, serve gRPC with health and reflection, register with
the gateway, print the READY line, drain on SIGTERM/SIGINT, exit 0.

Shutdown: health NOT_SERVING and new work refused (UNAVAILABLE "draining"), the
gateway is told we left, in-flight requests get --grace-period seconds to finish,
the rest are failed cleanly (UNAVAILABLE), then the server stops.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import grpc
from grpc import aio

from common.cli.main import EnvDefaultsParser, add_engine_args
from common.service.logging_setup import add_logging_args, configure_logging, log_event, request_context
from common.service.metrics import add_metrics_args
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams, validate_prompt_token_ids

logger = logging.getLogger(__name__)

READY_PREFIX = "PDSERVE_READY"


class ServiceError(Exception):
    """A request failed with a gRPC status; the servicer turns it into context.abort."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class DuplicateRequestError(ValueError):
    """A request with this id is still in flight (or holds blocks) on this instance."""


def make_parser(role: str, description: str) -> argparse.ArgumentParser:
    parser = EnvDefaultsParser(prog=f"pdserve {role}", description=description)
    g = parser.add_argument_group("service")
    g.add_argument("--host", default="127.0.0.1",
                   help="interface for the gRPC server and ZeroMQ sockets (loopback by default)")
    g.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one")
    g.add_argument("--advertise-address", default=None,
                   help="host:port the gateway and peers use to reach this instance; "
                        "default host:actual_port (the hostname when --host is 0.0.0.0)")
    g.add_argument("--instance-id", default=None, help=f"default {role}-HOSTNAME-PID-RANDOM (unique per process)")
    g.add_argument("--gateway", default=None,
                   help="gateway address to register with (host:port); none: serve unregistered")
    g.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM/SIGINT")
    g.add_argument("--served-model-name", default=None,
                   help="model name registered with the gateway; default: --model, or the bundled model's name")
    add_metrics_args(g)
    add_logging_args(g)
    add_engine_args(parser)
    return parser


def start_metrics(metrics, args: argparse.Namespace) -> str | None:
    """Serve `metrics` (common.service.metrics.ServiceMetrics) as the flags say; its address or None."""
    if args.metrics_port is None:
        return None
    host = args.metrics_host or args.host
    address = metrics.serve(host, args.metrics_port)
    logger.info("Prometheus metrics on http://%s/metrics", address)
    return address


def served_model_name(args: argparse.Namespace) -> str:
    from common.engine.model_files import BUNDLED_MODEL_NAME
    return args.served_model_name or args.model or BUNDLED_MODEL_NAME


def advertise_host(args: argparse.Namespace) -> str:
    if args.advertise_address:
        return args.advertise_address.rsplit(":", 1)[0].strip("[]")
    if args.host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return args.host


def zmq_bind_endpoint(host: str, port: int) -> str:
    return f"tcp://{host}:{port or '*'}"


def advertised_zmq_endpoint(args: argparse.Namespace, bound_endpoint: str) -> str:
    """The bound socket's endpoint as peers must dial it (port from the bind, host advertised)."""
    return f"tcp://{advertise_host(args)}:{bound_endpoint.rsplit(':', 1)[1]}"


def watch(future: concurrent.futures.Future) -> asyncio.Future:
    """An asyncio future resolved with `future`'s outcome. Unlike asyncio.wrap_future
    (and so `await transfer_handle`), cancelling it, or a task awaiting it, leaves
    `future` alone: a KV transfer's future must only ever be resolved by its
    connector, or its blocks would look free while zmq may still touch them."""
    loop = asyncio.get_running_loop()
    mirror = loop.create_future()

    def copy(done: concurrent.futures.Future) -> None:
        if mirror.done():
            return
        if done.cancelled():
            mirror.cancel()
        elif done.exception() is not None:
            mirror.set_exception(done.exception())
        else:
            mirror.set_result(done.result())
    def on_done(done: concurrent.futures.Future) -> None:
        try:
            loop.call_soon_threadsafe(copy, done)
        except RuntimeError:  # the loop closed: nobody is waiting any more
            pass
    future.add_done_callback(on_done)
    return mirror


def eos_token_ids(core) -> tuple[int, ...]:
    """The tokens that end generation, as the offline LLM computes them."""
    from common.text.tokenizer import load_tokenizer
    return tuple(sorted(set(core.model_config.eos_token_ids)
                        | set(load_tokenizer(core.model_dir).eos_token_ids)))


def validate_request(prompt_token_ids: list[int], params: SamplingParams, core) -> None:
    """Raise ServiceError(INVALID_ARGUMENT) for what the engine cannot serve."""
    try:
        validate_prompt_token_ids(prompt_token_ids, core.model_config.vocab_size)
        params.validate_token_ids(core.model_config.vocab_size)
    except ValueError as e:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    if params.n != 1:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"n must be 1 on an engine instance (the gateway fans out n > 1); got {params.n}")
    if len(prompt_token_ids) > core.max_model_len:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"prompt has {len(prompt_token_ids)} tokens, longer than the maximum model "
                           f"length of {core.max_model_len} tokens")


class EndFields(dict):
    """The fields of a request's end line. `complete` is set once the whole answer is out:
    the caller hanging up after that (the gateway cancels a finished stream) is no failure."""

    complete = False


@contextlib.contextmanager
def logged_request(log: logging.Logger, what: str, request_id: str, context: aio.ServicerContext | None = None,
                   **start_fields) -> Iterator[EndFields]:
    """One RPC's work, labelled with its request id (common.service.logging_setup) and logged as a
    `WHAT start` line and a `WHAT end` line with status and duration_s. The caller adds
    end fields to the yielded dict; a ServiceError, an abort of `context`, cancellation or
    a bug sets the status."""
    started = time.monotonic()
    end = EndFields(status="OK")
    with request_context(request_id):
        log_event(log, f"{what} start", **start_fields)
        try:
            yield end
        except ServiceError as e:
            end["status"] = e.code.name
            raise
        except BaseException as e:
            if end["status"] == "OK" and not end.complete:
                aborted = context.code() if context is not None else None  # context.abort raises too
                end["status"] = (aborted.name if isinstance(aborted, grpc.StatusCode)
                                 else "CANCELLED" if isinstance(e, (asyncio.CancelledError, GeneratorExit))
                                 else "INTERNAL")
            raise
        finally:
            end["duration_s"] = round(time.monotonic() - started, 4)
            log_event(log, f"{what} end", **end)


def new_request(req_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                eos: tuple[int, ...]) -> Request:
    if not req_id:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
    return Request(req_id, prompt_token_ids, params, eos_token_ids=eos, priority=priority)


class RequestGate:
    """Admission of work RPCs: counts in-flight ones, refuses new ones while draining."""

    def __init__(self, description: str):
        self.description = description  # e.g. "prefill instance prefill-a-12"
        self.draining = False
        self.stopping = False  # grace period over: in-flight requests are being failed
        self._num_inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_inflight(self) -> int:
        return self._num_inflight

    @contextlib.asynccontextmanager
    async def admit(self, context: aio.ServicerContext):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"{self.description} is draining (shutting down); send the request elsewhere")
        self._num_inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._num_inflight -= 1
            if not self._num_inflight:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def shutdown_error(self) -> ServiceError:
        return ServiceError(grpc.StatusCode.UNAVAILABLE,
                            f"{self.description} shut down before the request finished")


class Worker(Protocol):
    """One loaded worker (engine + sockets); built off the event loop by run_worker."""

    instance_id: str
    metrics: "common.service.metrics.WorkerMetrics"  # served on --metrics-port

    def add_to_server(self, server: aio.Server, gate: RequestGate) -> list[str]:
        """Add the servicers; return the service names for health and reflection."""

    def instance_spec(self, grpc_address: str):
        """common.service.registration.InstanceSpec to register."""

    def load(self):
        """common.service.registration.InstanceLoad for heartbeats."""

    def ready_fields(self) -> dict[str, str]:
        """Extra key=value pairs for the READY line (endpoints)."""

    async def fail_inflight(self) -> None:
        """Grace period over: end every unfinished request now."""

    async def close(self) -> None:
        """Release the engine and sockets."""


def stats_response(instance_id: str, stats: dict, load) -> "common_pb2.StatsResponse":
    """The Stats RPC's answer, the same for both roles: load plus prefix-cache counters."""
    from protos.pdserve.v1 import common_pb2
    return common_pb2.StatsResponse(
        instance_id=instance_id, load=load.to_pb(),
        prefix_cache_queried_tokens=stats["prefix_cache_queried_tokens"],
        prefix_cache_hit_tokens=stats["prefix_cache_hit_tokens"],
        num_finished_requests=stats["num_finished_requests"])


def default_instance_id(role: str) -> str:
    """Unique even where hostnames and pids repeat (host-network containers all carry the
    host's name and run as pid 1), so no launcher has to make ids up."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def run_worker(args: argparse.Namespace, role: str, build: Callable[[argparse.Namespace, str], Worker]) -> int:
    args.instance_id = args.instance_id or default_instance_id(role)
    try:
        configure_logging(role, args.instance_id, args.log_level, args.log_format)
        if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be 0 (a free port) to 65535; got {args.metrics_port}")
        return asyncio.run(_serve(args, role, build))
    except (ValueError, OSError) as e:  # bad flags found while building (e.g. KV pool too small), port taken
        print(f"pdserve {role}: error: {e}", file=sys.stderr)
        return 2


async def _serve(args: argparse.Namespace, role: str, build: Callable[[argparse.Namespace, str], Worker]) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Loading the model takes seconds; a signal meanwhile still ends the process cleanly.
    worker = await asyncio.to_thread(build, args, args.instance_id)
    gate = RequestGate(f"{role} instance {args.instance_id}")
    server = aio.server(options=[("grpc.so_reuseport", 0)])
    exit_code = 0
    registry_task = None
    try:
        service_names = worker.add_to_server(server, gate)
        port = server.add_insecure_port(f"{_bracket(args.host)}:{args.port}")
        if not port:
            raise ValueError(f"cannot bind gRPC to {args.host}:{args.port}")
        grpc_address = args.advertise_address or f"{_bracket(advertise_host(args))}:{port}"
        from protos.serving import add_health_and_reflection
        health = await add_health_and_reflection(server, *service_names)  # SERVING: the model is loaded
        metrics_address = start_metrics(worker.metrics, args)  # before serving: a taken port fails the start
        await server.start()
        if args.gateway:
            registry_task = _start_registration(args.gateway, worker.instance_spec(grpc_address), worker, stop)
        ready_fields = dict(worker.ready_fields())
        if metrics_address:
            ready_fields["metrics"] = metrics_address
        fields = " ".join(f"{k}={v}" for k, v in ready_fields.items())
        print(f"{READY_PREFIX} role={role} instance_id={args.instance_id} grpc={_bracket(args.host)}:{port} "
              f"advertise={grpc_address} {fields}".rstrip(), flush=True)
        logger.info("%s %s serving on %s:%d", role, args.instance_id, args.host, port)
        if not stop.is_set():
            await stop.wait()
        if registry_task is not None and registry_task.done() and registry_task.exception():
            exit_code = 1
        logger.info("shutting down: draining for up to %.0fs", args.grace_period)
        gate.draining = True
        await health.enter_graceful_shutdown()
        if registry_task is not None:  # leave first, so the gateway places nothing new here
            registry_task.cancel()
            await asyncio.gather(registry_task, return_exceptions=True)
        if not await gate.wait_idle(args.grace_period):
            logger.warning("%d requests still in flight after %.0fs: failing them", gate.num_inflight,
                           args.grace_period)
            gate.stopping = True
            await worker.fail_inflight()
            await gate.wait_idle(5.0)
        await server.stop(1.0)
    finally:
        worker.metrics.close()
        await worker.close()
    logger.info("stopped")
    return exit_code


def _start_registration(gateway: str, spec, worker: Worker, stop: asyncio.Event) -> asyncio.Task:
    from common.service.registration import RegistryClient
    task = asyncio.get_running_loop().create_task(RegistryClient(gateway, spec, worker.load).run())

    def on_done(t: asyncio.Task) -> None:
        if not t.cancelled() and t.exception() is not None:
            logger.error("gateway rejected this instance: %s", t.exception())
            stop.set()
    task.add_done_callback(on_done)
    return task


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host

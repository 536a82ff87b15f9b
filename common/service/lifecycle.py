"""The life of an engine service process (`pdserve prefill|decode`): load the engine,
serve gRPC with health and reflection, register with every gateway, print the READY line,
drain on SIGTERM/SIGINT, exit 0.

An engine that dies (a worker process of its executor died) turns health NOT_SERVING
and leaves every gateway; its requests fail with UNAVAILABLE; the process stays up,
saying so, until it is stopped.

Shutdown: health NOT_SERVING and new work refused (UNAVAILABLE "draining"), the
every gateway is told we left, in-flight requests get --grace-period seconds to finish,
the rest are failed cleanly (UNAVAILABLE), then the server stops.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Callable
from typing import Protocol

from grpc import aio

from common.engine.heap_retention import keep_freed_heap, share_main_arena
from common.engine.process_exit import skip_collection_at_exit
from common.service.errors import ErrorStatusInterceptor
from common.service.flags import advertise_host, bracket
from common.service.keepalive import KEEPALIVE_SERVER_OPTIONS
from common.service.logging_setup import configure_logging
from common.service.metrics import WorkerMetrics
from common.service.passing_thread import run_in_passing_thread
from common.service.registration import GatewayRegistrations
from common.service.request_gate import RequestGate
from protos.serving import add_health_and_reflection

logger = logging.getLogger(__name__)

READY_PREFIX = "PDSERVE_READY"


class Worker(Protocol):
    """One loaded worker (engine + sockets); built off the event loop by run_worker."""

    instance_id: str
    metrics: WorkerMetrics  # served on --metrics-port

    def add_to_server(self, server: aio.Server, gate: RequestGate) -> list[str]:
        """Add the servicers; return the service names for health and reflection."""

    def instance_spec(self, grpc_address: str):
        """common.service.registration.InstanceSpec to register."""

    def load(self):
        """common.service.registration.InstanceLoad for heartbeats."""

    def served_loras(self):
        """common.service.registration.ServedLoRAs for registrations and heartbeats."""

    def ready_fields(self) -> dict[str, str]:
        """Extra key=value pairs for the READY line (endpoints)."""

    async def fail_inflight(self) -> None:
        """Grace period over: end every unfinished request now."""

    def on_engine_dead(self, callback: Callable[[BaseException], None]) -> None:
        """callback(error) from any thread once the engine can no longer serve."""

    async def close(self) -> None:
        """Release the engine and sockets."""


def start_metrics(metrics, args: argparse.Namespace) -> str | None:
    """Serve `metrics` (common.service.metrics.ServiceMetrics) as the flags say; its address or None."""
    if args.metrics_port is None:
        return None
    host = args.metrics_host or args.host
    address = metrics.serve(host, args.metrics_port)
    logger.info("Prometheus metrics on http://%s/metrics", address)
    return address


def default_instance_id(role: str) -> str:
    """Unique even where hostnames and pids repeat (host-network containers all carry the
    host's name and run as pid 1), so no launcher has to make ids up."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def run_worker(args: argparse.Namespace, role: str, build: Callable[[argparse.Namespace, str], Worker]) -> int:
    args.instance_id = args.instance_id or default_instance_id(role)
    try:
        configure_logging(role, args.instance_id, args.log_level, args.log_format)
        # Before any other thread mallocs (the engine loads on one, steps on another): every
        # thread then shares the main arena, which keeps what it frees (common.engine.heap_retention).
        share_main_arena()
        keep_freed_heap()
        if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be 0 (a free port) to 65535; got {args.metrics_port}")
        return asyncio.run(_serve(args, role, build))
    except (ValueError, OSError) as e:  # bad flags found while building (e.g. KV pool too small), port taken
        print(f"pdserve {role}: error: {e}", file=sys.stderr)
        return 2
    finally:
        skip_collection_at_exit()  # the process exits next


async def _serve(args: argparse.Namespace, role: str, build: Callable[[argparse.Namespace, str], Worker]) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Loading the model takes seconds; a signal meanwhile still ends the process cleanly.
    worker = await run_in_passing_thread(build, args, args.instance_id)
    gate = RequestGate(f"{role} instance {args.instance_id}")
    server = aio.server(interceptors=[ErrorStatusInterceptor()],
                        options=[("grpc.so_reuseport", 0), *KEEPALIVE_SERVER_OPTIONS])
    exit_code = 0
    registry_task = None
    try:
        service_names = worker.add_to_server(server, gate)
        port = server.add_insecure_port(f"{bracket(args.host)}:{args.port}")
        if not port:
            raise ValueError(f"cannot bind gRPC to {args.host}:{args.port}")
        grpc_address = args.advertise_address or f"{bracket(advertise_host(args))}:{port}"
        health = await add_health_and_reflection(server, *service_names)  # SERVING: the model is loaded
        engine_dead = _watch_engine(worker, health, lambda: registry_task)
        metrics_address = start_metrics(worker.metrics, args)  # before serving: a taken port fails the start
        await server.start()
        if args.gateway:
            registry_task = _start_registration(args.gateway, args.registry_token, worker.instance_spec(grpc_address),
                                                worker, stop)
        ready_fields = dict(worker.ready_fields())
        if metrics_address:
            ready_fields["metrics"] = metrics_address
        fields = " ".join(f"{k}={v}" for k, v in ready_fields.items())
        print(f"{READY_PREFIX} role={role} instance_id={args.instance_id} grpc={bracket(args.host)}:{port} "
              f"advertise={grpc_address} {fields}".rstrip(), flush=True)
        logger.info("%s %s serving on %s:%d", role, args.instance_id, args.host, port)
        if not stop.is_set():
            await stop.wait()
        if (registry_task is not None and registry_task.done() and not registry_task.cancelled()
                and registry_task.exception()):  # cancelled: the engine died and we left the gateways
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
        engine_dead.cancel()
    finally:
        worker.metrics.close()
        await worker.close()
    logger.info("stopped")
    return exit_code


def _watch_engine(worker: Worker, health, registry_task: Callable[[], asyncio.Task | None]) -> asyncio.Task:
    """Once the engine died: health NOT_SERVING, and leave every gateway."""
    loop = asyncio.get_running_loop()
    died = asyncio.Event()

    def on_dead(error: BaseException) -> None:  # engine thread
        logger.error("the engine died (%s): health NOT_SERVING, requests fail with UNAVAILABLE", error)
        try:
            loop.call_soon_threadsafe(died.set)
        except RuntimeError:  # the event loop already closed: we are exiting anyway
            pass

    async def report() -> None:
        await died.wait()
        await health.enter_graceful_shutdown()
        task = registry_task()
        if task is not None:
            task.cancel()
    worker.on_engine_dead(on_dead)
    return loop.create_task(report())


def _start_registration(gateways: list[str], token: str | None, spec, worker: Worker,
                        stop: asyncio.Event) -> asyncio.Task:
    """Register with every gateway (each on its own, see GatewayRegistrations); a gateway
    that rejects this instance stops it."""
    registrations = GatewayRegistrations(gateways, spec, worker.load, token=token or None,
                                         get_loras=worker.served_loras)
    task = asyncio.get_running_loop().create_task(registrations.run())

    def on_done(t: asyncio.Task) -> None:
        if not t.cancelled() and t.exception() is not None:
            logger.error("gateway rejected this instance: %s", t.exception())
            stop.set()
    task.add_done_callback(on_done)
    return task

"""What prefill and decode instances run to stay known to the gateway (grpc.aio):
register, heartbeat their load, re-register when the gateway has forgotten them
(it restarted or declared them dead), and deregister on shutdown.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from gateway.routing.registry import InstanceLoad, InstanceSpec
from protos.pdserve.v1 import common_pb2, registry_pb2, registry_pb2_grpc

logger = logging.getLogger(__name__)

_ROLE_TO_PB = {"prefill": registry_pb2.ROLE_PREFILL, "decode": registry_pb2.ROLE_DECODE}


def register_request(spec: InstanceSpec) -> registry_pb2.RegisterRequest:
    return registry_pb2.RegisterRequest(
        instance_id=spec.instance_id, role=_ROLE_TO_PB[spec.role], grpc_address=spec.grpc_address,
        kv_endpoint=spec.kv_endpoint, kv_events_endpoint=spec.kv_events_endpoint,
        block_size=spec.block_size, num_total_blocks=spec.num_total_blocks,
        model_name=spec.model_name, max_model_len=spec.max_model_len)


def load_to_pb(load: InstanceLoad) -> common_pb2.InstanceLoad:
    return common_pb2.InstanceLoad(**vars(load))


class RegistryClient:
    """Keep one instance registered with the gateway: `await client.run()` as a task."""

    def __init__(self, gateway_address: str, spec: InstanceSpec, get_load: Callable[[], InstanceLoad],
                 retry_s: float = 1.0, rpc_timeout_s: float = 5.0):
        self.spec = spec
        self._get_load = get_load
        self._retry_s = retry_s
        self._timeout_s = rpc_timeout_s
        self._channel = grpc.aio.insecure_channel(gateway_address)
        self._stub = registry_pb2_grpc.RegistryServiceStub(self._channel)
        self.registered = asyncio.Event()

    async def run(self) -> None:
        """Register (retrying until the gateway answers), then heartbeat forever.
        Cancel to stop: the instance deregisters on the way out."""
        try:
            interval_s = await self._register()
            while True:
                await asyncio.sleep(interval_s)
                try:
                    response = await self._stub.Heartbeat(registry_pb2.HeartbeatRequest(
                        instance_id=self.spec.instance_id, load=load_to_pb(self._get_load())),
                        timeout=self._timeout_s)
                except grpc.aio.AioRpcError as e:  # gateway down: it forgets us; keep trying
                    logger.warning("heartbeat to gateway failed: %s", e.code().name)
                    continue
                if response.reregister:
                    self.registered.clear()
                    interval_s = await self._register()
        finally:
            await self._deregister()

    async def _register(self) -> float:
        while True:
            try:
                response = await self._stub.Register(register_request(self.spec), timeout=self._timeout_s)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise  # wrong model or block size: retrying cannot help
                logger.warning("registering with gateway failed (%s); retrying", e.code().name)
                await asyncio.sleep(self._retry_s)
                continue
            self.registered.set()
            return response.heartbeat_interval_ms / 1000 or self._retry_s

    async def _deregister(self) -> None:
        try:
            if self.registered.is_set():
                await self._stub.Deregister(registry_pb2.DeregisterRequest(
                    instance_id=self.spec.instance_id), timeout=self._timeout_s)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass  # the gateway will expire us instead
        finally:
            await self._channel.close()

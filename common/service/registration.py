"""The Registry API's one owner: the types an instance registers and heartbeats, their
protobuf mapping, and what prefill and decode instances run to stay known to the gateway
(grpc.aio): register, heartbeat their load, re-register when the gateway has forgotten
them (it restarted or declared them dead), and deregister on shutdown. The gateway's
RegistryServicer reads the same types.

Every call carries the deployment's registry token (`authorization: Bearer TOKEN`
metadata) when one is set, and Heartbeat/Deregister present the secret the gateway
issued at Register. The channel keeps itself alive (common.service.keepalive).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal

import grpc

from common.service.keepalive import KEEPALIVE_CHANNEL_OPTIONS
from protos.pdserve.v1 import common_pb2, registry_pb2, registry_pb2_grpc

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")

_ROLE_TO_PB = {"prefill": registry_pb2.ROLE_PREFILL, "decode": registry_pb2.ROLE_DECODE}
_ROLE_FROM_PB: dict[int, Role] = {pb: role for role, pb in _ROLE_TO_PB.items()}


@dataclass
class InstanceLoad:
    """What an instance reports in a heartbeat (mirrors pdserve.v1.InstanceLoad)."""

    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_queued_prefill_tokens: int = 0
    kv_events_sequence: int = 0

    @classmethod
    def from_pb(cls, msg: common_pb2.InstanceLoad) -> InstanceLoad:
        return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})

    def to_pb(self) -> common_pb2.InstanceLoad:
        return common_pb2.InstanceLoad(**vars(self))


@dataclass(frozen=True)
class InstanceSpec:
    """What an instance registers (mirrors pdserve.v1.RegisterRequest)."""

    instance_id: str
    role: Role
    grpc_address: str
    kv_endpoint: str = ""  # decode: where prefill instances push KV
    kv_events_endpoint: str = ""  # prefill: ZeroMQ PUB of KV cache events
    block_size: int = 16
    num_total_blocks: int = 0
    model_name: str = ""
    max_model_len: int = 0

    @classmethod
    def from_pb(cls, msg: registry_pb2.RegisterRequest) -> InstanceSpec:
        """An unknown role stays visible as "unspecified", so the registry can reject it by name."""
        values = {f.name: getattr(msg, f.name) for f in fields(cls) if f.name != "role"}
        return cls(role=_ROLE_FROM_PB.get(msg.role, "unspecified"), **values)

    def to_pb(self) -> registry_pb2.RegisterRequest:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "role"}
        return registry_pb2.RegisterRequest(role=_ROLE_TO_PB[self.role], **values)


class RegistryClient:
    """Keep one instance registered with the gateway: `await client.run()` as a task."""

    def __init__(self, gateway_address: str, spec: InstanceSpec, get_load: Callable[[], InstanceLoad],
                 retry_s: float = 1.0, rpc_timeout_s: float = 5.0, token: str | None = None):
        """gateway_address: the gateway's registry endpoint (its --registry-port, not the
        public one); token: the deployment's registry token, if it has one."""
        self.spec = spec
        self._get_load = get_load
        self._retry_s = retry_s
        self._timeout_s = rpc_timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._secret = ""  # issued by the gateway at Register
        self._channel = grpc.aio.insecure_channel(gateway_address, options=KEEPALIVE_CHANNEL_OPTIONS)
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
                        instance_id=self.spec.instance_id, load=self._get_load().to_pb(),
                        instance_secret=self._secret), timeout=self._timeout_s, metadata=self._metadata)
                except grpc.aio.AioRpcError as e:  # gateway down: it forgets us; keep trying
                    logger.warning("heartbeat to gateway failed: %s", e.code().name)
                    if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                        raise  # the gateway's token changed: retrying cannot help
                    continue
                if response.reregister:
                    self.registered.clear()
                    interval_s = await self._register()
        finally:
            await self._deregister()

    async def _register(self) -> float:
        while True:
            try:
                response = await self._stub.Register(self.spec.to_pb(), timeout=self._timeout_s,
                                                     metadata=self._metadata)
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED):
                    raise  # wrong model, block size or token: retrying cannot help
                # ALREADY_EXISTS (our id is still held by a dead predecessor at another
                # address) clears once that one expires, like a gateway that is down.
                logger.warning("registering with gateway failed (%s: %s); retrying", e.code().name, e.details())
                await asyncio.sleep(self._retry_s)
                continue
            self._secret = response.instance_secret
            self.registered.set()
            return response.heartbeat_interval_ms / 1000 or self._retry_s

    async def _deregister(self) -> None:
        try:
            if self.registered.is_set():
                await self._stub.Deregister(registry_pb2.DeregisterRequest(
                    instance_id=self.spec.instance_id, instance_secret=self._secret),
                    timeout=self._timeout_s, metadata=self._metadata)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass  # the gateway will expire us instead
        finally:
            await self._channel.close()

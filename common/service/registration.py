"""The Registry API's one owner: the types an instance registers and heartbeats, their
protobuf mapping, and what prefill and decode instances run to stay known to the gateways
(grpc.aio): register, heartbeat their load, re-register when a gateway has forgotten
them (it restarted or declared them dead), and deregister on shutdown. The gateway's
RegistryServicer reads the same types.

Several gateways may serve the same pools (gateway replicas): `GatewayRegistrations`
keeps one `RegistryClient` per gateway address, each on its own task with its own
channel and secret, so a gateway that is down or slow delays nobody's registration with
the others. Names in `--gateway` are resolved to every address they stand for (a
Kubernetes headless Service or a compose service name lists every gateway replica) and
re-resolved periodically, so a gateway pod that appears later gets this instance too.

Every call carries the deployment's registry token (`authorization: Bearer TOKEN`
metadata) when one is set, and Heartbeat/Deregister present the secret the gateway
issued at Register. The channel keeps itself alive (common.service.keepalive).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Literal

import grpc

from common.service.keepalive import KEEPALIVE_CHANNEL_OPTIONS
from protos.pdserve.v1 import common_pb2, registry_pb2, registry_pb2_grpc

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")

MAX_RECONNECT_BACKOFF_MS = 3_000

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
class ServedLoRAs:
    """The LoRA adapters an instance serves now, and the version of that list (bumped by each
    load or unload): a gateway keeps the report of the highest version it has seen. Those
    loaded at run time come with their paths, which any gateway gives to instances joining later."""

    names: tuple[str, ...] = ()
    version: int = 0
    runtime_paths: Mapping[str, str] = field(default_factory=dict)


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
    lora_names: tuple[str, ...] = ()  # the LoRA adapters it serves
    lora_enabled: bool = False  # it loads adapters at run time (LoRAAdapterService)
    lora_names_version: int = 0  # bumped by each load or unload
    # Of lora_names, those loaded at run time: name -> path on the instance's host.
    runtime_lora_paths: Mapping[str, str] = field(default_factory=dict)

    def with_loras(self, loras: ServedLoRAs) -> InstanceSpec:
        return replace(self, lora_names=loras.names, lora_names_version=loras.version,
                       runtime_lora_paths=dict(loras.runtime_paths))

    @classmethod
    def from_pb(cls, msg: registry_pb2.RegisterRequest) -> InstanceSpec:
        """An unknown role stays visible as "unspecified", so the registry can reject it by name."""
        values = {f.name: getattr(msg, f.name) for f in fields(cls) if f.name != "role"}
        values["lora_names"] = tuple(msg.lora_names)
        values["runtime_lora_paths"] = dict(msg.runtime_lora_paths)
        return cls(role=_ROLE_FROM_PB.get(msg.role, "unspecified"), **values)

    def to_pb(self) -> registry_pb2.RegisterRequest:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "role"}
        return registry_pb2.RegisterRequest(role=_ROLE_TO_PB[self.role], **values)


class RegistryClient:
    """Keep one instance registered with the gateway: `await client.run()` as a task."""

    def __init__(self, gateway_address: str, spec: InstanceSpec, get_load: Callable[[], InstanceLoad],
                 retry_s: float = 1.0, rpc_timeout_s: float = 5.0, token: str | None = None,
                 get_loras: Callable[[], ServedLoRAs] | None = None):
        """gateway_address: the gateway's registry endpoint (its --registry-port, not the
        public one); token: the deployment's registry token, if it has one; get_loras: the
        adapters served now, where they change at run time (else spec.lora_names)."""
        self.spec = spec
        self._get_load = get_load
        self._get_loras = get_loras or (lambda: ServedLoRAs(spec.lora_names, spec.lora_names_version,
                                                            spec.runtime_lora_paths))
        self._retry_s = retry_s
        self._timeout_s = rpc_timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._secret = ""  # issued by the gateway at Register
        self._channel = grpc.aio.insecure_channel(gateway_address, options=[
            *KEEPALIVE_CHANNEL_OPTIONS,
            # gRPC's default backoff grows to 2 minutes while a gateway is down; capped, a
            # gateway that restarts has this instance again within seconds of serving.
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)])
        self._stub = registry_pb2_grpc.RegistryServiceStub(self._channel)
        self.registered = asyncio.Event()

    async def run(self) -> None:
        """Register (retrying until the gateway answers), then heartbeat forever.
        Cancel to stop: the instance deregisters on the way out."""
        try:
            interval_s = await self._register()
            while True:
                await asyncio.sleep(interval_s)
                loras = self._get_loras()
                try:
                    response = await self._stub.Heartbeat(registry_pb2.HeartbeatRequest(
                        instance_id=self.spec.instance_id, load=self._get_load().to_pb(),
                        instance_secret=self._secret, lora_names=loras.names,
                        lora_names_version=loras.version, runtime_lora_paths=loras.runtime_paths),
                        timeout=self._timeout_s, metadata=self._metadata)
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
                response = await self._register_once()
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

    async def _register_once(self) -> registry_pb2.RegisterResponse:
        """One Register call that outlives a cancel: once sent, the gateway may hold this
        instance under a secret that only the reply names, and without it the instance
        could not deregister on the way out and would linger until its heartbeats expire."""
        self.spec = self.spec.with_loras(self._get_loras())
        call = asyncio.ensure_future(self._stub.Register(
            self.spec.to_pb(), timeout=self._timeout_s, metadata=self._metadata))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            try:
                response = await call  # bounded by the call's own timeout
            except grpc.aio.AioRpcError:
                raise asyncio.CancelledError from None
            self._secret = response.instance_secret
            self.registered.set()
            raise

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


# ---- several gateways -----------------------------------------------------------------

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> IP addresses


async def resolve_host(host: str, port: int) -> list[str]:
    """Every address `host` has, of one family: IPv4 when it has any, else IPv6. One family
    because a dual-stack name lists each gateway twice (A and AAAA), and registering twice
    with one gateway under one id would make the two registrations replace each other."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    by_family: dict[int, list[str]] = {}
    for family, _, _, _, sockaddr in infos:
        addresses = by_family.setdefault(family, [])
        if sockaddr[0] not in addresses:
            addresses.append(sockaddr[0])
    return by_family.get(socket.AF_INET) or by_family.get(socket.AF_INET6) or []


def _split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _dial_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class GatewayRegistrations:
    """Keep one instance registered with every gateway that `gateway_addresses` name:
    `await registrations.run()` as a task; cancel it to deregister from all of them.

    An IP address names one gateway; a hostname names every address it resolves to,
    looked up again every `resolve_interval_s`: a new address gets a RegistryClient of
    its own, an address the name no longer lists has its client stopped (it deregisters
    if the gateway still answers). A failed lookup keeps the addresses last found, so a
    DNS hiccup does not drop registrations. `run` raises if any gateway rejects the
    instance (wrong model, block size or token), which no retry can fix."""

    def __init__(self, gateway_addresses: Sequence[str], spec: InstanceSpec, get_load: Callable[[], InstanceLoad],
                 token: str | None = None, resolve_interval_s: float = 10.0, resolve: Resolver = resolve_host,
                 retry_s: float = 1.0, rpc_timeout_s: float = 5.0, get_loras: Callable[[], ServedLoRAs] | None = None):
        if not gateway_addresses:
            raise ValueError("GatewayRegistrations needs at least one gateway address")
        self.spec = spec
        self._names = [_split_host_port(a) for a in gateway_addresses]
        self._get_load = get_load
        self._get_loras = get_loras
        self._token = token
        self._resolve_interval_s = resolve_interval_s
        self._resolve = resolve
        self._retry_s, self._rpc_timeout_s = retry_s, rpc_timeout_s
        self._resolved: dict[tuple[str, int], list[str]] = {}  # name -> dial addresses last found
        self.clients: dict[str, RegistryClient] = {}  # by dial address ("10.0.0.7:50054")
        self._tasks: dict[str, asyncio.Task] = {}
        self._leaving: set[asyncio.Task] = set()  # clients of unlisted gateways, deregistering

    async def run(self) -> None:
        try:
            while True:
                self._follow(await self._current_addresses())
                await self._wait_for_rejection(self._resolve_interval_s)
        finally:
            tasks = [*self._tasks.values(), *self._leaving]
            for task in tasks:
                task.cancel()  # each client deregisters on its way out
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _current_addresses(self) -> list[str]:
        addresses: list[str] = []
        for host, port in self._names:
            if _is_ip_literal(host):
                found = [_dial_address(host, port)]
            else:
                try:
                    found = [_dial_address(ip, port) for ip in await self._resolve(host, port)]
                except OSError as e:  # socket.gaierror included: keep what the last lookup found
                    logger.warning("resolving gateway %s failed (%s); keeping %s", host, e,
                                   self._resolved.get((host, port), []))
                    found = self._resolved.get((host, port), [])
                self._resolved[(host, port)] = found
            addresses += [a for a in found if a not in addresses]
        return addresses

    def _follow(self, addresses: list[str]) -> None:
        for gone in [a for a in self._tasks if a not in addresses]:
            logger.info("gateway %s is no longer listed: leaving it", gone)
            task = self._tasks.pop(gone)
            task.cancel()
            self._leaving.add(task)
            task.add_done_callback(self._leaving.discard)
            self.clients.pop(gone)
        for address in addresses:
            if address not in self._tasks:
                logger.info("registering with gateway %s", address)
                client = RegistryClient(address, self.spec, self._get_load, retry_s=self._retry_s,
                                        rpc_timeout_s=self._rpc_timeout_s, token=self._token,
                                        get_loras=self._get_loras)
                self.clients[address] = client
                self._tasks[address] = asyncio.get_running_loop().create_task(client.run())

    async def _wait_for_rejection(self, timeout_s: float) -> None:
        """Sleep `timeout_s`, returning early only to raise a client's rejection."""
        if not self._tasks:
            await asyncio.sleep(timeout_s)
            return
        done, _ = await asyncio.wait(self._tasks.values(), timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()

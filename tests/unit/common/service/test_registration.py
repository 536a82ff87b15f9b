"""Registering with several gateways (gateway replicas): the --gateway list, name
resolution, and one independent RegistryClient per gateway against real RegistryServicers
on loopback (127.0.0.1 and 127.0.0.2 stand for two gateway pods behind one name)."""
from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from common.service.errors import ErrorStatusInterceptor
from common.service.registration import GatewayRegistrations, InstanceLoad, InstanceSpec, resolve_host
from decode_service.main import build_parser as decode_parser
from gateway.routing.registry import InstanceRegistry, RegistryServicer
from protos.pdserve.v1 import registry_pb2_grpc

TOKEN = "test-token"
LOAD = InstanceLoad(num_running_requests=2, num_free_blocks=5, num_total_blocks=9)
SPEC = InstanceSpec("decode-0", "decode", "127.0.0.1:7000", block_size=16, num_total_blocks=9)


class FakeGateway:
    """A gateway's registry alone: InstanceRegistry behind RegistryServicer, as GatewayServer serves it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str = TOKEN):
        self.registry = InstanceRegistry(heartbeat_interval_s=0.02, heartbeat_timeout_s=5.0)
        self.host, self.port, self.token = host, port, token
        self.server: grpc.aio.Server | None = None

    async def start(self) -> FakeGateway:
        self.registry = InstanceRegistry(heartbeat_interval_s=0.02, heartbeat_timeout_s=5.0)  # restarted: empty
        self.server = grpc.aio.server(interceptors=[ErrorStatusInterceptor()])
        registry_pb2_grpc.add_RegistryServiceServicer_to_server(RegistryServicer(self.registry, self.token),
                                                                self.server)
        self.port = self.server.add_insecure_port(f"{self.host}:{self.port}")
        assert self.port
        await self.server.start()
        return self

    async def stop(self) -> None:
        await self.server.stop(None)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def heartbeats_seen(self) -> float:
        instance = self.registry.get(SPEC.instance_id)
        return instance.last_heartbeat if instance else -1.0


async def until(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"{what} not reached in {timeout_s}s"
        await asyncio.sleep(0.01)


async def stop_task(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def registered(gateway: FakeGateway) -> bool:
    instance = gateway.registry.get(SPEC.instance_id)
    return instance is not None and instance.load == LOAD


def test_gateway_flag_takes_repeats_and_comma_lists(monkeypatch):
    assert decode_parser().parse_args([]).gateway == []
    args = decode_parser().parse_args(["--gateway", "a:1", "--gateway", "b:2, c:3,a:1", "--gateway", "[::1]:4"])
    assert args.gateway == ["a:1", "b:2", "c:3", "[::1]:4"]
    monkeypatch.setenv("PDSERVE_GATEWAY", "gateway:50054,other:50054")
    assert decode_parser().parse_args([]).gateway == ["gateway:50054", "other:50054"]
    assert decode_parser().parse_args(["--gateway", "x:1"]).gateway == ["x:1"]  # the flag replaces the env
    for bad in ("no-port", "host:", "host:99999", ":50054"):
        with pytest.raises(SystemExit):
            decode_parser().parse_args(["--gateway", bad])


def test_a_name_resolves_to_one_address_family():
    addresses = asyncio.run(resolve_host("localhost", 50054))
    assert "127.0.0.1" in addresses and "::1" not in addresses


def test_every_gateway_gets_its_own_registration_and_secret_and_one_down_blocks_none():
    async def scenario():
        first, second = await FakeGateway().start(), await FakeGateway().start()
        with socket.socket() as s:  # a gateway that is not there at all: nothing listens
            s.bind(("127.0.0.1", 0))
            absent = f"127.0.0.1:{s.getsockname()[1]}"
        registrations = GatewayRegistrations([absent, first.address, second.address], SPEC, lambda: LOAD,
                                             token=TOKEN, retry_s=0.05)
        task = asyncio.create_task(registrations.run())
        try:
            await until(lambda: registered(first) and registered(second)
                        and all(registrations.clients[g.address].registered.is_set() for g in (first, second)),
                        what="both registrations")
            secrets = {g.registry.get(SPEC.instance_id).secret for g in (first, second)}
            assert len(secrets) == 2  # each gateway issued its own
            assert not registrations.clients[absent].registered.is_set()

            # One gateway dies: the other keeps receiving heartbeats.
            await first.stop()
            beat = second.heartbeats_seen()
            await until(lambda: second.heartbeats_seen() > beat + 0.1, what="heartbeats to the survivor")

            # It restarts at the same address with an empty registry: the instance re-registers.
            await first.start()
            await until(lambda: registered(first) and registrations.clients[first.address].registered.is_set(),
                        what="re-registration with the restarted gateway")
        finally:
            await stop_task(task)
        # Stopping deregisters from every gateway that is up.
        assert first.registry.get(SPEC.instance_id) is None and second.registry.get(SPEC.instance_id) is None
        await first.stop()
        await second.stop()
    asyncio.run(scenario())


def test_a_name_is_re_resolved_so_new_gateways_get_registrations_and_gone_ones_are_left():
    async def scenario():
        first = await FakeGateway("127.0.0.1").start()
        second = FakeGateway("127.0.0.2", port=first.port)  # another pod: same port, its own address
        await second.start()
        listed: list[str] | OSError = ["127.0.0.1"]
        lookups = []

        async def resolve(host, port):
            lookups.append((host, port))
            if isinstance(listed, OSError):
                raise listed
            return list(listed)

        registrations = GatewayRegistrations([f"gateways.example:{first.port}"], SPEC, lambda: LOAD, token=TOKEN,
                                             resolve_interval_s=0.05, resolve=resolve, retry_s=0.05)
        task = asyncio.create_task(registrations.run())
        try:
            await until(lambda: registered(first), what="registration with the one listed gateway")
            assert second.registry.get(SPEC.instance_id) is None
            assert lookups[0] == ("gateways.example", first.port)

            listed = ["127.0.0.1", "127.0.0.2"]  # a second gateway pod appears behind the name
            await until(lambda: registered(second), what="registration with the new gateway")

            listed = OSError("DNS down")  # a failed lookup keeps both
            seen = len(lookups)
            await until(lambda: len(lookups) > seen + 2, what="lookups while DNS fails")
            assert set(registrations.clients) == {first.address, second.address}
            assert registered(first) and registered(second)

            listed = ["127.0.0.2"]  # the first pod is gone from the name: the instance leaves it
            await until(lambda: first.registry.get(SPEC.instance_id) is None, what="leaving the unlisted gateway")
            assert set(registrations.clients) == {second.address} and registered(second)
        finally:
            await stop_task(task)
        await first.stop()
        await second.stop()
    asyncio.run(scenario())


def test_a_gateway_that_rejects_the_instance_ends_the_registrations():
    async def scenario():
        good = await FakeGateway("127.0.0.1").start()
        wrong_token = await FakeGateway("127.0.0.2", port=good.port, token="another-deployment").start()
        listed = ["127.0.0.1"]

        async def resolve(host, port):
            return list(listed)

        registrations = GatewayRegistrations([f"gateways.example:{good.port}"], SPEC, lambda: LOAD, token=TOKEN,
                                             resolve_interval_s=0.05, resolve=resolve, retry_s=0.05)
        task = asyncio.create_task(registrations.run())
        await until(lambda: registered(good), what="registration with the good gateway")
        listed = ["127.0.0.1", "127.0.0.2"]  # then one of another deployment appears
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await asyncio.wait_for(task, timeout=10)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert good.registry.get(SPEC.instance_id) is None  # it left the gateway that took it, too
        await good.stop()
        await wrong_token.stop()
    asyncio.run(scenario())

"""InstanceRegistry: registration, heartbeats, expiry; and the Register/Heartbeat/
Deregister RPCs end to end over loopback. Load between heartbeats: test_load_ledger."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from common.service.errors import ErrorStatusInterceptor, ServiceError
from common.service.registration import InstanceLoad, InstanceSpec, RegistryClient, ServedLoRAs
from gateway.routing.registry import InstanceRegistry, RegistrationError, RegistryServicer
from protos.pdserve.v1 import registry_pb2, registry_pb2_grpc


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def spec(instance_id, role="prefill", **kw):
    return InstanceSpec(instance_id, role, f"10.0.0.1:{len(instance_id)}", num_total_blocks=100, **kw)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def registry(clock):
    return InstanceRegistry(heartbeat_interval_s=1.0, heartbeat_timeout_s=3.0, clock=clock)


def test_instances_are_placeable_at_once_and_listed_by_role(registry):
    registry.register(spec("p1"))
    registry.register(spec("d0", "decode"))
    registry.register(spec("p0"))
    assert [i.instance_id for i in registry.instances("prefill")] == ["p0", "p1"]
    assert [i.instance_id for i in registry.instances("decode")] == ["d0"]
    assert registry.get("d0").free_blocks == 100  # full pool until the first heartbeat


def test_a_heartbeat_replaces_the_load_estimate(registry):
    registry.register(spec("p0"))
    p0 = registry.get("p0")
    load = InstanceLoad(num_running_requests=1, num_waiting_requests=1, num_free_blocks=60,
                        num_total_blocks=100, num_queued_prefill_tokens=700)
    assert registry.heartbeat("p0", load)
    assert p0.load == load and p0.load is not load  # a copy: the caller may reuse its object
    assert (p0.num_requests, p0.queued_prefill_tokens, p0.free_blocks) == (2, 700, 60)


def test_heartbeat_gaps_are_measured_and_late_ones_logged(registry, clock, caplog):
    gaps = []
    registry.subscribe(on_heartbeat=lambda inst, _reason: gaps.append(inst.last_heartbeat_gap_s))
    registry.register(spec("p0"))
    assert registry.get("p0").last_heartbeat_gap_s is None
    clock.now += 1.0
    registry.heartbeat("p0", InstanceLoad())
    clock.now += 2.5  # 2.5 intervals: late, though inside the 3 s timeout
    with caplog.at_level("WARNING", logger="gateway.routing.registry"):
        registry.heartbeat("p0", InstanceLoad())
    assert gaps == [1.0, 2.5]
    assert [r.getMessage() for r in caplog.records] == [
        "late heartbeat from prefill p0: 2.50s since the previous one (interval 1.00s, timeout 3.00s)"]


def test_unknown_heartbeat_asks_to_reregister(registry):
    assert registry.heartbeat("ghost", InstanceLoad()) is False


def test_silent_instances_are_hidden_then_dropped_and_reported(registry, clock):
    removed = []
    registry.subscribe(on_removed=lambda inst, reason: removed.append((inst.instance_id, reason)))
    registry.register(spec("p0"))
    registry.register(spec("p1"))
    clock.now += 2.0
    registry.heartbeat("p1", InstanceLoad())
    clock.now += 2.0  # p0 silent for 4 s > 3 s timeout; p1 for 2 s
    assert [i.instance_id for i in registry.instances("prefill")] == ["p1"]
    assert [i.instance_id for i in registry.expire()] == ["p0"]
    assert removed == [("p0", "expired")]
    assert registry.get("p0") is None and registry.heartbeat("p0", InstanceLoad()) is False


def test_reregistration_replaces_and_deregistration_removes(registry):
    events = []
    registry.subscribe(on_added=lambda i, r: events.append(("+", i.instance_id, r)),
                       on_removed=lambda i, r: events.append(("-", i.instance_id, r)))
    first = registry.register(spec("p0"))
    registry.register(spec("p0"))  # restarted
    assert registry.get("p0") is not first
    assert registry.deregister("p0") and not registry.deregister("p0")
    assert events == [("+", "p0", "registered"), ("-", "p0", "replaced"), ("+", "p0", "registered"),
                      ("-", "p0", "deregistered")]


def test_a_failing_listener_does_not_break_the_registry(registry):
    registry.subscribe(on_added=lambda i, r: 1 / 0)
    registry.register(spec("p0"))
    assert registry.get("p0") is not None


@pytest.mark.parametrize("bad", [
    InstanceSpec("", "prefill", "a:1"), InstanceSpec("x", "both", "a:1"), InstanceSpec("x", "decode", ""),
    InstanceSpec("x", "decode", "a:1", block_size=0)])
def test_malformed_registrations_are_rejected(registry, bad):
    with pytest.raises(RegistrationError):
        registry.register(bad)


def test_instances_must_agree_on_block_size_and_model(registry):
    registry.register(spec("p0", block_size=16, model_name="m"))
    with pytest.raises(RegistrationError, match="block_size"):
        registry.register(spec("p1", block_size=32, model_name="m"))
    with pytest.raises(RegistrationError, match="model_name"):
        registry.register(spec("p1", block_size=16, model_name="other"))


def test_registrations_above_the_gateways_max_model_len_are_refused(clock):
    registry = InstanceRegistry(clock=clock, max_model_len=4096)
    registry.register(spec("d0", "decode", max_model_len=4096))
    with pytest.raises(RegistrationError, match="max_model_len"):
        registry.register(spec("d1", "decode", max_model_len=4097))


def test_a_live_id_is_replaced_only_from_its_own_address_and_needs_its_secret(registry):
    first = registry.register(spec("p0"))
    with pytest.raises(ServiceError) as error:
        registry.register(InstanceSpec("p0", "prefill", "10.0.0.9:1"))
    assert error.value.code == grpc.StatusCode.ALREADY_EXISTS
    registry.check_secret("p0", first.secret)
    registry.check_secret("unknown", "")  # nothing to protect: a heartbeat asks it to re-register
    with pytest.raises(ServiceError) as error:
        registry.check_secret("p0", "guess")
    assert error.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert registry.register(spec("p0")).secret != first.secret  # a restart gets a new one


def test_run_expiry_drops_dead_instances(clock):
    async def scenario():
        registry = InstanceRegistry(heartbeat_timeout_s=3.0, clock=clock)
        registry.register(spec("p0"))
        clock.now += 10
        task = asyncio.create_task(registry.run_expiry(interval_s=0.01))
        await asyncio.sleep(0.05)
        task.cancel()
        return registry.get("p0")
    assert asyncio.run(scenario()) is None


async def _serve(registry):
    server = grpc.aio.server(interceptors=[ErrorStatusInterceptor()])  # as GatewayServer builds it
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(RegistryServicer(registry), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _until(predicate, timeout_s=5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_registry_client_registers_heartbeats_reregisters_and_leaves():
    async def scenario():
        registry = InstanceRegistry(heartbeat_interval_s=0.02, heartbeat_timeout_s=5.0)
        server, address = await _serve(registry)
        load = InstanceLoad(num_running_requests=3, num_free_blocks=7, kv_events_sequence=42)
        client = RegistryClient(address, spec("d0", "decode", kv_endpoint="tcp://10.0.0.1:5601"),
                                get_load=lambda: load)
        task = asyncio.create_task(client.run())
        try:
            await _until(lambda: registry.get("d0") is not None and registry.get("d0").load == load)
            assert registry.get("d0").spec.kv_endpoint == "tcp://10.0.0.1:5601"
            registry.deregister("d0")  # as if the gateway restarted: next heartbeat re-registers
            await _until(lambda: registry.get("d0") is not None and client.registered.is_set())
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert registry.get("d0") is None  # deregistered on the way out
        finally:
            task.cancel()
            await server.stop(None)
    asyncio.run(scenario())


class _HeldRegisterServicer(RegistryServicer):
    """Registers, then holds the reply until the test releases it."""

    def __init__(self, registry):
        super().__init__(registry)
        self.release = asyncio.Event()

    async def Register(self, request, context):
        response = await super().Register(request, context)
        await self.release.wait()
        return response


def test_registry_client_cancelled_while_its_register_is_in_flight_still_deregisters():
    """The gateway holds the instance as soon as Register runs; the secret to deregister
    comes only with the reply, so a client cancelled before the reply waits for it."""
    async def scenario():
        registry = InstanceRegistry(heartbeat_interval_s=0.02, heartbeat_timeout_s=5.0)
        server = grpc.aio.server(interceptors=[ErrorStatusInterceptor()])
        servicer = _HeldRegisterServicer(registry)
        registry_pb2_grpc.add_RegistryServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = RegistryClient(f"127.0.0.1:{port}", spec("d0", "decode"), get_load=InstanceLoad)
        task = asyncio.create_task(client.run())
        try:
            await _until(lambda: registry.get("d0") is not None)
            assert not client.registered.is_set()  # the reply is held
            task.cancel()
            await asyncio.sleep(0)  # let the cancel land before the reply does
            servicer.release.set()
            await asyncio.gather(task, return_exceptions=True)
            assert task.cancelled()
            assert registry.get("d0") is None
        finally:
            servicer.release.set()
            task.cancel()
            await server.stop(None)
    asyncio.run(scenario())


def test_register_rpc_rejects_mismatched_instances_with_invalid_argument():
    async def scenario():
        registry = InstanceRegistry(block_size=16)
        server, address = await _serve(registry)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)
            reply = await stub.Register(spec("p0").to_pb())
            assert reply.heartbeat_interval_ms == 1000
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Register(spec("p1", block_size=32).to_pb())
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Register(registry_pb2.RegisterRequest(instance_id="x", grpc_address="a:1"))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # ROLE_UNSPECIFIED
            beat = await stub.Heartbeat(registry_pb2.HeartbeatRequest(instance_id="nobody"))
            assert beat.reregister
        await server.stop(None)
    asyncio.run(scenario())


def test_lora_names_are_kept_only_from_a_newer_report(registry):
    registry.register(spec("d0", "decode", lora_names=("sea",), lora_names_version=1, lora_enabled=True))
    registry.update_loras("d0", ServedLoRAs(("sea", "lake"), 2))  # a load's answer
    assert registry.lora_names() == ["lake", "sea"]
    assert registry.heartbeat("d0", InstanceLoad(), ServedLoRAs(("sea",), 1))  # sent before the load
    assert registry.get("d0").spec.lora_names == ("sea", "lake")
    assert registry.heartbeat("d0", InstanceLoad(), ServedLoRAs(("lake",), 3))  # sea unloaded meanwhile
    assert registry.lora_names() == ["lake"] and registry.get("d0").spec.lora_enabled


def test_registry_client_reports_the_adapters_served_now():
    async def scenario():
        registry = InstanceRegistry(heartbeat_interval_s=0.02, heartbeat_timeout_s=5.0)
        server, address = await _serve(registry)
        served = ServedLoRAs(("sea",), 1)
        client = RegistryClient(address, spec("d0", "decode", lora_enabled=True), get_load=InstanceLoad,
                                get_loras=lambda: served)
        task = asyncio.create_task(client.run())
        try:
            await _until(lambda: registry.get("d0") is not None)
            assert registry.get("d0").spec.lora_names == ("sea",)  # registered with them
            served = ServedLoRAs(("sea", "lake"), 2, {"lake": "/adapters/lake"})  # lake loaded at run time
            await _until(lambda: registry.get("d0").spec.lora_names == ("sea", "lake"))  # a heartbeat
            assert registry.get("d0").spec.runtime_lora_paths == {"lake": "/adapters/lake"}
            registry.deregister("d0")  # as if the gateway restarted: it learns them again
            await _until(lambda: registry.get("d0") is not None)
            assert registry.get("d0").spec.lora_names_version == 2
            assert registry.get("d0").spec.runtime_lora_paths == {"lake": "/adapters/lake"}
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(None)
    asyncio.run(scenario())

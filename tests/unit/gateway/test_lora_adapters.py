"""The gateway's run-time LoRA changes (gateway.lora_adapters) over real gRPC to instances
that answer LoRAAdapterService as an instance does (a name set and a version; one can be
told to refuse a path): every LoRA instance is changed, a refused new load is undone on
the others, an unload skips none, and an instance registering later is caught up with the
adapters the others report as loaded at run time, by any gateway."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from common.service.errors import ErrorStatusInterceptor, ServiceError
from common.service.registration import InstanceSpec, ServedLoRAs
from gateway.lora_adapters import LoRAAdapters
from gateway.routing.registry import InstanceRegistry
from protos.pdserve.v1 import lora_adapters_pb2, lora_adapters_pb2_grpc


class Instance(lora_adapters_pb2_grpc.LoRAAdapterServiceServicer):
    def __init__(self, refused_paths=()):
        self.paths: dict[str, str] = {}
        self.version = 0
        self.refused_paths = set(refused_paths)

    async def LoadLoRAAdapter(self, request, context):
        if request.lora_path in self.refused_paths:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"{request.lora_path}: no adapter_config.json")
        if request.lora_name in self.paths and not request.load_inplace:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, "already loaded")
        self.paths[request.lora_name] = request.lora_path
        return self._answer()

    async def UnloadLoRAAdapter(self, request, context):
        if self.paths.pop(request.lora_name, None) is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, "not served")
        return self._answer()

    def _answer(self):
        self.version += 1
        return lora_adapters_pb2.LoRAAdaptersResponse(lora_names=list(self.paths), lora_names_version=self.version,
                                                      runtime_lora_paths=self.paths)


async def serve(instance: Instance) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=[ErrorStatusInterceptor()])
    lora_adapters_pb2_grpc.add_LoRAAdapterServiceServicer_to_server(instance, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def run(scenario):
    async def main():
        registry = InstanceRegistry()
        instances = {"p0": Instance(), "d0": Instance(refused_paths={"/only-p0"}), "d1": Instance()}
        servers, addresses = {}, {}
        for instance_id, instance in instances.items():
            servers[instance_id], addresses[instance_id] = await serve(instance)
            role = "prefill" if instance_id.startswith("p") else "decode"
            if instance_id != "d1":  # d1 joins later
                registry.register(InstanceSpec(instance_id, role, addresses[instance_id], lora_enabled=True))
        adapters = LoRAAdapters(registry, lambda: frozenset({"base"}))
        try:
            await scenario(registry, adapters, instances, addresses)
        finally:
            await adapters.close()
            for server in servers.values():
                await server.stop(None)
    asyncio.run(main())


def test_a_load_reaches_every_lora_instance_and_a_refused_one_is_undone():
    async def scenario(registry, adapters, instances, addresses):
        await adapters.load("sea", "/sea")
        assert instances["p0"].paths == instances["d0"].paths == {"sea": "/sea"}
        assert registry.lora_names() == ["sea"]
        with pytest.raises(ServiceError) as error:
            await adapters.load("lake", "/only-p0")  # d0 refuses: p0's load is undone
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and error.value.message.startswith("d0: ")
        assert instances["p0"].paths == {"sea": "/sea"} and registry.lora_names() == ["sea"]
        for name, path, code in (("sea", "/other", grpc.StatusCode.ALREADY_EXISTS),
                                 ("base", "/p", grpc.StatusCode.INVALID_ARGUMENT),
                                 ("", "/p", grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(ServiceError) as error:
                await adapters.load(name, path)
            assert error.value.code == code, name
        await adapters.load("sea", "/sea2", load_inplace=True)
        assert instances["p0"].paths == instances["d0"].paths == {"sea": "/sea2"}
    run(scenario)


def test_an_unload_reaches_every_instance_serving_it():
    async def scenario(registry, adapters, instances, addresses):
        await adapters.load("sea", "/sea")
        instances["d0"].paths.clear()  # as if d0 restarted without it, before its heartbeat says so
        await adapters.unload("sea")  # d0's NOT_FOUND is what was asked
        assert instances["p0"].paths == {} and registry.lora_names() == ["sea"]  # d0 still listed it
        with pytest.raises(ServiceError) as error:
            await adapters.unload("lake")
        assert error.value.code == grpc.StatusCode.NOT_FOUND
    run(scenario)


async def wait_for_lora(registry, instance_id: str, lora_name: str) -> None:
    deadline = asyncio.get_running_loop().time() + 5
    while lora_name not in registry.get(instance_id).spec.lora_names:
        assert asyncio.get_running_loop().time() < deadline, f"{instance_id} was not given {lora_name}"
        await asyncio.sleep(0.01)


def test_an_instance_registering_later_gets_the_adapters_loaded_here():
    async def scenario(registry, adapters, instances, addresses):
        await adapters.load("sea", "/sea")
        await adapters.load("lake", "/lake")
        await adapters.unload("lake")  # gone before d1 joins: not given to it
        registry.register(InstanceSpec("d1", "decode", addresses["d1"], lora_enabled=True))
        await wait_for_lora(registry, "d1", "sea")
        assert instances["d1"].paths == {"sea": "/sea"}
        without_lora = Instance()
        server, address = await serve(without_lora)
        try:
            registry.register(InstanceSpec("p1", "prefill", address))  # runs without LoRA: left alone
            assert not adapters._catching_up and without_lora.paths == {}
        finally:
            await server.stop(None)
    run(scenario)


def test_a_gateway_that_made_no_load_gives_a_joining_instance_what_the_others_loaded_at_run_time():
    """A restarted gateway, or a replica: it learns the run-time adapters from the instances'
    registrations (and heartbeats), not from a load of its own."""
    async def scenario(registry, adapters, instances, addresses):
        instances["p0"].paths["sea"] = "/sea"  # loaded at run time through some other gateway
        registry.update_loras("p0", ServedLoRAs(("own", "sea"), 1, {"sea": "/sea"}))  # own: its --lora-modules
        registry.update_loras("d0", ServedLoRAs(("sea",), 1, {"sea": "/sea-d0"}))
        registry.register(InstanceSpec("d1", "decode", addresses["d1"], lora_enabled=True))
        await wait_for_lora(registry, "d1", "sea")
        assert instances["d1"].paths == {"sea": "/sea"}  # the first reporter's path; no "own"
        assert registry.get("d1").spec.runtime_lora_paths == {"sea": "/sea"}  # and d1 reports it on
        await adapters.unload("sea")
        assert instances["d1"].paths == {} and registry.get("d1").spec.runtime_lora_paths == {}
    run(scenario)

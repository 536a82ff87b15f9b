"""LoRA adapters loaded and unloaded while the deployment serves: vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter for a pool of instances.

A change goes to every live instance that runs with LoRA (--enable-lora), prefill and
decode alike, since a request's prefill and its decode instance must both hold its
adapter. A new load that fails on any instance is undone on the others and fails with the
instance's reason; an in-place reload that fails part-way says which instances took it.
The registry learns each instance's names from its answer (and from its heartbeats after,
which is how other gateways of the deployment learn them). An instance that registers
later, a pool scaled up or an instance restarted, is given the adapters that live instances
report as loaded at run time (with their paths) and it lacks: so any gateway catches it up,
also one that restarted or never made the load. Adapters an instance was started with
(--lora-modules) are its own configuration and are not given to others.

Changes run one at a time (one lock), so a scale-up's catch-up load cannot race an unload.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from common.service.errors import ServiceError, invalid
from common.service.lora_adapter_client import LoRAAdapterClient
from common.service.registration import ROLES, ServedLoRAs
from gateway.routing.instance_channels import InstanceChannels
from gateway.routing.registry import Instance, InstanceRegistry

logger = logging.getLogger(__name__)

# Reading an adapter's files and stacking its weights: well under a second for ranks up to
# 64 on the bundled model, far longer on a busy engine thread of a large model.
RPC_TIMEOUT_S = 120.0


class LoRAAdapters:
    def __init__(self, registry: InstanceRegistry, base_model_names: Callable[[], frozenset[str]]):
        self.registry = registry
        self._base_model_names = base_model_names
        self._channels: InstanceChannels[LoRAAdapterClient] = InstanceChannels(registry, LoRAAdapterClient, ROLES)
        self._changing = asyncio.Lock()
        self._catching_up: set[asyncio.Task] = set()
        registry.subscribe(on_added=self._on_added)

    async def load(self, lora_name: str, lora_path: str, load_inplace: bool = False) -> None:
        """INVALID_ARGUMENT: no name or path, or a base model's name; FAILED_PRECONDITION: no
        live instance runs with LoRA; ALREADY_EXISTS: served already and not load_inplace;
        else an instance's refusal, named."""
        if not lora_name or not lora_path:
            raise invalid("both lora_name and lora_path must be given")
        if lora_name in self._base_model_names():
            raise invalid(f"LoRA adapter name {lora_name!r} is the served base model's")
        async with self._changing:
            instances = self._lora_instances()
            if not instances:
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                   "no live instance runs with LoRA: start prefill and decode instances "
                                   "with --enable-lora to load adapters at run time")
            serving = [i.instance_id for i in instances if lora_name in i.spec.lora_names]
            if serving and not load_inplace:
                raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"LoRA adapter {lora_name!r} has already been loaded; set load_inplace to "
                                   f"true to load it again in its place")
            loaded, failures = await self._on_each(
                instances, lambda client: client.load(lora_name, lora_path, load_inplace, RPC_TIMEOUT_S))
            if failures and not load_inplace:
                await self._on_each([i for i in loaded if i.instance_id not in serving],
                                    lambda client: client.unload(lora_name, RPC_TIMEOUT_S))
                raise failures[0]
            if failures:
                raise ServiceError(failures[0].code, f"{failures[0].message} (LoRA adapter {lora_name!r} was "
                                   f"loaded again on {', '.join(i.instance_id for i in loaded) or 'none'})")
        logger.info("loaded LoRA adapter %r from %s on %d instances", lora_name, lora_path, len(instances))

    async def unload(self, lora_name: str) -> None:
        """NOT_FOUND: no live instance serves it; else an instance's refusal, named."""
        async with self._changing:
            serving = [i for i in self.registry.live_instances() if lora_name in i.spec.lora_names]
            if not serving:
                raise ServiceError(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {lora_name!r} cannot be found")
            _, failures = await self._on_each(serving, lambda client: client.unload(lora_name, RPC_TIMEOUT_S))
            # One that no longer serves it (it restarted meanwhile) has what was asked.
            failures = [f for f in failures if f.code != grpc.StatusCode.NOT_FOUND]
            if failures:
                raise failures[0]
        logger.info("unloaded LoRA adapter %r from %d instances", lora_name, len(serving))

    async def close(self) -> None:
        for task in list(self._catching_up):
            task.cancel()
        await asyncio.gather(*self._catching_up, return_exceptions=True)
        await self._channels.close()

    def _lora_instances(self) -> list[Instance]:
        return [i for i in self.registry.live_instances() if i.spec.lora_enabled]

    async def _on_each(self, instances: list[Instance], call: Callable[[LoRAAdapterClient], Awaitable[ServedLoRAs]]
                       ) -> tuple[list[Instance], list[ServiceError]]:
        """call on every instance at once: (those it succeeded on, each failure as a
        ServiceError naming its instance); the registry takes each answer's names."""
        async def one(instance: Instance) -> ServedLoRAs:
            with self._channels.calling(instance) as client:
                return await call(client)
        results = await asyncio.gather(*(one(i) for i in instances), return_exceptions=True)
        done, failures = [], []
        for instance, result in zip(instances, results):
            if isinstance(result, ServedLoRAs):
                self.registry.update_loras(instance.instance_id, result)
                done.append(instance)
            elif isinstance(result, grpc.aio.AioRpcError):
                failures.append(ServiceError(result.code(), f"{instance.instance_id}: {result.details()}"))
            else:
                raise result
        return done, failures

    def _runtime_adapters(self, instance_id: str) -> dict[str, str]:
        """name -> path of the adapters the other live instances report as loaded at run time
        (where two report one name from different paths, a reload that failed part-way, the
        first instance's by id)."""
        paths: dict[str, str] = {}
        for other in self._lora_instances():
            if other.instance_id != instance_id:
                for name, path in other.spec.runtime_lora_paths.items():
                    paths.setdefault(name, path)
        return paths

    def _missing(self, instance: Instance) -> dict[str, str]:
        served = set(instance.spec.lora_names)
        return {name: path for name, path in self._runtime_adapters(instance.instance_id).items()
                if name not in served}

    def _on_added(self, instance: Instance, _reason: str) -> None:
        if instance.spec.lora_enabled and self._missing(instance):
            task = asyncio.get_running_loop().create_task(self._catch_up(instance.instance_id))
            self._catching_up.add(task)
            task.add_done_callback(self._catching_up.discard)

    async def _catch_up(self, instance_id: str) -> None:
        """Load on a newly registered instance the run-time adapters it lacks (as of now:
        a change made meanwhile under the lock is seen)."""
        async with self._changing:
            instance = self.registry.get(instance_id)
            for lora_name, lora_path in (self._missing(instance) if instance is not None else {}).items():
                instance = self.registry.get(instance_id)
                if instance is None:
                    return  # gone again
                _, failures = await self._on_each([instance], lambda client: client.load(
                    lora_name, lora_path, False, RPC_TIMEOUT_S))
                for failure in failures:
                    if failure.code != grpc.StatusCode.ALREADY_EXISTS:  # another gateway gave it first
                        logger.warning("could not load LoRA adapter %r on %s, which joined after it was loaded: "
                                       "%s", lora_name, instance_id, failure.message)

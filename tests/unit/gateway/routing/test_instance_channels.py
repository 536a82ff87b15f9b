"""InstanceChannels: a channel outlives its instance's deregistration while a call uses it."""
from __future__ import annotations

import asyncio

from common.service.registration import InstanceSpec
from common.service.embedding_client import EmbeddingClient
from decode_service.client import DecodeClient
from gateway.routing.instance_channels import InstanceChannels
from gateway.routing.registry import InstanceRegistry

SPEC = InstanceSpec("d0", "decode", "127.0.0.1:1", num_total_blocks=10)


def test_a_channel_closes_once_its_instance_left_and_the_last_call_ended():
    async def scenario():
        registry = InstanceRegistry(clock=lambda: 0.0)
        channels = InstanceChannels(registry, DecodeClient, roles=["decode"])
        instance = registry.register(SPEC)
        with channels.calling(instance) as client:
            registry.deregister("d0")  # draining: its streams must go on
            assert channels.client(instance) is client
        assert channels.client(instance) is not client  # closed once idle: a new one
        await channels.close()
    asyncio.run(scenario())


def test_an_instance_that_registers_again_keeps_its_channel():
    async def scenario():
        registry = InstanceRegistry(clock=lambda: 0.0)
        channels = InstanceChannels(registry, DecodeClient, roles=["decode"])
        instance = registry.register(SPEC)
        with channels.calling(instance) as client:
            registry.deregister("d0")
            instance = registry.register(SPEC)
        assert channels.client(instance) is client
        await channels.close()
    asyncio.run(scenario())


def test_only_the_roles_named_retire_their_channels():
    async def scenario():
        registry = InstanceRegistry(clock=lambda: 0.0)
        decode_only = InstanceChannels(registry, EmbeddingClient, roles=["decode"])
        every_role = InstanceChannels(registry, EmbeddingClient, roles=["decode", "prefill"])
        prefill = registry.register(InstanceSpec("p0", "prefill", "127.0.0.1:2", num_total_blocks=10))
        kept, retired = decode_only.client(prefill), every_role.client(prefill)
        registry.deregister("p0")
        assert decode_only.client(prefill) is kept
        assert every_role.client(prefill) is not retired  # closed: a new one
        await decode_only.close()
        await every_role.close()
    asyncio.run(scenario())

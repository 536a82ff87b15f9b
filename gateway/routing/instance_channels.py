"""Clients of engine instances, one per address, shared by every call there: the decode
instances' DecodeClient (decode_service.client) for the dispatcher, every instance's
EmbeddingClient (common.service.embedding_client) for embeddings.

A channel is closed once its instance has left the registry and no call uses it:
closing it earlier would kill the calls of an instance that is draining. An
instance that registers again at the same address keeps its channel.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar

from gateway.routing.registry import Instance, InstanceRegistry


class _Client(Protocol):
    async def close(self) -> None: ...


ClientT = TypeVar("ClientT", bound=_Client)


class _Channel(Generic[ClientT]):
    def __init__(self, client: ClientT):
        self.client = client
        self.num_calls = 0
        self.retired = False  # its instance left the registry


class InstanceChannels(Generic[ClientT]):
    """make_client(address) for each address of an instance of `roles`."""

    def __init__(self, registry: InstanceRegistry, make_client: Callable[[str], ClientT],
                 roles: Iterable[str]) -> None:
        self._make_client = make_client
        self._roles = frozenset(roles)
        self._channels: dict[str, _Channel[ClientT]] = {}  # by gRPC address
        self._closing: set[asyncio.Task] = set()
        registry.subscribe(on_added=self._on_added, on_removed=self._on_removed)

    def client(self, instance: Instance) -> ClientT:
        """For a short call (a probe) that need not keep the channel open."""
        return self._channel(instance).client

    @contextmanager
    def calling(self, instance: Instance) -> Iterator[ClientT]:
        """The client, with its channel kept open until the block ends."""
        channel = self._channel(instance)
        channel.num_calls += 1
        try:
            yield channel.client
        finally:
            channel.num_calls -= 1
            self._close_if_idle(instance.spec.grpc_address)

    def _channel(self, instance: Instance) -> _Channel[ClientT]:
        address = instance.spec.grpc_address
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = _Channel(self._make_client(address))
        return channel

    def _on_added(self, instance: Instance, _reason: str) -> None:
        channel = self._channels.get(instance.spec.grpc_address)
        if channel is not None:
            channel.retired = False

    def _on_removed(self, instance: Instance, _reason: str) -> None:
        if instance.role in self._roles and instance.spec.grpc_address in self._channels:
            self._channels[instance.spec.grpc_address].retired = True
            self._close_if_idle(instance.spec.grpc_address)

    def _close_if_idle(self, address: str) -> None:
        channel = self._channels.get(address)
        if channel is not None and channel.retired and channel.num_calls == 0:
            del self._channels[address]
            task = asyncio.get_running_loop().create_task(channel.client.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._closing, return_exceptions=True)
        for channel in self._channels.values():
            await channel.client.close()
        self._channels.clear()

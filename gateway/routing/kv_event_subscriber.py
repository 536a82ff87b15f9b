"""Feeding a KvIndex: one ZeroMQ SUB socket per instance that publishes KV events (every
prefill and decode instance), and resyncs.

An instance's events arrive on its socket (msgpack, common/service/kv_events.py);
when the index reports a gap, or a heartbeat's published sequence shows events
were lost, a resync asks the instance for a snapshot (GetCachedBlocks) until the
index is consistent again (resync protocol: gateway.routing.kv_index).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

import msgpack
import zmq
import zmq.asyncio

from gateway.routing.kv_index import KvIndex
from prefill_service.client import fetch_cached_blocks
from protos.pdserve.v1 import decode_pb2_grpc

logger = logging.getLogger(__name__)

Resync = Callable[[str], Awaitable[tuple[int, Iterable[int]]]]  # instance id -> (seq, hashes)


class KvEventSubscriber:
    """One SUB socket and receive task per publishing instance, feeding a KvIndex (asyncio)."""

    def __init__(self, index: KvIndex, resync: Resync, retry_s: float = 1.0):
        self.index = index
        self._resync = resync
        self._retry_s = retry_s
        self._context = zmq.asyncio.Context()
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._resyncs: dict[str, asyncio.Task] = {}

    def attach(self, registry) -> None:
        """Follow a gateway.routing.registry.InstanceRegistry: subscribe to every instance that
        publishes KV events (prefill instances; decode instances, for the prompts they prefill)
        as it registers, drop it as it leaves, check sequences on heartbeats."""
        def added(instance, _reason):
            if instance.spec.kv_events_endpoint:
                self.add_instance(instance.instance_id, instance.spec.kv_events_endpoint)
        registry.subscribe(
            on_added=added,
            on_removed=lambda instance, _reason: self.remove_instance(instance.instance_id),
            on_heartbeat=lambda instance, _reason: self.check_sequence(
                instance.instance_id, instance.load.kv_events_sequence))

    def add_instance(self, instance_id: str, endpoint: str) -> None:
        self.remove_instance(instance_id)
        self.index.add_instance(instance_id)
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(endpoint)
        self._sockets[instance_id] = socket
        self._tasks[instance_id] = asyncio.create_task(self._receive(instance_id, socket))
        self.index.mark_resync(instance_id)
        self._start_resync(instance_id)

    def remove_instance(self, instance_id: str) -> None:
        for tasks in (self._tasks, self._resyncs):
            task = tasks.pop(instance_id, None)
            if task is not None:
                task.cancel()
        socket = self._sockets.pop(instance_id, None)
        if socket is not None:
            socket.close()
        self.index.remove_instance(instance_id)

    def check_sequence(self, instance_id: str, published_seq: int) -> None:
        if self.index.note_published_seq(instance_id, published_seq):
            self._start_resync(instance_id)

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *self._resyncs.values()]
        for instance_id in list(self._sockets):
            self.remove_instance(instance_id)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._context.term()

    async def _receive(self, instance_id: str, socket: zmq.asyncio.Socket) -> None:
        while True:
            payload = await socket.recv()
            try:
                events = msgpack.unpackb(payload)["events"]
                gap = self.index.apply_events(instance_id, events)
            except (ValueError, KeyError, TypeError, msgpack.UnpackException):
                logger.warning("bad kv events message from %s; resyncing", instance_id)
                self.index.mark_resync(instance_id)
                gap = True
            if gap:
                self._start_resync(instance_id)

    def _start_resync(self, instance_id: str) -> None:
        task = self._resyncs.get(instance_id)
        if task is None or task.done():
            self._resyncs[instance_id] = asyncio.create_task(self._resync_until_consistent(instance_id))

    async def _resync_until_consistent(self, instance_id: str) -> None:
        while True:
            try:
                seq, block_hashes = await self._resync(instance_id)
            except Exception as e:  # instance busy or going away: retry until removed
                logger.warning("kv index resync of %s failed: %r; retrying", instance_id, e)
                await asyncio.sleep(self._retry_s)
                continue
            if not self.index.apply_snapshot(instance_id, seq, block_hashes):
                return


def grpc_resync(registry, timeout_s: float = 10.0) -> Resync:
    """A Resync that calls GetCachedBlocks (PrefillService's or DecodeService's, by the
    instance's role) on the registered address."""
    async def resync(instance_id: str) -> tuple[int, list[int]]:
        instance = registry.get(instance_id)
        if instance is None:
            raise LookupError(f"{instance_id} is not registered")
        stub = decode_pb2_grpc.DecodeServiceStub if instance.role == "decode" else None
        snapshot = await fetch_cached_blocks(instance.spec.grpc_address, timeout_s, stub)
        return snapshot.sequence, snapshot.block_hashes
    return resync

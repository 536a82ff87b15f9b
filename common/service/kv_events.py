"""KV cache events: every instance publishes its prefix cache's changes to the gateway.

Wire format (msgpack, never pickle), one ZeroMQ PUB message per batch of events,
a single frame:

    {"instance_id": str, "seq": <seq of the batch's last event>, "events": [event, ...]}
    event = {"seq": int, "type": "stored", "block_hashes": [u64, ...],
             "parent_block_hash": u64 | None, "token_ids": [int, ...], "block_size": int}
          | {"seq": int, "type": "removed", "block_hashes": [u64, ...]}

`seq` is the KV cache manager's own event counter (common.engine.block_pool): contiguous
per instance, so any loss shows up as a gap, whether ZeroMQ dropped a message at
its high-water mark, the pool's bounded event queue overflowed, or the gateway
connected late. On a gap the gateway calls GetCachedBlocks, whose snapshot is
stamped with the same counter (prefill_service.kv_events.cached_blocks_snapshot), and
replays later events.

Use: after each engine step, `publisher.publish(kv_cache_manager.take_events())`
(`publisher.follow(core)` hangs that on the engine; common.service.engine_worker does, for
both roles). Prefill instances publish so the gateway places prompts by their cached
prefixes; decode instances too, for the prompts they prefill themselves.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import msgpack
import zmq

from common.engine.block_pool import BlockRemoved, BlockStored, KVCacheEvent

# Generous: losing messages is recoverable (resync) but costs a snapshot RPC.
SEND_HIGH_WATER_MARK = 100_000


def encode_event(event: KVCacheEvent) -> dict:
    if isinstance(event, BlockStored):
        return {"seq": event.seq, "type": "stored", "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size}
    if isinstance(event, BlockRemoved):
        return {"seq": event.seq, "type": "removed", "block_hashes": list(event.block_hashes)}
    raise TypeError(f"not a KV cache event: {event!r}")


def encode_batch(instance_id: str, events: Sequence[KVCacheEvent]) -> bytes:
    return msgpack.packb({"instance_id": instance_id, "seq": events[-1].seq,
                          "events": [encode_event(e) for e in events]})


class KvEventPublisher:
    """A ZeroMQ PUB socket for one instance's KV cache events; thread-safe."""

    def __init__(self, instance_id: str, bind: str = "tcp://127.0.0.1:*",
                 context: zmq.Context | None = None):
        # `bind` may use port * (random); read the bound address from `endpoint`.
        # Binding to 0.0.0.0 needs the instance to advertise a reachable host itself.
        self.instance_id = instance_id
        self._socket = (context or zmq.Context.instance()).socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(bind)
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lock = threading.Lock()
        # Report this as InstanceLoad.kv_events_sequence in heartbeats.
        self.last_published_seq = 0

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        if not events:
            return
        payload = encode_batch(self.instance_id, events)
        with self._lock:
            self._socket.send(payload, zmq.NOBLOCK)  # PUB never blocks; drops at the HWM
            self.last_published_seq = events[-1].seq

    def close(self) -> None:
        with self._lock:
            self._socket.close()

    def follow(self, core) -> None:
        """Publish `core`'s KV cache events after every engine step (before its thread starts);
        heartbeats then carry the last sequence sent (InstanceLoad.kv_events_sequence)."""
        core.after_step.append(lambda core: self.publish(core.kv_cache_manager.take_events()))
        core.stats_sources.append(lambda: {"kv_events_sequence": self.last_published_seq})

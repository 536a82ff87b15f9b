"""Which prefill instance caches which KV blocks, from their KV cache events.

`KvIndex` holds cached hashes per instance, the event sequence, gap detection and
snapshot + replay, without I/O; gateway.routing.kv_event_subscriber feeds it from
the instances' event streams and runs resyncs. Wire format: common/service/kv_events.py.

Events lag dispatch by the queueing and prefill time, so the index also counts a
dispatched prompt's blocks as cached on its instance (`record_dispatch`) until
events confirm them or `pending_ttl_s` passes. Without that, the second request
of a new tenant sees no cached prefix anywhere and may land on the other instance,
duplicating the tenant's system prompt across caches.

Resync protocol: an event whose seq is not last_seq + 1 means events were lost.
The instance is then marked resyncing: later events are buffered, a snapshot
(GetCachedBlocks: seq S + every cached hash) replaces the instance's hashes, and
buffered events with seq > S are replayed on top. A new instance starts with a
resync too, so a restarted gateway learns what is already cached.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

MAX_BUFFERED_EVENTS = 100_000  # while resyncing; beyond it the replay gaps and resyncs again


@dataclass
class _InstanceState:
    hashes: set[int] = field(default_factory=set)
    last_seq: int = 0  # seq of the last event applied (or of the snapshot)
    resyncing: bool = False
    buffered: list[dict] = field(default_factory=list)
    published_seq: int | None = None  # as of the previous heartbeat
    # Hashes of dispatched prompts not yet confirmed by events -> expiry time,
    # in expiry order (one TTL for all, so insertion order is expiry order).
    pending: OrderedDict[int, float] = field(default_factory=OrderedDict)

    def has(self, block_hash: int, now: float) -> bool:
        return block_hash in self.hashes or self.pending.get(block_hash, now) > now


class KvIndex:
    def __init__(self, clock: Callable[[], float] = time.monotonic, pending_ttl_s: float = 10.0) -> None:
        self._holders: dict[int, set[str]] = {}  # block hash -> instance ids (events only)
        self._instances: dict[str, _InstanceState] = {}
        self._clock = clock
        self.pending_ttl_s = pending_ttl_s

    def add_instance(self, instance_id: str) -> None:
        self.remove_instance(instance_id)
        self._instances[instance_id] = _InstanceState()

    def remove_instance(self, instance_id: str) -> None:
        state = self._instances.pop(instance_id, None)
        if state is not None:
            self._forget(instance_id, state.hashes)

    def instance_ids(self) -> list[str]:
        return sorted(self._instances)

    def last_seq(self, instance_id: str) -> int:
        return self._instances[instance_id].last_seq

    def needs_resync(self, instance_id: str) -> bool:
        return instance_id in self._instances and self._instances[instance_id].resyncing

    def mark_resync(self, instance_id: str) -> None:
        """Buffer events until the next snapshot (the caller fetches one)."""
        if instance_id in self._instances:
            self._instances[instance_id].resyncing = True

    def apply_events(self, instance_id: str, events: Sequence[dict]) -> bool:
        """Apply events in order; True when a gap was found and a snapshot is needed."""
        state = self._instances.get(instance_id)
        if state is None:
            return False
        if state.resyncing:
            if len(state.buffered) < MAX_BUFFERED_EVENTS:
                state.buffered.extend(events)
            return False
        for i, event in enumerate(events):
            seq = event["seq"]
            if seq <= state.last_seq:  # already in the snapshot (or a duplicate)
                continue
            if seq != state.last_seq + 1:
                logger.info("kv events gap on %s: expected %d, got %d", instance_id, state.last_seq + 1, seq)
                state.resyncing, state.buffered = True, list(events[i:])
                return True
            self._apply(instance_id, state, event)
            state.last_seq = seq
        return False

    def apply_snapshot(self, instance_id: str, seq: int, block_hashes: Iterable[int]) -> bool:
        """Replace the instance's hashes with a snapshot taken at `seq` and replay the
        buffered events after it; True when the replay found a gap (resync again)."""
        state = self._instances.get(instance_id)
        if state is None:
            return False
        self._forget(instance_id, state.hashes)
        state.hashes = set(block_hashes)
        for block_hash in state.hashes:
            self._holders.setdefault(block_hash, set()).add(instance_id)
        buffered = sorted(state.buffered, key=lambda e: e["seq"])
        state.last_seq, state.resyncing, state.buffered, state.published_seq = seq, False, [], None
        return self.apply_events(instance_id, buffered)

    def note_published_seq(self, instance_id: str, published_seq: int) -> bool:
        """Check a heartbeat's kv_events_sequence; True when a snapshot is needed.

        Events can be lost with nothing after them to reveal the gap. A sequence
        reported by one heartbeat and still not applied by the next means exactly
        that (one heartbeat period is ample for in-flight events to arrive). A
        sequence below ours means the publisher restarted with a fresh counter.
        """
        state = self._instances.get(instance_id)
        if state is None or state.resyncing:
            return False
        stale = state.published_seq is not None and state.published_seq > state.last_seq
        state.published_seq = published_seq
        if stale or published_seq < state.last_seq:
            state.resyncing = True
            return True
        return False

    def record_dispatch(self, instance_id: str, block_hashes: Sequence[int]) -> None:
        """Count a just-dispatched prompt's blocks as cached there until confirmed."""
        state = self._instances.get(instance_id)
        if state is None:
            return
        now = self._clock()
        while state.pending and next(iter(state.pending.values())) <= now:
            state.pending.popitem(last=False)
        for block_hash in block_hashes:
            if block_hash not in state.hashes:
                state.pending[block_hash] = now + self.pending_ttl_s
                state.pending.move_to_end(block_hash)

    def cached_prefix_blocks(self, instance_id: str, block_hashes: Sequence[int]) -> int:
        """Leading blocks of a prompt (its chained hashes) the instance caches or
        will have cached (pending dispatches); only a prefix is reusable."""
        state = self._instances.get(instance_id)
        if state is None:
            return 0
        now = self._clock()
        for count, block_hash in enumerate(block_hashes):
            if not state.has(block_hash, now):
                return count
        return len(block_hashes)

    def prefix_match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """cached_prefix_blocks for every instance."""
        return {instance_id: self.cached_prefix_blocks(instance_id, block_hashes)
                for instance_id in self._instances}

    def instances_caching(self, block_hash: int) -> set[str]:
        """Instances whose events say they cache the block (pending ones excluded)."""
        return set(self._holders.get(block_hash, ()))

    def num_cached_blocks(self, instance_id: str) -> int:
        """Blocks the instance caches, counting unexpired dispatched ones too (a
        just-placed prompt must steer the next tie before its events arrive)."""
        state = self._instances.get(instance_id)
        if state is None:
            return 0
        now = self._clock()
        return len(state.hashes) + sum(1 for block_hash, expiry in state.pending.items()
                                       if expiry > now and block_hash not in state.hashes)

    def _apply(self, instance_id: str, state: _InstanceState, event: dict) -> None:
        if event["type"] == "stored":
            for block_hash in event["block_hashes"]:
                state.hashes.add(block_hash)
                state.pending.pop(block_hash, None)
                self._holders.setdefault(block_hash, set()).add(instance_id)
        elif event["type"] == "removed":
            self._forget(instance_id, event["block_hashes"])
            state.hashes.difference_update(event["block_hashes"])
            for block_hash in event["block_hashes"]:
                state.pending.pop(block_hash, None)
        # Other types are from a newer publisher; skipping them keeps the index usable.

    def _forget(self, instance_id: str, block_hashes: Iterable[int]) -> None:
        for block_hash in block_hashes:
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(instance_id)
                if not holders:
                    del self._holders[block_hash]

"""The physical KV block pool: ref counts, free blocks in the order allocation takes them,
hash -> block.

Plain Python, no torch. The pool knows nothing about requests; KVCacheManager
(common/engine/kv_cache_manager.py) maps requests onto blocks and decides what to cache.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Bound on undrained events. An instance whose events nobody drains (a decode
# instance) must not grow without limit; a consumer that misses dropped events
# sees a gap in `seq` and resyncs from `all_cached_block_hashes()`.
MAX_PENDING_EVENTS = 65536


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and registered for prefix caching. Kept while the
    # block sits free (its KV is still valid) until the block is reallocated.
    block_hash: int | None = None


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks of one request became cached (plain data, msgpack-able)."""

    seq: int
    block_hashes: list[int]
    parent_block_hash: int | None  # None: the first block starts the sequence
    token_ids: list[int]  # len(block_hashes) * block_size tokens
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left the cache (evicted on reallocation or a cache reset)."""

    seq: int
    block_hashes: list[int]


KVCacheEvent = BlockStored | BlockRemoved


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_kv_events: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        # Free blocks in two tiers, taken in this order. First the empty ones (no cached
        # prefix), lowest id first: a request's blocks then lie in ascending runs of each
        # layer's cache, which a step's attention reads as streams. Freed in whatever
        # order requests finish, a single queue scattered them over the pool, and a
        # process's decode steps grew 2-6% slower over its first runs that way
        # (docs/benchmarks.md, "Blocks in ascending runs"). Then the cached ones, least
        # recently freed first, so that a cached prefix is evicted only once no empty
        # block is left; a prefix hit on one takes it out of the middle in O(1).
        self._free_empty_ids: list[int] = list(range(num_blocks))  # a heap of block ids
        self._free_cached: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.cached_blocks: dict[int, KVCacheBlock] = {}  # block_hash -> block
        self.enable_kv_events = enable_kv_events
        self.pending_events: deque[KVCacheEvent] = deque(maxlen=MAX_PENDING_EVENTS)
        self.last_event_seq = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_empty_ids) + len(self._free_cached)

    @property
    def num_free_empty_blocks(self) -> int:
        """Free blocks holding no cached prefix: what allocation takes before evicting."""
        return len(self._free_empty_ids)

    def free_block_ids(self) -> list[int]:
        """Every free block, in the order allocation would take them."""
        return sorted(self._free_empty_ids) + list(self._free_cached)

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks, empty ones first, then cached ones (evicting
        their hashes); returned in ascending id order, so that blocks evicted from
        several requests still give this one ascending runs."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, {self.num_free_blocks} free")
        num_empty = min(num_blocks, len(self._free_empty_ids))
        new_blocks = [self.blocks[heapq.heappop(self._free_empty_ids)] for _ in range(num_empty)]
        evicted_hashes = []
        for _ in range(num_blocks - num_empty):
            _, block = self._free_cached.popitem(last=False)
            evicted_hashes.append(block.block_hash)
            self._drop_hash(block)
            new_blocks.append(block)
        for block in new_blocks:
            block.ref_cnt = 1
        if evicted_hashes:
            self._emit(BlockRemoved, block_hashes=evicted_hashes)
            new_blocks.sort(key=lambda block: block.block_id)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take another reference on cached blocks (a prefix hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                assert block.block_hash is not None, f"block {block.block_id}: a prefix hit on an uncached block"
                del self._free_cached[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; a block reaching 0 joins the empty tier, or, cached,
        the cached tier's tail in the given order."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of block {block.block_id}"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    heapq.heappush(self._free_empty_ids, block.block_id)
                else:
                    self._free_cached[block.block_id] = block

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[int],
                          parent_block_hash: int | None, token_ids: Sequence[int]) -> None:
        """Register full blocks under their chained hashes; `token_ids` are their tokens.

        `parent_block_hash` is the hash of the block before `blocks[0]` (None at the
        start of a sequence). One BlockStored event per contiguous run of new hashes.
        """
        assert len(blocks) == len(block_hashes)
        run_start = None
        for index, (block, block_hash) in enumerate(zip(blocks, block_hashes)):
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            # Another request computed the same block concurrently: keep the first copy
            # registered; this one stays uncached and is simply freed later.
            if block_hash in self.cached_blocks:
                if run_start is not None:
                    self._emit_stored(block_hashes, parent_block_hash, token_ids, run_start, index)
                    run_start = None
                continue
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block
            if run_start is None:
                run_start = index
        if run_start is not None:
            self._emit_stored(block_hashes, parent_block_hash, token_ids, run_start, len(blocks))

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (in-use blocks stay allocated, just unshared)."""
        if not self.cached_blocks:
            return
        evicted_hashes = list(self.cached_blocks)
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        for block_id in self._free_cached:  # free and now empty
            heapq.heappush(self._free_empty_ids, block_id)
        self._free_cached.clear()
        self._emit(BlockRemoved, block_hashes=evicted_hashes)

    def all_cached_block_hashes(self) -> list[int]:
        """Snapshot for a consumer's resync; valid as of `last_event_seq`."""
        return list(self.cached_blocks)

    def take_events(self) -> list[KVCacheEvent]:
        events = list(self.pending_events)
        self.pending_events.clear()
        return events

    def _drop_hash(self, block: KVCacheBlock) -> None:
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None

    def _emit_stored(self, block_hashes: Sequence[int], parent_block_hash: int | None,
                     token_ids: Sequence[int], start: int, end: int) -> None:
        self._emit(BlockStored, block_hashes=list(block_hashes[start:end]),
                   parent_block_hash=block_hashes[start - 1] if start > 0 else parent_block_hash,
                   token_ids=list(token_ids[start * self.block_size:end * self.block_size]),
                   block_size=self.block_size)

    def _emit(self, event_type: type, **fields) -> None:
        # The sequence number advances even with events off, so a snapshot's seq is
        # always comparable.
        self.last_event_seq += 1
        if self.enable_kv_events:
            self.pending_events.append(event_type(seq=self.last_event_seq, **fields))

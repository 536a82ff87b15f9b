"""GetCachedBlocks, as prefill and decode instances answer it: a snapshot of the prefix
cache stamped with its KV event counter, for the gateway's resyncs (the events themselves:
common.service.kv_events)."""
from __future__ import annotations

from prefill_service.api import CachedBlocks
from protos.pdserve.v1 import prefill_pb2


def cached_blocks_snapshot(instance_id: str, kv_cache_manager) -> CachedBlocks:
    """GetCachedBlocks for `kv_cache_manager` (a common.engine.kv_cache_manager.KVCacheManager).

    Exact when called between engine steps. The sequence is read before the hashes
    so that, even if the engine runs concurrently, the snapshot is at least as new
    as its sequence; replaying later events (idempotent set updates) then converges.
    """
    sequence = kv_cache_manager.last_event_seq
    hashes = kv_cache_manager.all_cached_block_hashes()
    return CachedBlocks(instance_id, sequence, list(hashes), kv_cache_manager.block_size)


async def get_cached_blocks_response(engine, instance_id: str) -> prefill_pb2.GetCachedBlocksResponse:
    """GetCachedBlocks as both roles answer it: the snapshot taken on the engine thread,
    between steps (`engine`: a common.engine.async_engine.AsyncEngine)."""
    snapshot = await engine.call(lambda core: cached_blocks_snapshot(instance_id, core.kv_cache_manager))
    return snapshot.to_pb()

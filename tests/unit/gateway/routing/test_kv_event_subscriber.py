"""The publisher and the gateway's subscriber over ZeroMQ on loopback, fed by a real BlockPool."""
from __future__ import annotations

import asyncio

import msgpack

from common.engine.block_pool import BlockPool, BlockRemoved, BlockStored
from gateway.routing.kv_event_subscriber import KvEventSubscriber
from gateway.routing.kv_index import KvIndex
from common.service.kv_events import KvEventPublisher, encode_batch
from prefill_service.kv_events import cached_blocks_snapshot


def test_publisher_encodes_block_pool_events_and_snapshots():
    pool = BlockPool(num_blocks=4, block_size=2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [111, 222], None, [1, 2, 3, 4])
    pool.reset_prefix_cache()
    events = pool.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved]
    message = msgpack.unpackb(encode_batch("p0", events))
    assert message["instance_id"] == "p0" and message["seq"] == 2
    assert message["events"][0] == {"seq": 1, "type": "stored", "block_hashes": [111, 222],
                                    "parent_block_hash": None, "token_ids": [1, 2, 3, 4], "block_size": 2}
    assert message["events"][1] == {"seq": 2, "type": "removed", "block_hashes": [111, 222]}
    snapshot = cached_blocks_snapshot("p0", pool)
    assert (snapshot.sequence, list(snapshot.block_hashes), snapshot.block_size) == (2, [], 2)


async def _until(predicate, timeout_s=5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def cache_and_free(pool: BlockPool, *hashes: int) -> None:
    """Cache one block per hash (block_size 1) and free them, as finished requests do."""
    blocks = pool.get_new_blocks(len(hashes))
    pool.cache_full_blocks(blocks, list(hashes), None, list(hashes))
    pool.free_blocks(blocks)


def test_subscriber_follows_publisher_and_resyncs_after_loss():
    pool = BlockPool(num_blocks=8, block_size=1)  # block_size 1: a block per token

    def cache(*hashes):
        cache_and_free(pool, *hashes)

    async def scenario():
        publisher = KvEventPublisher("p0")
        resyncs = []

        async def resync(instance_id):
            resyncs.append(instance_id)
            return pool.last_event_seq, pool.all_cached_block_hashes()

        index = KvIndex()
        subscriber = KvEventSubscriber(index, resync, retry_s=0.01)
        try:
            cache(1, 2)  # before the gateway subscribes: learned from the initial snapshot
            pool.take_events()
            subscriber.add_instance("p0", publisher.endpoint)
            await _until(lambda: resyncs and not index.needs_resync("p0"))
            assert index.cached_prefix_blocks("p0", [1, 2]) == 2

            # Publish until the SUB socket is connected (ZeroMQ drops messages before
            # that; each drop is a gap, which a resync repairs anyway).
            for token in range(10, 60):
                cache(token)
                publisher.publish(pool.take_events())
                await asyncio.sleep(0.01)
                if index.last_seq("p0") == pool.last_event_seq:
                    break
            assert index.last_seq("p0") == pool.last_event_seq == publisher.last_published_seq
            assert index.cached_prefix_blocks("p0", [token]) == 1

            before = len(resyncs)
            cache(100)
            pool.take_events()  # lost: never published
            cache(101)  # eviction of older blocks happens here too (8-block pool)
            publisher.publish(pool.take_events())
            await _until(lambda: len(resyncs) > before and not index.needs_resync("p0"))
            truth = set(pool.all_cached_block_hashes())
            assert {h for h in range(200) if index.cached_prefix_blocks("p0", [h])} == truth
            assert {100, 101} <= truth
        finally:
            await subscriber.close()
            publisher.close()
    asyncio.run(scenario())


def test_two_gateways_subscribed_to_one_publisher_both_follow_every_event():
    """Gateway replicas: each gateway has its own SUB socket on the instance's one PUB
    socket, and ZeroMQ gives every subscriber every message."""
    pool = BlockPool(num_blocks=64, block_size=1)

    def cache(*hashes):
        cache_and_free(pool, *hashes)

    async def scenario():
        publisher = KvEventPublisher("p0")

        async def resync(instance_id):
            return pool.last_event_seq, pool.all_cached_block_hashes()

        indexes = [KvIndex(), KvIndex()]
        subscribers = [KvEventSubscriber(index, resync, retry_s=0.01) for index in indexes]
        try:
            for subscriber in subscribers:
                subscriber.add_instance("p0", publisher.endpoint)
            await _until(lambda: not any(index.needs_resync("p0") for index in indexes))
            # Publish until both SUB sockets are connected (earlier messages may be dropped
            # and repaired by a resync), then every later event reaches both.
            for token in range(10, 40):
                cache(token)
                publisher.publish(pool.take_events())
                await asyncio.sleep(0.01)
                if all(index.last_seq("p0") == pool.last_event_seq for index in indexes):
                    break
            for token in range(40, 50):
                cache(token)
                publisher.publish(pool.take_events())
            await _until(lambda: all(index.last_seq("p0") == pool.last_event_seq for index in indexes))
            truth = set(pool.all_cached_block_hashes())
            for index in indexes:
                assert {h for h in range(100) if index.cached_prefix_blocks("p0", [h])} == truth
            assert set(range(40, 50)) <= truth
        finally:
            for subscriber in subscribers:
                await subscriber.close()
            publisher.close()
    asyncio.run(scenario())

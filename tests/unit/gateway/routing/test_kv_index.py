"""KvIndex (pure): events, gaps, snapshots, heartbeat checks, pending dispatches;
then the publisher and subscriber over ZeroMQ on loopback, fed by a real BlockPool."""
from __future__ import annotations

import asyncio

import msgpack

from common.engine.block_pool import BlockPool, BlockRemoved, BlockStored
from gateway.routing.kv_index import KvEventSubscriber, KvIndex
from prefill_service.kv_events import KvEventPublisher, encode_batch, snapshot_response


def stored(seq, *hashes):
    return {"seq": seq, "type": "stored", "block_hashes": list(hashes)}


def removed(seq, *hashes):
    return {"seq": seq, "type": "removed", "block_hashes": list(hashes)}


def make_index(*instance_ids, clock=lambda: 0.0):
    index = KvIndex(clock=clock, pending_ttl_s=10.0)
    for instance_id in instance_ids:
        index.add_instance(instance_id)
    return index


def test_longest_cached_prefix_per_instance():
    index = make_index("a", "b")
    assert not index.apply_events("a", [stored(1, 10, 11, 12), stored(2, 20)])
    assert not index.apply_events("b", [stored(1, 10, 12)])
    assert index.cached_prefix_blocks("a", [10, 11, 12, 13]) == 3
    assert index.prefix_match([10, 11, 12]) == {"a": 3, "b": 1}  # b lacks 11: 12 is not reusable
    assert index.prefix_match([]) == {"a": 0, "b": 0}
    index.apply_events("a", [removed(3, 11)])
    assert index.prefix_match([10, 11, 12]) == {"a": 1, "b": 1}
    assert index.instances_caching(10) == {"a", "b"}
    index.remove_instance("a")
    assert index.instances_caching(10) == {"b"} and index.cached_prefix_blocks("a", [10]) == 0


def test_duplicates_are_ignored_and_unknown_types_skipped():
    index = make_index("a")
    index.apply_events("a", [stored(1, 10), {"seq": 2, "type": "future_kind"}])
    assert not index.apply_events("a", [stored(1, 99), stored(2, 98)])
    assert index.last_seq("a") == 2 and index.num_cached_blocks("a") == 1


def test_gap_buffers_until_snapshot_then_replays_later_events():
    index = make_index("a")
    index.apply_events("a", [stored(1, 10)])
    assert index.apply_events("a", [stored(3, 30), removed(4, 10)])  # seq 2 lost
    assert index.needs_resync("a")
    assert not index.apply_events("a", [stored(5, 50)])  # buffered, resync already requested
    assert index.cached_prefix_blocks("a", [30]) == 0
    # Snapshot at seq 3: contains 10 (stored 1), 20 (lost stored 2) and 30.
    assert not index.apply_snapshot("a", 3, [10, 20, 30])
    assert not index.needs_resync("a") and index.last_seq("a") == 5
    assert [h for h in (10, 20, 30, 50) if index.cached_prefix_blocks("a", [h])] == [20, 30, 50]


def test_replay_with_a_gap_after_the_snapshot_asks_again():
    index = make_index("a")
    index.apply_events("a", [stored(5, 50)])  # first event is not seq 1: gap
    index.apply_events("a", [stored(8, 80)])
    assert index.apply_snapshot("a", 6, [50, 60])  # 7 missing between snapshot and buffer
    assert index.needs_resync("a")
    assert not index.apply_snapshot("a", 8, [50, 60, 80])
    assert index.last_seq("a") == 8


def test_heartbeat_sequence_reveals_silent_loss_and_restarts():
    index = make_index("a")
    index.apply_events("a", [stored(1, 10)])
    assert not index.note_published_seq("a", 3)  # events 2-3 may still be in flight
    index.apply_events("a", [stored(2, 20), stored(3, 30)])
    assert not index.note_published_seq("a", 4)
    assert index.note_published_seq("a", 4)  # seq 4 never arrived within a heartbeat period
    index.apply_snapshot("a", 4, [10, 20, 30, 40])
    assert index.note_published_seq("a", 1)  # counter went backwards: publisher restarted
    assert not index.note_published_seq("unknown", 5)


def test_dispatched_prompts_count_as_cached_until_confirmed_or_expired():
    now = [0.0]
    index = make_index("a", "b", clock=lambda: now[0])
    index.record_dispatch("a", [10, 11])
    assert index.prefix_match([10, 11, 12]) == {"a": 2, "b": 0}
    assert index.instances_caching(10) == set()  # predictions are not events
    index.apply_events("a", [stored(1, 10)])  # confirmed: no longer depends on the TTL
    now[0] = 11.0
    assert index.cached_prefix_blocks("a", [10, 11]) == 1  # 11 expired unconfirmed
    index.record_dispatch("b", [10])
    index.apply_events("b", [removed(1, 10)])  # evicted: the prediction goes too
    assert index.cached_prefix_blocks("b", [10]) == 0
    index.record_dispatch("unknown", [1])  # ignored


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
    snapshot = snapshot_response("p0", pool)
    assert (snapshot.sequence, list(snapshot.block_hashes), snapshot.block_size) == (2, [], 2)


async def _until(predicate, timeout_s=5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_subscriber_follows_publisher_and_resyncs_after_loss():
    pool = BlockPool(num_blocks=8, block_size=1)  # block_size 1: a block per token

    def cache(*hashes):
        blocks = pool.get_new_blocks(len(hashes))
        pool.cache_full_blocks(blocks, list(hashes), None, list(hashes))
        pool.free_blocks(blocks)

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

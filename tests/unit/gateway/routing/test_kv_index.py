"""KvIndex: events, gaps, snapshots, heartbeat checks, pending dispatches."""
from __future__ import annotations

from gateway.routing.kv_index import KvIndex


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

"""KV wire format: header schema and size limits, validation against a reservation, frame planning."""
from __future__ import annotations

import msgpack
import pytest
import torch

from kv_transfer import HeadRange, KVTarget, PoolGeometry, protocol
from kv_transfer.sender_core import ByteBudget

SHAPE = (16, 3, 64)
BLOCK_BYTES = 16 * 3 * 64 * 4


def kv_header(**changes) -> bytes:
    d = {"v": 2, "op": "kv", "tid": "t", "seq": 0, "layer": 0, "nlay": 1, "first": 0, "nblk": 2, "h0": 0, "nh": 3,
         "dtype": "float32", "shape": list(SHAPE), "splits": [2]} | changes
    return msgpack.packb(d)


def test_headers_round_trip():
    h = protocol.decode(protocol.encode_kv("req-1", 3, 5, 8, 4, "bfloat16", SHAPE, [1, 3], num_layers=2))
    assert (h.op, h.transfer_id, h.seq, h.layer, h.num_layers, h.first, h.num_blocks, h.dtype, h.block_shape,
            h.splits) == ("kv", "req-1", 3, 5, 2, 8, 4, "bfloat16", SHAPE, (1, 3))
    a = protocol.decode(protocol.encode_abort("req-1", 7, "stop"))
    assert (a.op, a.seq, a.reason) == ("abort", 7, "stop")
    k = protocol.decode(protocol.encode_ack("req-1", "done", ""))
    assert (k.op, k.state) == ("ack", "done")


@pytest.mark.parametrize("buf", [
    b"", b"\xc1", b"\x93\x01\x02\x03",                      # not msgpack / not a map
    kv_header()[:-1],                                        # truncated
    kv_header() + b"\x00",                                   # trailing bytes
    msgpack.packb({"op": "kv", "tid": "x" * 5000}),          # str over the limit
    msgpack.packb({"op": "kv", "tid": b"t"}),                # bin is refused outright
    msgpack.packb({"op": "kv", "tid": "t", "e": msgpack.ExtType(1, b"x")}),
    msgpack.packb({"op": "kv", "tid": "t", "splits": [1] * 5000}),
    msgpack.packb({"op": "kv", "tid": ""}),
    msgpack.packb({"op": "nope", "tid": "t"}),
    b"\x91" * 60_000,                                        # nesting bomb under the frame limit
    b"\x91" * 200_000,                                       # ... and over it
])
def test_undecodable_or_unattributable_headers(buf):
    with pytest.raises(protocol.ProtocolError) as e:
        protocol.decode(buf)
    assert e.value.transfer_id is None


@pytest.mark.parametrize("changes", [
    {"layer": "0"}, {"layer": True}, {"layer": -1}, {"layer": 1 << 40}, {"seq": 1.0}, {"v": 1},
    {"h0": -1}, {"nh": 0}, {"h0": "0"}, {"nh": True},
    {"shape": []}, {"shape": [16, 0, 64]}, {"splits": [0]}, {"splits": "2"}, {"dtype": 5}, {"nblk": 0}, {"nlay": 0},
    {"extra": 1},
])
def test_schema_violations_name_the_transfer(changes):
    with pytest.raises(protocol.ProtocolError) as e:
        protocol.decode(kv_header(**changes))
    assert e.value.transfer_id == "t"


def check(frame_sizes=(2 * BLOCK_BYTES,) * 2, blocks_done=(0, 0), next_seq=0, num_dst_blocks=4, **changes):
    """A message checked against a 2-layer reservation of 4 blocks."""
    h = protocol.decode(kv_header(**changes))
    return protocol.check_kv(h, list(frame_sizes), next_seq=next_seq, num_layers=2, dtype="float32",
                             block_shape=SHAPE, block_bytes=BLOCK_BYTES, num_dst_blocks=num_dst_blocks,
                             blocks_done=list(blocks_done))


def test_check_kv_accepts_a_valid_message():
    assert check() is None
    assert check(frame_sizes=[BLOCK_BYTES, 3 * BLOCK_BYTES] * 2, nblk=4, splits=[1, 3]) is None
    assert check(blocks_done=(2, 0), first=2, seq=5, next_seq=5) is None
    assert check(frame_sizes=[2 * BLOCK_BYTES] * 4, nlay=2) is None  # two layers batched


@pytest.mark.parametrize("kwargs, fragment", [
    ({"seq": 1}, "sequence number"),
    ({"layer": 2}, "out of range"),
    ({"layer": 1, "nlay": 2, "frame_sizes": [2 * BLOCK_BYTES] * 4}, "out of range"),
    ({"dtype": "float16"}, "dtype"),
    ({"shape": [16, 3, 32]}, "block shape"),
    ({"nblk": 5, "splits": [5], "frame_sizes": [5 * BLOCK_BYTES] * 2}, "overflow"),
    ({"blocks_done": (4, 0), "first": 4}, "duplicate layer 0"),
    ({"blocks_done": (0, 4), "nlay": 2, "frame_sizes": [2 * BLOCK_BYTES] * 4}, "duplicate layer 1"),
    ({"blocks_done": (2, 0), "first": 0}, "expected 2"),
    ({"nblk": 2, "splits": [1]}, "splits sum"),
    ({"frame_sizes": [2 * BLOCK_BYTES]}, "truncated or extra frame"),
    ({"frame_sizes": [2 * BLOCK_BYTES] * 3}, "truncated or extra frame"),
    ({"nlay": 2}, "truncated or extra frame"),
    ({"frame_sizes": [2 * BLOCK_BYTES, 2 * BLOCK_BYTES - 4]}, "truncated or extra bytes"),
])
def test_check_kv_rejects(kwargs, fragment):
    assert fragment in check(**kwargs)


def test_plan_contiguous_runs_are_views_and_messages_are_capped():
    plans = protocol.plan_messages(list(range(10, 20)), BLOCK_BYTES, max_message_bytes=8 * BLOCK_BYTES,
                                   gather_below_bytes=1)
    assert [(m.first, m.num_blocks) for m in plans] == [(0, 4), (4, 4), (8, 2)]
    assert [p.src_start for m in plans for p in m.pieces] == [10, 14, 18]


def test_plan_gathers_small_scattered_runs_into_one_frame():
    src = [5, 6, 7, 8, 9, 40, 70, 71, 3, 90]
    plans = protocol.plan_messages(src, BLOCK_BYTES, max_message_bytes=1 << 30, gather_below_bytes=3 * BLOCK_BYTES)
    assert len(plans) == 1
    pieces = [(p.first, p.num_blocks, p.src_start) for p in plans[0].pieces]
    assert pieces == [(0, 5, 5), (5, 5, None)]  # the big run is a view; the four small runs one gather
    lone = protocol.plan_messages([7], BLOCK_BYTES, 1 << 30, gather_below_bytes=1 << 20)
    assert lone[0].pieces == (protocol.Piece(0, 1, 7),)  # nothing to merge: a view, even if small


def test_plan_covers_every_block_once():
    import random
    rng = random.Random(0)
    for _ in range(50):
        src = rng.sample(range(200), rng.randrange(1, 60))
        plans = protocol.plan_messages(src, BLOCK_BYTES, rng.randrange(1, 20) * BLOCK_BYTES,
                                       rng.choice([1, 4 * BLOCK_BYTES]))
        covered = [i for m in plans for p in m.pieces for i in range(p.first, p.first + p.num_blocks)]
        assert covered == list(range(len(src)))
        for m in plans:
            assert sum(p.num_blocks for p in m.pieces) == m.num_blocks
            for p in m.pieces:
                if p.src_start is not None:
                    assert src[p.first:p.first + p.num_blocks] == list(range(p.src_start, p.src_start + p.num_blocks))


def test_target_travels_as_plain_msgpack():
    t = KVTarget("req", "tcp://127.0.0.1:5555", (3, 4), 30, "float32", SHAPE, 1.7e9, None)
    assert KVTarget.from_dict(msgpack.unpackb(msgpack.packb(t.to_dict()))) == t
    with pytest.raises(ValueError):
        KVTarget.from_dict(t.to_dict() | {"dtype": "object"})


def test_geometry_of_the_bundled_model_matches_46080_bytes_per_token():
    kv = [(torch.zeros(4, *SHAPE), torch.zeros(4, *SHAPE)) for _ in range(30)]
    geo = PoolGeometry.of(kv)
    assert geo.block_bytes == BLOCK_BYTES and 2 * geo.num_layers * geo.block_bytes // 16 == 46_080
    with pytest.raises(ValueError):
        PoolGeometry.of([(torch.zeros(4, *SHAPE), torch.zeros(4, 16, 3, 32))])


@pytest.mark.timing
def test_byte_budget_waits_bounded_and_lets_one_oversized_message_through():
    import time
    b = ByteBudget(cap=100)
    assert b.acquire("p", 500, time.monotonic() + 1, lambda: False)  # alone: allowed
    t0 = time.monotonic()
    assert not b.acquire("p", 10, time.monotonic() + 0.1, lambda: False)  # cap full until the deadline
    assert 0.09 <= time.monotonic() - t0 < 1.0
    assert b.acquire("q", 10, time.monotonic() + 1, lambda: False)  # per peer
    b.release("p", 500)
    assert b.acquire("p", 90, time.monotonic() + 1, lambda: False) and b.pending() == 100


def test_kv_header_carries_the_receivers_head_range():
    h = protocol.decode(protocol.encode_kv("req-1", 0, 1, 0, 2, "float16", (16, 2, 64), [2], head_start=5))
    assert (h.head_start, h.num_heads, h.block_shape) == (5, 2, (16, 2, 64))


HEAD = BLOCK_BYTES // 3  # one of SHAPE's 3 heads


@pytest.mark.parametrize("changes, frame_sizes", [
    ({"h0": 1, "nh": 2, "shape": [16, 2, 64]}, [2 * 2 * HEAD] * 2),
    ({"h0": 2, "nh": 1, "shape": [16, 1, 64]}, [2 * HEAD] * 2),
])
def test_check_kv_accepts_a_head_slice(changes, frame_sizes):
    assert check(frame_sizes=frame_sizes, **changes) is None


@pytest.mark.parametrize("changes, frame_sizes, fragment", [
    ({"h0": 2, "nh": 2, "shape": [16, 2, 64]}, [2 * 2 * HEAD] * 2, "heads [2, 4) run past the reservation's 3 heads"),
    ({"h0": 0, "nh": 1, "shape": [16, 2, 64]}, [2 * 2 * HEAD] * 2, "block shape"),  # shape is the slice's
    ({"h0": 0, "nh": 1, "shape": [16, 1, 32]}, [HEAD] * 2, "block shape"),           # head_dim must match
    ({"h0": 0, "nh": 1, "shape": [16, 1, 64]}, [2 * 2 * HEAD] * 2, "truncated or extra bytes"),  # frame of 2 heads
])
def test_check_kv_rejects_a_bad_head_slice(changes, frame_sizes, fragment):
    assert fragment in check(frame_sizes=frame_sizes, **changes)


def test_target_checks_a_head_range_against_both_pools():
    target = KVTarget("req", "tcp://127.0.0.1:5555", (3, 4), 2, "float32", (16, 2, 64), 1.7e9, None)
    geo = PoolGeometry(2, 10, "float32", (16, 4, 64))
    assert target.geometry_error(geo, 2, HeadRange(2, 0, 2)) is None
    assert "pool mismatch" in target.geometry_error(geo, 2)  # all heads: the counts must agree
    assert "sender's 4 heads" in target.geometry_error(geo, 2, HeadRange(3, 0, 2))
    assert "receiver's 2 heads" in target.geometry_error(geo, 2, HeadRange(0, 1, 2))
    assert "bad head range" in target.geometry_error(geo, 2, HeadRange(0, 0, 0))
    assert "source blocks" in target.geometry_error(geo, 3, HeadRange(0, 0, 1))
    assert "pool mismatch" in target.geometry_error(PoolGeometry(2, 10, "float32", (8, 4, 64)), 2, HeadRange(0, 0, 1))
    assert "pool mismatch" in target.geometry_error(PoolGeometry(2, 10, "float16", (16, 4, 64)), 2, HeadRange(0, 0, 1))
    same = PoolGeometry(2, 10, "float32", (16, 2, 64))
    assert target.partial_heads(same, HeadRange(0, 0, 2)) is None  # every head on both sides: whole blocks
    assert target.partial_heads(same, HeadRange(0, 0, 1)) == HeadRange(0, 0, 1)
    assert target.partial_heads(geo, HeadRange(0, 0, 2)) == HeadRange(0, 0, 2)  # half the sender's heads

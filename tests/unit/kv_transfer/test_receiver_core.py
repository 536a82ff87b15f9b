"""The reservation table with several senders, each owning a head range: claims, overlaps, races
between validating and writing (torch.distributed receives frames in between), and who gets acks."""
from __future__ import annotations

import msgpack
import numpy as np
import torch

from kv_transfer import TransferState, protocol
from kv_transfer.receiver_core import ReservationTable

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM = 2, 8, 4, 3, 2
HEAD_BYTES = BLOCK_SIZE * HEAD_DIM * 4  # one head of one float32 block


def table_with(dst_block_ids, results=None) -> tuple[ReservationTable, list]:
    kv = [(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM), torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS,
                                                                               HEAD_DIM)) for _ in range(NUM_LAYERS)]
    table = ReservationTable(kv, results.append if results is not None else None)
    handle, dst, deadline = table.new_transfer("t", dst_block_ids, "tcp://127.0.0.1:1", 30)
    table.add(handle, dst, deadline)
    return table, kv


def message(layer: int, h0: int, nh: int, num_blocks: int, seq: int = 0, fill: float = 1.0):
    """(header, frames) of one layer's K and V for heads [h0, h0 + nh) of `num_blocks` blocks."""
    header = protocol.encode_kv("t", seq, layer, 0, num_blocks, "float32", (BLOCK_SIZE, nh, HEAD_DIM), [num_blocks],
                                head_start=h0)
    frame = np.full(num_blocks * BLOCK_SIZE * nh * HEAD_DIM, fill, dtype=np.float32).tobytes()
    return header, [frame, frame]


def deliver(table: ReservationTable, peer: str, header: bytes, frames: list[bytes]) -> list:
    res, h, acks = table.prepare(peer, header, [len(f) for f in frames])
    return acks if res is None else table.commit(res, h, peer, frames)


def ack_states(acks) -> dict[str, str]:
    return {peer: msgpack.unpackb(payload)["state"] for peer, payload in acks}


def test_head_ranges_of_two_senders_land_side_by_side_and_both_are_acked_done():
    results: list = []
    table, kv = table_with([5, 2], results)
    for layer in range(NUM_LAYERS):
        assert deliver(table, "a", *message(layer, 0, 1, 2, seq=layer, fill=1.0)) == []
    assert not results  # one head of three: open
    acks = []
    for layer in range(NUM_LAYERS):  # sequence numbers count per range: b starts at 0 too
        acks += deliver(table, "b", *message(layer, 1, 2, 2, seq=layer, fill=2.0))
    assert [r.state for r in results] == [TransferState.DONE]
    assert ack_states(acks) == {"a": "done", "b": "done"}
    for k, v in kv:
        for cache in (k, v):
            assert (cache[[5, 2], :, 0] == 1).all() and (cache[[5, 2], :, 1:] == 2).all()
            assert cache[[0, 1, 3, 4, 6, 7]].abs().sum() == 0  # nothing outside the reservation
    assert table.counters["bytes_written"] == 2 * NUM_LAYERS * 2 * NUM_HEADS * HEAD_BYTES


def test_a_range_claimed_between_validation_and_write_rejects_the_overlapping_one():
    table, kv = table_with([1, 2])
    res_a, h_a, _ = table.prepare("a", *_sized(message(0, 0, 1, 2)))
    res_b, h_b, _ = table.prepare("b", *_sized(message(0, 0, 2, 2)))  # nothing claimed yet: valid alone
    assert res_a is not None and res_b is not None
    assert table.commit(res_a, h_a, "a", message(0, 0, 1, 2)[1]) == []
    acks = table.commit(res_b, h_b, "b", message(0, 0, 2, 2, fill=9.0)[1])
    assert ack_states(acks) == {"a": "failed", "b": "failed"}
    assert "heads [0, 2) overlap heads [0, 1) already claimed" in res_b.handle.result(0).reason
    assert (kv[0][0][[1, 2]] != 9).all()  # the rejected range wrote nothing


def _sized(msg):
    header, frames = msg
    return header, [len(f) for f in frames]


def test_a_second_sender_on_a_claimed_range_fails_the_transfer():
    table, _ = table_with([1])
    assert deliver(table, "a", *message(0, 1, 1, 1)) == []
    acks = deliver(table, "b", *message(1, 1, 1, 1))
    assert ack_states(acks) == {"a": "failed", "b": "failed"}
    assert table.counters["rejected"] == 1 and not table.active


def test_heads_past_the_reservation_are_rejected():
    table, _ = table_with([1])
    acks = deliver(table, "a", *message(0, 2, 2, 1))
    assert ack_states(acks) == {"a": "failed"}
    assert table.counters["rejected"] == 1


def test_a_sender_that_never_sent_hears_the_end_at_its_first_late_message():
    table, _ = table_with([1, 3])
    assert deliver(table, "a", *message(0, 0, 1, 2)) == []
    assert ack_states(table.cancel("t", "client went away")) == {"a": "failed"}  # only a has sent
    assert ack_states(deliver(table, "b", *message(0, 1, 2, 2))) == {"b": "failed"}
    assert table.counters["dropped_late"] == 1


def test_an_abort_from_any_sender_fails_the_transfer_for_all():
    table, _ = table_with([1])
    assert deliver(table, "a", *message(0, 0, 1, 1)) == []
    acks = deliver(table, "b", protocol.encode_abort("t", 0, "rank died"), [])
    assert ack_states(acks) == {"a": "failed", "b": "failed"}
    assert table.counters["aborted_by_sender"] == 1

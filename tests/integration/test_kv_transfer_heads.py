"""KV transfers that carry a range of KV heads (prefill and decode at different tensor-parallel
sizes), over real loopback sockets with both transports: several senders fill one reservation,
one sender splits its heads over several receivers, and every failure acks every sender."""
from __future__ import annotations

import time

import pytest
import torch

from kv_transfer import HeadRange, TorchDistKVReceiver, TorchDistKVSender, TransferState, ZmqKVReceiver, ZmqKVSender
from tests.support.waiting import wait_for

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM = 3, 24, 16, 64
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def pool(num_heads: int, seed: int | None = None, head_dim: int = HEAD_DIM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [NUM_BLOCKS, BLOCK_SIZE, num_heads, head_dim]; zeros without a seed."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_heads, head_dim)
    if seed is None:
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(NUM_LAYERS)]
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(NUM_LAYERS)]


def expect_heads(expected, src_kv, src_ids, dst_ids, heads: HeadRange) -> None:
    """What `heads` of src blocks written into dst blocks does to the receiver's pool."""
    s, d, n = heads.src_start, heads.dst_start, heads.num_heads
    for layer in range(NUM_LAYERS):
        for i in (0, 1):
            expected[layer][i][dst_ids, :, d:d + n] = src_kv[layer][i][src_ids, :, s:s + n]


def assert_pool_equal(actual, expected) -> None:
    for layer in range(NUM_LAYERS):
        for i in (0, 1):  # bitwise: the raw bytes, not float comparison
            assert torch.equal(actual[layer][i].view(torch.int32), expected[layer][i].view(torch.int32)), layer


class Connector:
    """Makes receivers and senders of one transport; closes senders before receivers."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._senders: list = []
        self._receivers: list = []

    def receiver(self, kv):
        rx = ZmqKVReceiver(kv) if self.kind == "zmq" else TorchDistKVReceiver(kv, host="127.0.0.1", backend="gloo")
        self._receivers.append(rx)
        return rx

    def sender(self, kv):
        tx = ZmqKVSender(kv) if self.kind == "zmq" else TorchDistKVSender(kv)
        self._senders.append(tx)
        return tx

    def close(self) -> None:
        for c in self._senders + self._receivers:
            c.close()


@pytest.fixture(params=["zmq", "gloo"])
def conn(request):
    c = Connector(request.param)
    yield c
    c.close()


@pytest.fixture
def zmq_conn():
    c = Connector("zmq")
    yield c
    c.close()


def send_layers(tx, t, layers) -> None:
    for layer in layers:
        assert tx.send_layer(t, layer)


def test_two_one_head_senders_fill_a_two_head_receiver(conn):
    src_a, src_b, dst = pool(1, seed=1), pool(1, seed=2), pool(2)
    expected = [(k.clone(), v.clone()) for k, v in dst]
    rx, tx_a, tx_b = conn.receiver(dst), conn.sender(src_a), conn.sender(src_b)
    ids_a, ids_b, dst_ids = [3, 4, 5, 17], [20, 1, 2, 9], [9, 0, 1, 22]
    h = rx.register("r", dst_ids, timeout_s=20)
    t_a = tx_a.send_all(ids_a, h.target.to_dict(), heads=HeadRange(src_start=0, dst_start=1, num_heads=1))
    slice_bytes = 2 * NUM_LAYERS * len(dst_ids) * BLOCK_SIZE * HEAD_DIM * 4  # one head, K and V, every layer
    wait_for(lambda: rx.stats().get("bytes_written", 0) == slice_bytes, 10, "the first sender's heads to land")
    assert not h.future.done() and not t_a.future.done()  # half the heads: not done, no ack yet
    t_b = tx_b.send_all(ids_b, h.target, heads=HeadRange(src_start=0, dst_start=0, num_heads=1))
    assert h.result(10).state is TransferState.DONE
    assert t_a.result(10).state is t_b.result(10).state is TransferState.DONE
    expect_heads(expected, src_a, ids_a, dst_ids, HeadRange(0, 1, 1))
    expect_heads(expected, src_b, ids_b, dst_ids, HeadRange(0, 0, 1))
    assert_pool_equal(dst, expected)  # also: no block outside the reservation was touched
    assert rx.stats()["bytes_written"] == 2 * slice_bytes and rx.stats()["active"] == 0


def test_one_two_head_sender_splits_over_two_one_head_receivers(conn):
    src, dst_0, dst_1 = pool(2, seed=3), pool(1), pool(1)
    expected_0, expected_1 = pool(1), pool(1)
    rx_0, rx_1, tx = conn.receiver(dst_0), conn.receiver(dst_1), conn.sender(src)
    src_ids = [7, 8, 9, 10, 11]
    h_0, h_1 = rx_0.register("r", [0, 1, 2, 3, 4], timeout_s=20), rx_1.register("r", [23, 5, 6, 12, 13], timeout_s=20)
    t_0 = tx.start(src_ids, h_0.target, heads=HeadRange(0, 0, 1))
    t_1 = tx.start(src_ids, h_1.target, heads=HeadRange(1, 0, 1))
    for layer in range(NUM_LAYERS):  # layer-wise, interleaved as a prefill step would
        send_layers(tx, t_0, [layer])
        send_layers(tx, t_1, [layer])
    tx.finish(t_0)
    tx.finish(t_1)
    assert [t.result(10).state for t in (t_0, t_1, h_0, h_1)] == [TransferState.DONE] * 4
    expect_heads(expected_0, src, src_ids, list(h_0.target.dst_block_ids), HeadRange(0, 0, 1))
    expect_heads(expected_1, src, src_ids, list(h_1.target.dst_block_ids), HeadRange(1, 0, 1))
    assert_pool_equal(dst_0, expected_0)
    assert_pool_equal(dst_1, expected_1)


def test_upper_half_of_four_heads_into_two_heads_with_scattered_blocks(conn):
    src, dst = pool(4, seed=4), pool(2, seed=5)  # a non-zero receiver: a stray write would show
    expected = [(k.clone(), v.clone()) for k, v in dst]
    rx, tx = conn.receiver(dst), conn.sender(src)
    src_ids, dst_ids = [11, 2, 19, 3, 4, 0, 23], [6, 21, 1, 14, 15, 9, 3]
    heads = HeadRange(src_start=2, dst_start=0, num_heads=2)
    h = rx.register("r", dst_ids, timeout_s=20)
    t = tx.send_all(src_ids, h.target, heads=heads)
    assert t.heads == heads and t.result(10).ok and h.result(10).ok
    expect_heads(expected, src, src_ids, dst_ids, heads)
    assert_pool_equal(dst, expected)


def test_a_range_covering_every_head_takes_the_zero_copy_path(zmq_conn):
    src, dst = pool(2, seed=6), pool(2)
    rx, tx = zmq_conn.receiver(dst), zmq_conn.sender(src)
    h = rx.register("r", [4, 5, 6], timeout_s=20)
    t = tx.start([10, 11, 12], h.target, heads=HeadRange(0, 0, 2))
    assert t.heads is None and t.block_bytes == BLOCK_SIZE * 2 * HEAD_DIM * 4  # whole blocks, as with heads=None
    wait_for(lambda: t in tx._states, 5, "the I/O thread to take the transfer")
    state = tx._states[t]
    frame = tx._piece(0, 0, state, state.plan[0].pieces[0])  # the frame zmq would get for K of layer 0
    assert frame.ctypes.data == src[0][0][10].data_ptr() and frame.nbytes == 3 * t.block_bytes  # a pool view
    send_layers(tx, t, range(NUM_LAYERS))
    tx.finish(t)
    assert t.result(10).ok and h.result(10).ok
    assert torch.equal(dst[1][1][[4, 5, 6]], src[1][1][[10, 11, 12]])


def test_overlapping_ranges_fail_the_transfer_and_ack_both_senders(conn):
    rx, tx_a, tx_b = conn.receiver(pool(2)), conn.sender(pool(1, seed=7)), conn.sender(pool(2, seed=8))
    h = rx.register("r", [0, 1], timeout_s=20)
    t_a = tx_a.start([0, 1], h.target, heads=HeadRange(0, 1, 1))
    send_layers(tx_a, t_a, [0])  # claims heads [1, 2)
    wait_for(lambda: rx.stats().get("messages_ok", 0) >= 1, 10, "the first range to be claimed")
    t_b = tx_b.send_all([0, 1], h.target, heads=HeadRange(0, 0, 2))  # heads [0, 2): overlaps
    res = h.result(10)
    assert res.state is TransferState.FAILED and "heads [0, 2) overlap heads [1, 2)" in res.reason, res
    for t in (t_a, t_b):  # both acked: neither waits for its deadline
        r = t.result(10)
        assert r.state is TransferState.FAILED and "overlap" in r.reason, r
    assert not tx_a.send_layer(t_a, 1)


@pytest.mark.parametrize("heads, sender_heads, head_dim, fragment", [
    (HeadRange(1, 0, 1), 1, HEAD_DIM, "runs past the sender's 1 heads"),
    (HeadRange(0, 1, 2), 2, HEAD_DIM, "runs past the receiver's 2 heads"),
    (HeadRange(0, 0, 0), 1, HEAD_DIM, "bad head range"),
    (HeadRange(-1, 0, 1), 1, HEAD_DIM, "bad head range"),
    (HeadRange(0, 0, 1), 1, HEAD_DIM // 2, "pool mismatch"),  # head_dim must match
])
def test_a_bad_head_range_fails_at_start_and_sends_nothing(conn, heads, sender_heads, head_dim, fragment):
    rx, tx = conn.receiver(pool(2)), conn.sender(pool(sender_heads, seed=9, head_dim=head_dim))
    h = rx.register("r", [0, 1], timeout_s=20)
    t = tx.send_all([2, 3], h.target, heads=heads)
    res = t.result(5)
    assert res.state is TransferState.FAILED and fragment in res.reason, res
    assert h.state is TransferState.WAITING and rx.stats().get("messages_ok", 0) == 0
    rx.cancel("r")
    assert h.result(5).state is TransferState.FAILED


@pytest.mark.timing  # a deadline's expiry measured against the clock
def test_a_sender_that_never_sends_expires_the_transfer_and_the_other_is_acked(conn):
    dst = pool(2)
    rx, tx_a, tx_b = conn.receiver(dst), conn.sender(pool(1, seed=10)), conn.sender(pool(1, seed=11))
    t0 = time.monotonic()
    h = rx.register("r", [5, 6, 7], timeout_s=2.0)
    t_a = tx_a.send_all([1, 2, 3], h.target, heads=HeadRange(0, 0, 1))
    res = h.result(10)
    assert res.state is TransferState.EXPIRED and 1.9 <= time.monotonic() - t0 <= 3.5, res
    assert t_a.result(5).state is TransferState.EXPIRED
    written = [(k.clone(), v.clone()) for k, v in dst]
    # The missing sender shows up late (its clock runs behind, so it still sends): it is acked
    # with the transfer's end, and nothing of it lands.
    late_target = h.target.to_dict() | {"deadline": h.target.deadline + 10}
    t_b = tx_b.send_all([1, 2, 3], late_target, heads=HeadRange(0, 1, 1))
    assert t_b.result(10).state is TransferState.EXPIRED
    wait_for(lambda: rx.stats().get("dropped_late", 0) >= 1, 10, "the late message to be dropped")
    assert_pool_equal(dst, written)
    assert all(not dst[layer][i][[5, 6, 7], :, 1].any() for layer in range(NUM_LAYERS) for i in (0, 1))


def test_one_sender_aborting_fails_the_transfer_and_acks_the_other(conn):
    rx, tx_a, tx_b = conn.receiver(pool(2)), conn.sender(pool(1, seed=12)), conn.sender(pool(1, seed=13))
    h = rx.register("r", [8, 9], timeout_s=20)
    t_a = tx_a.start([0, 1], h.target, heads=HeadRange(0, 0, 1))
    send_layers(tx_a, t_a, [0, 1])
    layer_bytes = 2 * 2 * BLOCK_SIZE * HEAD_DIM * 4  # K and V of 2 blocks, one head
    wait_for(lambda: rx.stats().get("bytes_written", 0) == 2 * layer_bytes, 10, "the first sender's layers to land")
    t_b = tx_b.start([0, 1], h.target, heads=HeadRange(0, 1, 1))
    send_layers(tx_b, t_b, [0])
    tx_b.abort(t_b, "prefill rank cancelled")
    res = h.result(10)
    assert res.state is TransferState.FAILED and "sender aborted: prefill rank cancelled" in res.reason, res
    r_a = t_a.result(10)  # acked long before its deadline
    assert r_a.state is TransferState.FAILED and "prefill rank cancelled" in r_a.reason, r_a
    assert t_b.result(10).state is TransferState.FAILED


def test_numpy_head_indices_are_accepted_and_other_types_refused(zmq_conn):
    import numpy as np
    src, dst = pool(2, seed=14), pool(1)
    rx, tx = zmq_conn.receiver(dst), zmq_conn.sender(src)
    h = rx.register("r", [2], timeout_s=20)
    with pytest.raises(TypeError):
        tx.start([4], h.target, heads={"src_start": 1, "dst_start": 0, "num_heads": 1})
    t = tx.send_all([4], h.target, heads=HeadRange(np.int64(1), np.int64(0), np.int64(1)))
    assert t.result(10).ok and h.result(10).ok
    assert torch.equal(dst[2][0][2, :, 0], src[2][0][4, :, 1])


def test_the_torch_copy_path_of_device_pools_lands_the_same_bytes(conn, monkeypatch):
    """Device pools (CUDA) copy with torch on head-slice views instead of numpy; no GPU here, so
    the same branch runs on CPU tensors by hiding the pools' numpy views."""
    import kv_transfer.receiver_core
    import kv_transfer.zmq_sender
    for module in (kv_transfer.receiver_core, kv_transfer.zmq_sender):
        monkeypatch.setattr(module, "pool_bytes", lambda kv_caches: None)
    src, dst = pool(4, seed=15), pool(3, seed=16)
    expected = [(k.clone(), v.clone()) for k, v in dst]
    rx, tx_a, tx_b = conn.receiver(dst), conn.sender(src), conn.sender(src)
    for n, (src_ids, dst_ids) in enumerate([([1, 2, 3], [4, 5, 6]), ([9, 0, 17], [20, 2, 11])]):  # runs, scattered
        h = rx.register(f"r{n}", dst_ids, timeout_s=20)
        sends = [(tx_a, HeadRange(src_start=1, dst_start=1, num_heads=2)), (tx_b, HeadRange(3, 0, 1))]
        for tx, heads in sends:
            expect_heads(expected, src, src_ids, dst_ids, heads)
        assert all(t.result(10).ok for t in [tx.send_all(src_ids, h.target, heads=heads) for tx, heads in sends])
        assert h.result(10).ok
    assert_pool_equal(dst, expected)

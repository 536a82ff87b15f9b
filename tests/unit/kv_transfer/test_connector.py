"""ZeroMQ connector lifecycle in one process (both ends on loopback): cancel, abort, finish,
late messages, a receiver that never reads, asyncio use. The two-process behaviour is
covered in tests/integration/test_kv_transfer_zmq.py."""
from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch
import zmq

from kv_transfer import TransferState, ZmqKVReceiver, ZmqKVSender, protocol

NUM_LAYERS, NUM_BLOCKS, SHAPE = 3, 32, (16, 2, 64)
pytestmark = pytest.mark.timeout(60)


def pool(seed: int | None, dtype=torch.float32, num_blocks=NUM_BLOCKS):
    if seed is None:
        return [(torch.zeros(num_blocks, *SHAPE, dtype=dtype), torch.zeros(num_blocks, *SHAPE, dtype=dtype))
                for _ in range(NUM_LAYERS)]
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(num_blocks, *SHAPE, generator=g).to(dtype) for _ in range(2)) for _ in range(NUM_LAYERS)]


@pytest.fixture
def pair():
    src, dst = pool(0), pool(None)
    with ZmqKVReceiver(dst) as rx, ZmqKVSender(src) as tx:
        yield rx, tx, src, dst


def test_bfloat16_whole_request_round_trip():
    src, dst = pool(1, torch.bfloat16), pool(None, torch.bfloat16)
    with ZmqKVReceiver(dst) as rx, ZmqKVSender(src) as tx:
        h = rx.register("r", [9, 3, 4, 5], timeout_s=10)
        assert tx.send_all([0, 1, 2, 30], h.target).result(10).ok and h.result(10).ok
    for layer in range(NUM_LAYERS):
        for i in (0, 1):
            assert torch.equal(dst[layer][i][[9, 3, 4, 5]], src[layer][i][[0, 1, 2, 30]])


def test_receiver_cancel_reaches_the_sender(pair):
    rx, tx, _, _ = pair
    h = rx.register("r", [1, 2], timeout_s=10)
    t = tx.start([3, 4], h.target.to_dict())
    assert tx.send_layer(t, 0)
    rx.cancel("r", "client went away")
    assert h.result(5).reason == "client went away"
    res = t.result(5)  # the receiver acks the failure to the sender that started the transfer
    assert res.state is TransferState.FAILED and "client went away" in res.reason
    assert not tx.send_layer(t, 1)


@pytest.mark.timing
def test_sender_abort_and_short_finish_fail_both_ends_at_once(pair):
    rx, tx, _, _ = pair
    h1, h2 = rx.register("a", [1], timeout_s=10), rx.register("b", [2], timeout_s=10)
    t1, t2 = tx.start([1], h1.target), tx.start([2], h2.target)
    for t in (t1, t2):
        tx.send_layer(t, 0)
    tx.abort(t1, "prefill cancelled")
    tx.finish(t2)  # layers 1 and 2 never queued
    t0 = time.monotonic()
    assert "sender aborted: prefill cancelled" in h1.result(5).reason
    assert "finish() after 1 of 3 layers" in h2.result(5).reason
    assert t1.result(5).state is t2.result(5).state is TransferState.FAILED
    assert time.monotonic() - t0 < 5


def test_register_and_start_reject_bad_arguments(pair):
    rx, tx, _, _ = pair
    rx.register("dup", [0], timeout_s=10)
    for args in [("dup", [1], 10), ("x", [], 10), ("x", [0, 0], 10), ("x", [NUM_BLOCKS], 10), ("x", [1], 0),
                 ("", [1], 10)]:
        with pytest.raises(ValueError):
            rx.register(*args)
    h = rx.register("geo", [1, 2], timeout_s=10)
    assert "source blocks" in tx.start([1], h.target).result(5).reason  # 1 source block for 2
    with ZmqKVSender(pool(0, torch.float16)) as tx16:
        assert "pool mismatch" in tx16.start([1, 2], h.target).result(5).reason
    with pytest.raises(ValueError):
        tx.start([NUM_BLOCKS], h.target)


def test_late_and_duplicate_messages_after_done_are_ignored(pair):
    rx, tx, src, dst = pair
    h = rx.register("r", [5, 6], timeout_s=10)
    assert tx.send_all([7, 8], h.target).result(10).ok
    before = [(k.clone(), v.clone()) for k, v in dst]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(rx.endpoint)
    junk = torch.ones(2, *SHAPE).numpy()
    sock.send_multipart([protocol.encode_kv("r", 0, 0, 0, 2, "float32", SHAPE, [2]), junk, junk])
    deadline = time.monotonic() + 5
    while rx.stats().get("dropped_late", 0) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sock.close(linger=0)
    ctx.term()
    assert all(torch.equal(k, kb) and torch.equal(v, vb) for (k, v), (kb, vb) in zip(dst, before))


def test_receiver_that_never_reads_sender_blocks_bounded_then_releases_everything():
    """A hung receiver: the byte cap stops the compute thread, the deadline ends the wait, and the
    socket reset makes zmq let go of the pool views, so the future resolves and no byte stays pending."""
    ctx = zmq.Context()
    hung = ctx.socket(zmq.ROUTER)
    hung.rcvhwm = 1
    hung.setsockopt(zmq.RCVBUF, 4096)
    port = hung.bind_to_random_port("tcp://127.0.0.1")
    big = pool(2, num_blocks=256)  # one layer of 256 blocks is 2 MiB of K+V
    target = {"transfer_id": "t", "endpoint": f"tcp://127.0.0.1:{port}", "dst_block_ids": list(range(256)),
              "num_layers": NUM_LAYERS, "dtype": "float32", "block_shape": list(SHAPE),
              "deadline": time.time() + 1.0}
    with ZmqKVSender(big, max_pending_bytes_per_peer=3 << 20, sndhwm=1) as tx:
        t = tx.start(list(range(256)), target)
        t0 = time.monotonic()
        sent = [tx.send_layer(t, layer) for layer in range(NUM_LAYERS)]
        waited = time.monotonic() - t0
        assert sent[0] and not sent[-1] and 0.8 < waited < 2.0, (sent, waited)
        res = t.result(10)
        assert res.state is TransferState.EXPIRED
        assert tx.pending_bytes() == 0 and tx.num_open() == 0
    hung.close(linger=0)
    ctx.term()


@pytest.mark.timing
def test_asyncio_service_registers_and_awaits_without_blocking_its_loop(pair):
    rx, tx, src, dst = pair

    async def decode_side() -> tuple[TransferState, int]:
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        tick_task = asyncio.create_task(ticker())
        t0 = time.perf_counter()
        h = rx.register("r", [10, 11, 12], timeout_s=10)
        assert time.perf_counter() - t0 < 0.5  # register only enqueues: no wait for the 10 s handshake
        started = threading.Event()

        def prefill_thread():  # the model runner: layer by layer on its own thread
            t = tx.start([0, 1, 2], h.target.to_dict())
            started.set()
            for layer in range(NUM_LAYERS):
                time.sleep(0.02)  # "forward" of this layer
                tx.send_layer(t, layer)
            tx.finish(t)

        threading.Thread(target=prefill_thread).start()
        res = await h
        tick_task.cancel()
        return res.state, ticks

    state, ticks = asyncio.run(decode_side())
    assert state is TransferState.DONE and ticks >= 5  # the loop kept running during the transfer
    for layer in range(NUM_LAYERS):
        assert torch.equal(dst[layer][0][10:13], src[layer][0][0:3])


def test_close_resolves_every_open_transfer():
    src, dst = pool(0), pool(None)
    rx, tx = ZmqKVReceiver(dst), ZmqKVSender(src)
    h = rx.register("r", [1], timeout_s=30)
    t = tx.start([1], h.target)
    tx.close()
    rx.close()
    assert t.result(5).state is TransferState.FAILED and h.result(5).reason == "receiver closed"


def test_cancelled_awaiter_does_not_resolve_the_transfer():
    import asyncio

    from kv_transfer.base import TransferHandle

    handle = TransferHandle("t-cancel")

    async def main():
        waiter = asyncio.ensure_future(_await(handle))
        await asyncio.sleep(0)
        waiter.cancel()
        try:
            await waiter
        except asyncio.CancelledError:
            pass

    asyncio.run(main())
    assert not handle.future.done()  # only the connector may resolve it


async def _await(handle):
    return await handle


def test_transfer_future_cannot_be_cancelled_by_its_owner(pair):
    rx, tx, _, _ = pair
    h = rx.register("r", [1], timeout_s=10)
    t = tx.start([2], h.target)
    assert not h.future.cancel() and not t.future.cancel()
    for layer in range(NUM_LAYERS):
        tx.send_layer(t, layer)
    tx.finish(t)
    assert t.result(10).ok and h.result(10).ok


def test_wake_pipe_never_loses_a_wake_up():
    """Two API threads hammer the skip-the-syscall wake-up while the I/O thread drains: every
    command must be picked up promptly, never only at the poll timeout (a lost wake-up)."""
    import queue

    from kv_transfer.zmq_common import WakePipe

    wake, cmds, seen = WakePipe(), queue.SimpleQueue(), set()
    done = threading.Event()
    late: list[float] = []

    def io_thread():
        poller = zmq.Poller()
        poller.register(wake.read_fd, zmq.POLLIN)
        while not done.is_set():
            if dict(poller.poll(500)).get(wake.read_fd):
                wake.drain()
            while True:
                try:
                    seen.add(cmds.get_nowait())
                except queue.Empty:
                    break

    def api_thread(base: int):
        for i in range(base, base + 3000):
            t0 = time.monotonic()
            cmds.put(i)
            wake.wake()
            while i not in seen:
                if time.monotonic() - t0 > 0.4:
                    late.append(time.monotonic() - t0)
                    return
                time.sleep(0)

    io = threading.Thread(target=io_thread)
    io.start()
    apis = [threading.Thread(target=api_thread, args=(b,)) for b in (0, 100_000)]
    for t in apis:
        t.start()
    for t in apis:
        t.join(30)
    done.set()
    io.join(5)
    wake.close()
    assert not late, f"a command waited {late[0]:.2f}s for the I/O thread: lost wake-up"


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket table")
def test_default_endpoints_listen_on_loopback_only():
    from kv_transfer import TorchDistKVReceiver

    def listeners(port: int) -> set[str]:
        found = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            if os.path.exists(table):
                for line in open(table).read().splitlines()[1:]:
                    local, state = line.split()[1], line.split()[3]
                    ip, hexport = local.split(":")
                    if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                        found.add(ip)
        return found

    with ZmqKVReceiver(pool(None)) as rx:
        assert listeners(int(rx.endpoint.rsplit(":", 1)[1])) == {"0100007F"}  # 127.0.0.1
    rx = TorchDistKVReceiver(pool(None))  # its TCPStore would listen on every interface by itself
    try:
        assert listeners(int(rx.endpoint.rsplit(":", 1)[1])) == {"0100007F"}
    finally:
        rx.close()

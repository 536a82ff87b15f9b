"""The shared-memory ring: every reader sees every message in order, messages larger
than a slot (or the whole ring) go through in chunks, a full ring makes the writer
wait, and the segment is gone after the creator closes it."""
from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from common.engine.distributed.message_queue import QueueHandle, QueueTimeoutError, ShmRingQueue


@pytest.fixture
def ring():
    queue = ShmRingQueue.create(num_readers=2, num_slots=4, slot_bytes=64)
    yield queue
    queue.close()


def test_every_reader_gets_every_message_in_order(ring):
    readers = [ShmRingQueue.attach(ring.handle, reader_rank=rank) for rank in range(2)]
    messages = [bytes([i]) * i for i in range(1, 4)]
    for message in messages:
        ring.enqueue(message)
    for reader in readers:
        assert [reader.dequeue(timeout=5) for _ in messages] == messages
        reader.close()


def test_a_message_larger_than_the_whole_ring_goes_through_in_chunks(ring):
    reader0, reader1 = (ShmRingQueue.attach(ring.handle, reader_rank=rank) for rank in range(2))
    big = os.urandom(64 * 4 * 5 + 7)  # five rings' worth of slots
    received: list[bytes] = []
    thread = threading.Thread(target=lambda: received.append(reader1.dequeue(timeout=10)))
    thread.start()
    writer = threading.Thread(target=ring.enqueue, args=(big,), kwargs={"timeout": 10})
    writer.start()
    assert reader0.dequeue(timeout=10) == big
    writer.join(10)
    thread.join(10)
    assert received == [big]
    ring.enqueue(b"after")  # the ring is consistent afterwards
    assert reader0.dequeue(timeout=5) == b"after" == reader1.dequeue(timeout=5)


def test_the_writer_waits_for_the_slowest_reader(ring):
    fast = ShmRingQueue.attach(ring.handle, reader_rank=0)
    ShmRingQueue.attach(ring.handle, reader_rank=1)  # never reads
    for i in range(4):
        ring.enqueue(bytes([i]))
        assert fast.dequeue(timeout=5) == bytes([i])
    with pytest.raises(QueueTimeoutError):
        ring.enqueue(b"no room", timeout=0.05)


def test_a_reader_waits_until_a_message_or_the_abort_check_raises(ring):
    reader = ShmRingQueue.attach(ring.handle, reader_rank=0)
    with pytest.raises(QueueTimeoutError):
        reader.dequeue(timeout=0.05)

    def abort():
        raise RuntimeError("peer died")
    with pytest.raises(RuntimeError, match="peer died"):
        reader.dequeue(abort=abort)


def _echo_child(handle_dict: dict, reply_dict: dict) -> None:
    requests = ShmRingQueue.attach(QueueHandle.from_dict(handle_dict), reader_rank=0)
    replies = ShmRingQueue.attach(QueueHandle.from_dict(reply_dict))
    while (message := requests.dequeue(timeout=60)) != b"stop":
        replies.enqueue(message[::-1], timeout=60)
    requests.close()
    replies.close()


def test_a_spawned_process_reads_and_answers_and_the_segments_are_removed_at_close():
    requests = ShmRingQueue.create(num_readers=1, num_slots=2, slot_bytes=32)
    replies = ShmRingQueue.create(num_readers=1, num_slots=2, slot_bytes=32)
    replies.reader_rank = 0
    child = multiprocessing.get_context("spawn").Process(
        target=_echo_child, args=(requests.handle.to_dict(), replies.handle.to_dict()))
    child.start()
    try:
        for message in (b"abc", os.urandom(100)):
            requests.enqueue(message, timeout=60)
            assert replies.dequeue(timeout=60) == message[::-1]
        requests.enqueue(b"stop", timeout=60)
        child.join(60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
        names = [requests.name, replies.name]
        requests.close()
        replies.close()
    assert not [name for name in names if os.path.exists(f"/dev/shm/{name.lstrip('/')}")]

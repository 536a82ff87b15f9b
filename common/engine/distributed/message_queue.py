"""A shared-memory ring of fixed-size slots: one writer, N readers (vLLM's shm_broadcast).

Each slot has a flag byte "written" and one "read" byte per reader. The writer takes a
slot once every reader has read it (or it was never written): it clears "written",
copies the bytes in, clears the read bytes and sets "written". A reader takes its next
slot once "written" is set and its own read byte is not, copies the bytes out and sets
its read byte. Readers and the writer each walk the ring in order, so messages arrive
in the order they were written. Byte stores through the mapping reach other processes
in program order on x86 (TSO), which is what the flag protocol relies on.

A message larger than one slot is cut into chunks over consecutive slots (the last one
flagged), so any size goes through: the writer fills slots as the readers free them.

Nobody sleeps on a lock: a waiter spins briefly (sched_yield), then sleeps with a
growing back-off (10 us up to 1 ms, 10 ms after a second of nothing), so an idle
reader costs little CPU and a busy one sees a message within tens of microseconds.
`abort` is polled while waiting: it raises to stop the wait (a peer died).

The creator owns the segment (unlink at close); others attach by name with
`QueueHandle` (plain data) and only close. Attaching does not register the segment with
the resource tracker, so only the creator's tracker would clean it up after a crash.
"""
from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing import resource_tracker, shared_memory

CHUNK_HEADER = struct.Struct("<IB")  # payload bytes in this slot, 1 if the message's last chunk
CHUNK_HEADER_BYTES = 8
SPIN_S = 50e-6
FIRST_SLEEP_S = 10e-6
MAX_SLEEP_S = 1e-3
IDLE_AFTER_S = 1.0
IDLE_SLEEP_S = 10e-3


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Open an existing segment without registering it with the resource tracker: the
    creator owns it, and a spawned child shares its creator's tracker, so a register here
    and the creator's unregister at unlink would not pair up."""
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


class QueueTimeoutError(TimeoutError):
    pass


@dataclass(frozen=True)
class QueueHandle:
    """What another process needs to attach to a queue (msgpack-able via to_dict)."""

    name: str
    num_readers: int
    num_slots: int
    slot_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "QueueHandle":
        return cls(**data)


class ShmRingQueue:
    def __init__(self, handle: QueueHandle, shm: shared_memory.SharedMemory, owner: bool):
        self.handle = handle
        self._shm = shm
        self._owner = owner
        self._buf = shm.buf
        self._flags_per_slot = 1 + handle.num_readers
        # Data starts on a cache line after the flags.
        self._data_offset = -(-handle.num_slots * self._flags_per_slot // 64) * 64
        self._payload_bytes = handle.slot_bytes - CHUNK_HEADER_BYTES
        self._all_read = b"\x01" * handle.num_readers
        self._next_slot = 0  # this side's position in the ring (writer or this reader)
        self.reader_rank: int | None = None

    @classmethod
    def create(cls, num_readers: int, num_slots: int = 16, slot_bytes: int = 256 << 10) -> "ShmRingQueue":
        if num_readers < 1 or num_slots < 1 or slot_bytes <= CHUNK_HEADER_BYTES:
            raise ValueError(f"bad ring shape: {num_readers} readers, {num_slots} slots of {slot_bytes} bytes")
        flags_bytes = -(-num_slots * (1 + num_readers) // 64) * 64
        shm = shared_memory.SharedMemory(create=True, size=flags_bytes + num_slots * slot_bytes)
        shm.buf[:flags_bytes] = bytes(flags_bytes)
        return cls(QueueHandle(shm.name, num_readers, num_slots, slot_bytes), shm, owner=True)

    @classmethod
    def attach(cls, handle: QueueHandle, reader_rank: int | None = None) -> "ShmRingQueue":
        """Open the queue `handle` names, as reader `reader_rank` (None: as its writer)."""
        shm = _attach_untracked(handle.name)
        queue = cls(handle, shm, owner=False)
        if reader_rank is not None and not 0 <= reader_rank < handle.num_readers:
            raise ValueError(f"reader rank {reader_rank} out of range for {handle.num_readers} readers")
        queue.reader_rank = reader_rank
        return queue

    @property
    def name(self) -> str:
        return self.handle.name

    # ---- writer ----
    def enqueue(self, data: bytes, abort: Callable[[], None] | None = None, timeout: float | None = None) -> None:
        view = memoryview(data)
        deadline = None if timeout is None else time.monotonic() + timeout
        offset = 0
        while True:
            chunk = view[offset:offset + self._payload_bytes]
            offset += len(chunk)
            last = offset >= len(view)
            slot = self._next_slot
            flags = slot * self._flags_per_slot
            self._wait(lambda: self._slot_free(flags), deadline, abort)
            start = self._data_offset + slot * self.handle.slot_bytes
            buf = self._buf
            buf[flags] = 0
            CHUNK_HEADER.pack_into(buf, start, len(chunk), int(last))
            buf[start + CHUNK_HEADER_BYTES:start + CHUNK_HEADER_BYTES + len(chunk)] = chunk
            buf[flags + 1:flags + self._flags_per_slot] = bytes(self.handle.num_readers)
            buf[flags] = 1
            self._next_slot = (slot + 1) % self.handle.num_slots
            if last:
                return

    def _slot_free(self, flags: int) -> bool:
        buf = self._buf
        return buf[flags] == 0 or buf[flags + 1:flags + self._flags_per_slot] == self._all_read

    # ---- reader ----
    def dequeue(self, abort: Callable[[], None] | None = None, timeout: float | None = None) -> bytes:
        if self.reader_rank is None:
            raise RuntimeError(f"queue {self.name} was not attached as a reader")
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks: list[bytes] = []
        while True:
            slot = self._next_slot
            flags = slot * self._flags_per_slot
            mine = flags + 1 + self.reader_rank
            buf = self._buf
            self._wait(lambda: buf[flags] == 1 and buf[mine] == 0, deadline, abort)
            start = self._data_offset + slot * self.handle.slot_bytes
            num_bytes, last = CHUNK_HEADER.unpack_from(buf, start)
            chunks.append(bytes(buf[start + CHUNK_HEADER_BYTES:start + CHUNK_HEADER_BYTES + num_bytes]))
            buf[mine] = 1
            self._next_slot = (slot + 1) % self.handle.num_slots
            if last:
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    @staticmethod
    def _wait(ready: Callable[[], bool], deadline: float | None, abort: Callable[[], None] | None) -> None:
        if ready():
            return
        started = time.monotonic()
        sleep_s = FIRST_SLEEP_S
        while not ready():
            if abort is not None:
                abort()
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise QueueTimeoutError("timed out waiting on the shared-memory queue")
            waited = now - started
            if waited < SPIN_S:
                os.sched_yield()
            elif waited < IDLE_AFTER_S:
                time.sleep(sleep_s)
                sleep_s = min(2 * sleep_s, MAX_SLEEP_S)
            else:
                time.sleep(IDLE_SLEEP_S)

    def close(self) -> None:
        """Unmap; the creator also removes the segment. Idempotent."""
        if self._buf is None:
            return
        self._buf = None
        self._shm.close()
        if self._owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

"""What every receiver shares: the caller's half (QueuedKVReceiver) and the reservation
table (validation, the one copy into the pool, deadlines).

The caller's half only enqueues: `register` and `cancel` post a command to the
receiver's own I/O thread, which owns the table, so an asyncio caller never blocks on a
transfer and a transfer's future resolves only after the last write into its blocks.

The reservation table is transport-agnostic and not thread-safe: each receiver calls it
from one thread (ZeroMQ) or under one lock (torch.distributed). A reservation only lives
here while its transfer is open; once DONE/FAILED/EXPIRED its entry (and every reference
to the destination blocks) is dropped before the owner hears about it, so the owner may
free or reuse the blocks the moment `on_done` runs. Returned acks are (peer, payload) pairs
the transport sends back to the senders.

Several senders may fill one reservation (tensor-parallel ranks of different sizes),
each owning one disjoint range of the receiver's KV heads: a `HeadStream` per range,
claimed by its first accepted message. The reservation is DONE once the streams that
finished every layer cover every head.
"""
from __future__ import annotations

import collections
import heapq
import logging
import queue
import threading
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kv_transfer import protocol
from kv_transfer.base import (
    DTYPES,
    KVCaches,
    KVReceiver,
    KVTarget,
    PoolGeometry,
    RecvTransfer,
    TransferResult,
    TransferState,
    check_transfer_id,
    pool_bytes,
)

logger = logging.getLogger(__name__)

Ack = tuple[Any, bytes]  # (peer, encoded ack header)


class QueuedKVReceiver(KVReceiver):
    """The caller's half of a receiver (see the module doc). A subclass calls
    `_init_commands()` in its constructor, drains `_cmds` on its I/O thread, and says how
    to wake that thread (`_post`) and whether it has stopped (`_is_closed`)."""

    _table: ReservationTable
    _endpoint: str

    def _init_commands(self) -> None:
        self._cmds: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._live_ids: set[str] = set()  # registered and not yet ended; guarded by _ids_lock
        self._ids_lock = threading.Lock()

    @abstractmethod
    def _post(self, *cmd: Any) -> None:
        """Queue a command for the I/O thread and make sure it sees it soon."""

    @abstractmethod
    def _is_closed(self) -> bool:
        """True once nothing can end a new transfer any more. Called under _ids_lock."""

    def _sender_public_key(self) -> bytes | None:
        """The CURVE key senders must expect, when the transport encrypts."""
        return None

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float) -> RecvTransfer:
        handle, dst, deadline = self._table.new_transfer(transfer_id, dst_block_ids, self._endpoint, timeout_s,
                                                         self._sender_public_key())
        with self._ids_lock:
            if self._is_closed():
                raise RuntimeError("receiver is closed")
            if transfer_id in self._live_ids:
                raise ValueError(f"transfer {transfer_id!r} is already registered")
            self._live_ids.add(transfer_id)
        handle.future.add_done_callback(lambda _f: self._forget(transfer_id))
        self._post("register", handle, dst, deadline)
        return handle

    def _forget(self, transfer_id: str) -> None:
        with self._ids_lock:
            self._live_ids.discard(transfer_id)

    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        self._post("cancel", transfer_id, reason)

    def stats(self) -> dict[str, int]:
        return dict(self._table.counters) | {"active": len(self._table.active)}


@dataclass(eq=False)
class HeadStream:
    """One sender's head range of a reservation: its own sequence numbers and block order."""

    head_start: int
    num_heads: int
    peer: Any                 # the one sender this range accepts messages from
    blocks_done: list[int]    # per layer, blocks landed so far (in order)
    num_layers_done: int = 0
    next_seq: int = 0


@dataclass(eq=False)
class Reservation:
    handle: RecvTransfer
    dst_block_ids: list[int]
    dst_index: torch.Tensor   # [num_dst_blocks] int64 on the pool's device, for index_copy_
    run_end: list[int]        # run_end[i]: last j with dst[i..j] consecutive ids (slice copy)
    monotonic_deadline: float
    streams: dict[tuple[int, int], HeadStream] = field(default_factory=dict)  # (head_start, num_heads) -> range
    peers: dict[Any, None] = field(default_factory=dict)  # every sender that sent to it, in order: all get acks
    num_heads_done: int = 0   # heads of the streams that landed every layer


class ReservationTable:
    def __init__(self, kv_caches: KVCaches, on_done: Callable[[TransferResult], None] | None,
                 finished_memory: int = 4096) -> None:
        self.geo = geo = PoolGeometry.of(kv_caches)
        self.num_heads = geo.block_shape[1] if len(geo.block_shape) > 1 else 1
        self._kv = list(kv_caches)
        self._bytes = pool_bytes(self._kv)  # CPU pool: received bytes go in with one memcpy
        # ... and head slices with one strided copy: per layer (K, V),
        # [num_blocks, block_size, num_heads, head_dim * itemsize] uint8 views of the same memory.
        self._head_bytes = None if self._bytes is None or len(geo.block_shape) < 2 else [
            tuple(b.reshape(geo.num_blocks, geo.block_shape[0], self.num_heads, -1) for b in kv) for kv in self._bytes]
        self._device = self._kv[0][0].device
        self._on_done = on_done
        self.active: dict[str, Reservation] = {}
        # Ids of recently ended transfers, so late messages count as late, not unknown.
        self._finished: collections.OrderedDict[str, tuple[TransferState, str]] = collections.OrderedDict()
        self._finished_memory = finished_memory
        self._deadlines: list[tuple[float, int, Reservation]] = []
        self._no_blocks_done = [0] * geo.num_layers  # what a head range not yet claimed has landed
        self.counters: collections.Counter[str] = collections.Counter()

    def check_dst(self, dst_block_ids: Sequence[int]) -> list[int]:
        dst = [int(b) for b in dst_block_ids]
        if not dst or len(set(dst)) != len(dst) or min(dst) < 0 or max(dst) >= self.geo.num_blocks:
            raise ValueError(f"destination block ids must be unique ids in [0, {self.geo.num_blocks})")
        return dst

    def new_transfer(self, transfer_id: str, dst_block_ids: Sequence[int], endpoint: str, timeout_s: float,
                     server_public_key: str | None = None) -> tuple[RecvTransfer, list[int], float]:
        """Validate a registration and build its handle: (handle, dst block ids, monotonic deadline).

        The target carries a wall-clock deadline (it travels to another host); the table
        expires the reservation on the monotonic one.
        """
        check_transfer_id(transfer_id)
        dst = self.check_dst(dst_block_ids)
        deadline = monotonic_deadline(timeout_s)
        geo = self.geo
        target = KVTarget(transfer_id, endpoint, tuple(dst), geo.num_layers, geo.dtype, geo.block_shape,
                          time.time() + timeout_s, server_public_key)
        return RecvTransfer(target), dst, deadline

    def add(self, handle: RecvTransfer, dst: list[int], monotonic_deadline: float) -> None:
        if handle.transfer_id in self.active:
            handle._resolve(TransferState.FAILED, "duplicate transfer id", self._on_done)
            return
        run_end = list(range(len(dst)))
        for i in range(len(dst) - 2, -1, -1):
            if dst[i + 1] == dst[i] + 1:
                run_end[i] = run_end[i + 1]
        res = Reservation(handle, dst, torch.tensor(dst, dtype=torch.int64, device=self._device), run_end,
                          monotonic_deadline)
        self.active[handle.transfer_id] = res
        heapq.heappush(self._deadlines, (monotonic_deadline, id(res), res))

    def next_deadline(self) -> float | None:
        while self._deadlines and self._deadlines[0][2].handle.state.terminal:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def end(self, res: Reservation, state: TransferState, reason: str, peer: Any = None) -> list[Ack]:
        """Close a reservation (drop every block reference first) and tell the owner and every
        sender: each one that sent to it, and `peer`, whose message ended it."""
        if self.active.get(res.handle.transfer_id) is not res:
            return []
        del self.active[res.handle.transfer_id]
        self._finished[res.handle.transfer_id] = (state, reason)
        while len(self._finished) > self._finished_memory:
            self._finished.popitem(last=False)
        res.dst_index = torch.empty(0)
        res.streams.clear()
        self.counters[f"transfers_{state.value}"] += 1
        res.handle._resolve(state, reason, self._on_done)
        peers = dict(res.peers) | ({} if peer is None else {peer: None})
        payload = protocol.encode_ack(res.handle.transfer_id, state.value, reason)
        return [(p, payload) for p in peers]

    def expire(self, now: float) -> list[Ack]:
        acks = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, res = heapq.heappop(self._deadlines)
            acks += self.end(res, TransferState.EXPIRED, "deadline passed before all KV arrived")
        return acks

    def cancel(self, transfer_id: str, reason: str) -> list[Ack]:
        res = self.active.get(transfer_id)
        return [] if res is None else self.end(res, TransferState.FAILED, reason)

    def prepare(self, peer: Any, header: Any, frame_sizes: Sequence[int], refresh: Callable[[], None] | None = None
                ) -> tuple[Reservation | None, protocol.Header | None, list[Ack]]:
        """Decode and validate one message. Returns (reservation, header, []) when its frames may
        be written, else (None, None, acks) after failing the transfer if it is ours."""
        try:
            h = protocol.decode(header)
        except protocol.ProtocolError as e:
            res = self.active.get(e.transfer_id) if e.transfer_id else None
            if res is None:
                self.counters["dropped_bad_header"] += 1
                return None, None, []
            return None, None, self._reject(res, peer, f"malformed header: {e}")
        res = self.active.get(h.transfer_id)
        if res is None and refresh is not None:
            refresh()  # a registration may be queued behind this message on our own thread
            res = self.active.get(h.transfer_id)
        if res is None:
            return None, None, self._late(h, peer)
        if h.op == "ack":
            return None, None, self._reject(res, peer, "unexpected ack on the receive side")
        if h.op == "abort":  # any of its senders may give up, and then the whole transfer is lost
            self.counters["aborted_by_sender"] += 1
            return None, None, self.end(res, TransferState.FAILED, f"sender aborted: {h.reason}", peer)
        stream, err = self._stream(res, h, peer)
        if err is None:
            err = protocol.check_kv(h, frame_sizes, next_seq=stream.next_seq if stream else 0,
                                    num_layers=self.geo.num_layers, dtype=self.geo.dtype,
                                    block_shape=self.geo.block_shape, block_bytes=self.geo.block_bytes,
                                    num_dst_blocks=len(res.dst_block_ids),
                                    blocks_done=stream.blocks_done if stream else self._no_blocks_done)
        if err:
            return None, None, self._reject(res, peer, err)
        return res, h, []

    def _late(self, h: protocol.Header, peer: Any) -> list[Ack]:
        """A message for a transfer that is not open (any more)."""
        ended = self._finished.get(h.transfer_id)
        self.counters["dropped_late" if ended else "dropped_unknown"] += 1
        if ended and ended[0] is not TransferState.DONE and h.op != "ack":
            # A sender we never heard from before the end (e.g. cancelled early) learns it now.
            return [(peer, protocol.encode_ack(h.transfer_id, ended[0].value, ended[1]))]
        return []

    @staticmethod
    def _stream(res: Reservation, h: protocol.Header, peer: Any) -> tuple[HeadStream | None, str | None]:
        """The head range a KV message belongs to (None: not claimed yet), or why it may not land."""
        h0, h1 = h.head_start, h.head_start + h.num_heads
        stream = res.streams.get((h.head_start, h.num_heads))
        if stream is not None:
            return (stream, None) if stream.peer == peer else (None, f"message from a second sender for heads "
                                                                     f"[{h0}, {h1})")
        for s in res.streams.values():
            if h0 < s.head_start + s.num_heads and s.head_start < h1:
                return None, (f"heads [{h0}, {h1}) overlap heads [{s.head_start}, {s.head_start + s.num_heads}) "
                              f"already claimed")
        return None, None

    def _reject(self, res: Reservation, peer: Any, reason: str) -> list[Ack]:
        self.counters["rejected"] += 1
        return self.end(res, TransferState.FAILED, f"rejected message: {reason}", peer)

    def commit(self, res: Reservation, h: protocol.Header, peer: Any, frames: Sequence[Any]) -> list[Ack]:
        """Write a validated message's frames into the pool (one copy each) and account for it.

        Frames may have been received after `prepare` (torch.distributed): the reservation
        must still be open, and no other message may have claimed or advanced its head range.
        """
        if self.active.get(h.transfer_id) is not res:
            return self._late(h, peer)
        stream, err = self._stream(res, h, peer)
        if err is None and (stream.next_seq if stream else 0) != h.seq:
            err = "concurrent messages for one head range"
        if err:
            return self._reject(res, peer, err)
        if stream is None:
            stream = res.streams[(h.head_start, h.num_heads)] = HeadStream(h.head_start, h.num_heads, peer,
                                                                           [0] * self.geo.num_layers)
            res.peers[peer] = None
        frame = 0
        for layer in range(h.layer, h.layer + h.num_layers):
            for kv in (0, 1):  # per layer: the K frames, then the V frames
                first = h.first
                for n in h.splits:
                    self._write(layer, kv, res, h, first, n, frames[frame])
                    first += n
                    frame += 1
            stream.blocks_done[layer] += h.num_blocks
            if stream.blocks_done[layer] == len(res.dst_block_ids):
                stream.num_layers_done += 1
        if stream.num_layers_done == self.geo.num_layers:
            res.num_heads_done += stream.num_heads
        stream.next_seq += 1
        if res.handle.first_byte_at is None:
            res.handle.first_byte_at = time.monotonic()
            logger.debug("transfer %s: first KV landed (layers %d-%d of %d blocks)", h.transfer_id, h.layer,
                         h.layer + h.num_layers - 1, h.num_blocks)
        res.handle.state = TransferState.TRANSFERRING
        self.counters["messages_ok"] += 1
        self.counters["bytes_written"] += self.geo.kv_bytes(h.num_blocks, h.num_layers) // self.num_heads * h.num_heads
        if res.num_heads_done == self.num_heads:  # disjoint ranges within bounds: every head landed
            return self.end(res, TransferState.DONE, "")
        return []

    def _write(self, layer: int, kv: int, res: Reservation, h: protocol.Header, first: int, n: int,
               frame: Any) -> None:
        """Blocks [first, first + n) of the reservation, K (kv=0) or V (kv=1) of `layer`, heads
        [h.head_start, h.head_start + h.num_heads), from one frame: one copy per byte."""
        whole = h.num_heads == self.num_heads
        h0, h1 = h.head_start, h.head_start + h.num_heads
        if self._bytes is None:  # device pool
            cache = self._kv[layer][kv]  # [num_blocks, block_size, num_heads, head_dim]
            if not whole:
                cache = cache[:, :, h0:h1]  # a strided view: the copies below write into the pool
            src = _as_blocks(frame, DTYPES[self.geo.dtype], n, h.block_shape)  # [n, block_size, nh, head_dim]
            if res.run_end[first] >= first + n - 1:
                d0 = res.dst_block_ids[first]
                cache[d0:d0 + n].copy_(src)
            else:
                cache.index_copy_(0, res.dst_index[first:first + n], src.to(cache.device))
            return
        # numpy, not torch's copy_: that goes through its OpenMP pool, whose barrier stalls
        # whenever a core is busy elsewhere (on a loaded 2-core host MB-sized copies took
        # 3-60x longer that way). np.copyto is a plain memcpy and releases the GIL.
        src = frame.numpy() if isinstance(frame, torch.Tensor) else np.frombuffer(frame, dtype=np.uint8)
        if whole:
            dst, unit = self._bytes[layer][kv], self.geo.block_bytes  # flat: one block is `unit` bytes
        else:  # [num_blocks, block_size, num_heads, head bytes] -> that head range; src likewise, by block
            dst, unit = self._head_bytes[layer][kv][:, :, h0:h1], 1
            src = src.reshape(n, self.geo.block_shape[0], h.num_heads, -1)
        i = first
        while i < first + n:  # one copy per run of consecutive destination blocks
            j = min(res.run_end[i], first + n - 1)
            d0 = res.dst_block_ids[i]
            np.copyto(dst[d0 * unit:(d0 + j + 1 - i) * unit], src[(i - first) * unit:(j + 1 - first) * unit])
            i = j + 1

    def close(self, reason: str) -> None:
        for res in list(self.active.values()):
            self.end(res, TransferState.FAILED, reason)


def _as_blocks(frame: Any, dtype: torch.dtype, num_blocks: int, block_shape: tuple[int, ...]) -> torch.Tensor:
    if isinstance(frame, torch.Tensor):  # uint8 staging buffer of a torch.distributed receive
        return frame.view(dtype).view(num_blocks, *block_shape)
    return torch.frombuffer(frame, dtype=dtype).view(num_blocks, *block_shape)


def monotonic_deadline(timeout_s: float) -> float:
    if not timeout_s > 0:
        raise ValueError("timeout_s must be > 0")
    return time.monotonic() + timeout_s

"""ZeroMQ sender (prefill side): the compute thread queues layers, one I/O thread sends.

Frames are views of the prefill pool handed to zmq without copying (`copy=False`);
a transfer of a head range only (`start(..., heads=)`) gathers its slice, one copy per frame;
every message is tracked (`track=True`) so we know when zmq no longer reads the pool.
A transfer's future resolves only when it has ended (receiver ack, deadline, abort)
*and* no tracked frame of it is left inside zmq: only then may the owner reuse its
source blocks. In-flight memory is bounded by a per-peer byte cap (the compute thread
waits in `send_layer`, never past the deadline) plus zmq's high-water marks.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import zmq

from kv_transfer import protocol
from kv_transfer.base import PoolGeometry, SendTransfer, TransferResult, TransferState, pool_bytes
from kv_transfer.sender_core import ByteBudget, QueuedKVSender
from kv_transfer.zmq_common import CurveConfig, WakePipe, check_endpoint, common_options

logger = logging.getLogger(__name__)
_TRACKER_POLL_S = 0.002  # how often zmq's release of in-flight frames is checked while any exist
_DYING_GRACE_S = 5.0     # after a socket reset, how long to wait for zmq to drop its frames


@dataclass(eq=False)
class _Peer:
    endpoint: str
    server_key: str | None
    sock: zmq.Socket | None = None
    outbox: collections.deque = field(default_factory=collections.deque)    # _Out not yet given to zmq
    inflight: collections.deque = field(default_factory=collections.deque)  # _Out whose tracker is pending
    states: set = field(default_factory=set)


@dataclass(eq=False)
class _State:
    handle: SendTransfer
    peer: _Peer
    plan: list[protocol.MessagePlan]
    gather_index: dict[int, torch.Tensor]  # piece.first -> [n] int64 source ids, for gathered pieces
    wire_shape: tuple[int, ...]            # of one block's slice on the wire: [block_size, num_heads, head_dim]
    head_start: int                        # the receiver's first head it lands in
    next_seq: int = 0
    num_queued: int = 0    # messages in the outbox
    num_inflight: int = 0  # messages zmq may still read from the pool
    num_dying: int = 0     # ... of which sit in a socket already closed by _reset
    ended: tuple[TransferState, str] | None = None
    pending: list = field(default_factory=list)  # (layer, nbytes, cuda event) posted, not yet cut


@dataclass(eq=False)
class _Out:
    state: _State | None  # None: control message (abort), holds no pool memory
    parts: list[Any] | None
    nbytes: int
    tracker: Any = None
    dead_since: float = 0.0


class ZmqKVSender(QueuedKVSender):
    def __init__(self, kv_caches, *, on_done: Callable[[TransferResult], None] | None = None,
                 curve: CurveConfig | None = None, max_pending_bytes_per_peer: int = 256 << 20,
                 max_message_bytes: int = 16 << 20, gather_below_bytes: int = zmq.COPY_THRESHOLD,
                 batch_layers_below_bytes: int = 2 << 20, sndhwm: int = 1000) -> None:
        self._geo = PoolGeometry.of(kv_caches)
        self._kv = list(kv_caches)
        self._bytes = pool_bytes(self._kv)  # frames are slices of these: no copy, little CPU
        self._on_done = on_done
        self._curve = curve
        self._max_message_bytes = max_message_bytes
        self._gather_below_bytes = gather_below_bytes
        self._batch_bytes = batch_layers_below_bytes
        self._sndhwm = sndhwm
        self._ctx = zmq.Context()
        self._cmds: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = WakePipe()
        self._budget = ByteBudget(max_pending_bytes_per_peer, on_wait=self._wake.wake)
        self._peers: dict[tuple[str, str | None], _Peer] = {}
        self._by_key: dict[tuple[str, str], _State] = {}  # (endpoint, transfer id) -> open transfer
        self._states: dict[SendTransfer, _State] = {}
        self._dying: list[_Out] = []  # frames of reset sockets, until zmq lets go of them
        self._poller = zmq.Poller()
        self._poller.register(self._wake.read_fd, zmq.POLLIN)
        self._stop = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-send-io", daemon=True)
        self._thread.start()

    # --- API, any thread ----------------------------------------------------------------

    def _check_endpoint(self, endpoint: str) -> None:
        check_endpoint(endpoint)

    def close(self, timeout_s: float = 5.0) -> None:
        if not self._stop_io_thread(timeout_s):
            return
        if self._thread.is_alive():
            logger.error("KV sender I/O thread did not stop within %.1fs", timeout_s)
            return
        self._fail_leftover_cmds()
        self._wake.close()
        self._ctx.term()

    def _post(self, *cmd: Any) -> None:
        self._cmds.put(cmd)
        self._wake.wake()

    # --- I/O thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                self._loop_once()
        except Exception:
            logger.exception("KV sender I/O thread crashed")
        finally:
            self._shutdown()

    def _loop_once(self) -> None:
        for peer in self._peers.values():  # ask for POLLOUT only while something waits to go
            if peer.sock is not None:
                self._poller.register(peer.sock, zmq.POLLIN | (zmq.POLLOUT if peer.outbox else 0))
        # zmq letting go of frames raises no event, so trackers are polled, but only while
        # someone waits on it: the compute thread at the byte cap, or an ended transfer.
        timeout = _TRACKER_POLL_S if self._budget.num_waiting or self._dying else 0.2
        now = time.monotonic()
        for st in self._states.values():
            if not st.ended:
                timeout = min(timeout, max(0.0, st.handle.monotonic_deadline - now))
            elif st.num_inflight:
                timeout = _TRACKER_POLL_S
        events = dict(self._poller.poll(timeout * 1000))
        if events.get(self._wake.read_fd):
            self._wake.drain()
        self._drain_cmds()
        for peer in list(self._peers.values()):
            if peer.sock is not None and events.get(peer.sock, 0) & zmq.POLLIN:
                self._recv_acks(peer)
            self._pump(peer)
            self._reap(peer)
        self._check_deadlines()
        self._release_ended()

    def _drain_cmds(self) -> None:
        touched: set[_State] = set()
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            kind, args = cmd[0], cmd[1:]
            if kind == "close":
                self._stop = True
                break
            handle = args[0]
            if kind == "start":
                self._start(handle, args[1])
                continue
            st = self._states.get(handle)
            if kind == "layer":
                if st is None or st.ended:  # ended while the compute thread was queueing
                    self._budget.release(handle.target.endpoint, args[2])
                else:
                    st.pending.append((args[1], args[2], args[3]))
                    touched.add(st)
            elif st is None or st.ended:
                continue
            elif kind == "finish" and args[1] != self._geo.num_layers:
                self._end(st, TransferState.FAILED, f"finish() after {args[1]} of {self._geo.num_layers} layers",
                          notify=True)
            elif kind == "abort":
                self._end(st, TransferState.FAILED, args[1], notify=True)
        for st in touched:
            self._queue_pending(st)

    def _start(self, handle: SendTransfer, error: str | None) -> None:
        t = handle.target
        key = (t.endpoint, t.transfer_id)
        if error is None and key in self._by_key:
            error = "a transfer with this id to this endpoint is already open"
        if error is not None:
            handle._resolve(TransferState.FAILED, error, self._on_done)
            return
        peer = self._peers.get((t.endpoint, t.server_public_key))
        if peer is None:
            peer = self._peers[(t.endpoint, t.server_public_key)] = _Peer(t.endpoint, t.server_public_key)
        if peer.sock is None:
            self._connect(peer)
        plan = protocol.plan_messages(handle.src_block_ids, handle.block_bytes, self._max_message_bytes,
                                      self._gather_below_bytes)
        device = self._kv[0][0].device
        gather = {p.first: torch.tensor(handle.src_block_ids[p.first:p.first + p.num_blocks], device=device)
                  for m in plan for p in m.pieces if p.src_start is None}
        wire_shape, head_start = self._wire_slice(handle)
        st = _State(handle, peer, plan, gather, wire_shape, head_start)
        self._states[handle] = st
        self._by_key[key] = st
        peer.states.add(st)

    def _connect(self, peer: _Peer) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        common_options(sock)
        # IMMEDIATE: queue nothing towards a peer that is not connected (or failed the Curve
        # handshake); such messages stay in our outbox, where a deadline can drop them.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.sndhwm = self._sndhwm
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if self._curve is not None:
            self._curve.apply_client(sock, peer.server_key)
        sock.connect(peer.endpoint)
        peer.sock = sock
        self._poller.register(sock, zmq.POLLIN)

    def _queue_pending(self, st: _State) -> None:
        """Cut the posted layers into messages. Layers that arrived together and are small are
        batched into one message (never waiting for more: that would stall the pipeline)."""
        pending, st.pending = st.pending, []
        if st.ended:
            return
        i = 0
        while i < len(pending):
            j, nbytes = i + 1, pending[i][1]
            while (len(st.plan) == 1 and j < len(pending) and pending[j][0] == pending[j - 1][0] + 1
                   and nbytes + pending[j][1] <= self._batch_bytes):
                nbytes += pending[j][1]
                j += 1
            for _, _, ready in pending[i:j]:
                if ready is not None:
                    ready.synchronize()  # a device pool: the layer's forward must have finished
            self._queue_layers(st, pending[i][0], j - i)
            i = j

    def _queue_layers(self, st: _State, layer0: int, num_layers: int) -> None:
        geo, tid = self._geo, st.handle.transfer_id
        for m in st.plan:
            parts: list[Any] = [protocol.encode_kv(tid, st.next_seq, layer0, m.first, m.num_blocks, geo.dtype,
                                                   st.wire_shape, [p.num_blocks for p in m.pieces], num_layers,
                                                   st.head_start)]
            for layer in range(layer0, layer0 + num_layers):
                for i in (0, 1):  # K pieces, then V pieces
                    parts.extend(self._piece(layer, i, st, p) for p in m.pieces)
            st.next_seq += 1
            st.num_queued += 1
            nbytes = 2 * num_layers * m.num_blocks * st.handle.block_bytes
            st.peer.outbox.append(_Out(st, parts, nbytes))
            self._pump(st.peer)  # at once: zmq streams this one while we cut the next

    def _piece(self, layer: int, i: int, st: _State, p: protocol.Piece) -> Any:
        """One frame's buffer: blocks of layer `layer`, K (i=0) or V (i=1)."""
        heads = st.handle.heads
        if heads is not None:  # a head range: gathered, one copy
            return self._head_slice(layer, i, st, p, heads.src_start, heads.src_start + heads.num_heads)
        if p.src_start is not None and self._bytes is not None:  # a zero-copy view of the pool
            bb = self._geo.block_bytes
            return self._bytes[layer][i][p.src_start * bb:(p.src_start + p.num_blocks) * bb]
        cache = self._kv[layer][i]
        if p.src_start is not None:
            return _frame(cache[p.src_start:p.src_start + p.num_blocks])  # device pool: staged to host
        return _frame(cache.index_select(0, st.gather_index[p.first]))  # small scattered runs: one gather

    def _head_slice(self, layer: int, i: int, st: _State, p: protocol.Piece, h0: int, h1: int) -> Any:
        """Heads [h0, h1) of a piece's blocks, made contiguous: [num_blocks, block_size, h1 - h0, head_dim]."""
        if self._bytes is not None:  # numpy: a plain single-threaded copy (see receiver_core._write)
            num_blocks, block_size, num_heads, _ = self._kv[layer][i].shape
            pool = self._bytes[layer][i].reshape(num_blocks, block_size, num_heads, -1)
            if p.src_start is not None:
                return np.ascontiguousarray(pool[p.src_start:p.src_start + p.num_blocks, :, h0:h1]).reshape(-1)
            return pool[st.gather_index[p.first].numpy(), :, h0:h1].reshape(-1)  # fancy index: a fresh copy
        cache = self._kv[layer][i][:, :, h0:h1]
        if p.src_start is not None:
            return _frame(cache[p.src_start:p.src_start + p.num_blocks].contiguous())
        return _frame(cache.index_select(0, st.gather_index[p.first]))

    def _pump(self, peer: _Peer) -> None:
        while peer.outbox and peer.sock is not None:
            out = peer.outbox[0]
            try:  # HWM is checked on a message's first part only: the rest cannot block
                last = len(out.parts) - 1
                more = zmq.SNDMORE if last else 0
                trackers = [peer.sock.send(out.parts[0], zmq.NOBLOCK | more, copy=False, track=True)]
            except zmq.Again:  # HWM reached or not connected: wait for POLLOUT
                return
            trackers += [peer.sock.send(part, 0 if i == last else zmq.SNDMORE, copy=False, track=True)
                         for i, part in enumerate(out.parts[1:], 1)]
            # send_multipart would track only the last part; zero-copy parts may come earlier.
            out.tracker = zmq.MessageTracker(*trackers)
            peer.outbox.popleft()
            out.parts = None  # zmq's frames keep the views alive now
            if out.state is not None:
                out.state.num_queued -= 1
                out.state.num_inflight += 1
                out.state.handle.state = TransferState.TRANSFERRING
                peer.inflight.append(out)

    def _reap(self, peer: _Peer) -> None:
        while peer.inflight and peer.inflight[0].tracker.done:  # zmq frees messages in send order
            self._release_out(peer.inflight.popleft())

    def _release_out(self, out: _Out, dying: bool = False) -> None:
        if out.state is not None:
            out.state.num_inflight -= 1
            out.state.num_dying -= dying
            self._budget.release(out.state.peer.endpoint, out.nbytes)

    def _recv_acks(self, peer: _Peer) -> None:
        while peer.sock is not None:
            try:
                parts = peer.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                h = protocol.decode(parts[0]) if len(parts) == 1 else None
            except protocol.ProtocolError:
                h = None
            st = self._by_key.get((peer.endpoint, h.transfer_id)) if h is not None and h.op == "ack" else None
            state = {"done": TransferState.DONE, "failed": TransferState.FAILED,
                     "expired": TransferState.EXPIRED}.get(h.state) if st is not None else None
            if state is not None and st.peer is peer:
                self._end(st, state, h.reason and f"receiver: {h.reason}", notify=False)

    def _end(self, st: _State, state: TransferState, reason: str, notify: bool) -> None:
        """Mark a transfer ended; its future resolves in _release_ended once zmq let go of its frames."""
        if st.ended:
            return
        st.ended = (state, reason)
        st.handle.state = state
        for _, nbytes, _ in st.pending:
            self._budget.release(st.handle.target.endpoint, nbytes)
        st.pending = []
        peer = st.peer
        kept = collections.deque()
        for out in peer.outbox:  # never hand zmq the rest of an ended transfer
            if out.state is st:
                st.num_queued -= 1
                self._budget.release(peer.endpoint, out.nbytes)
            else:
                kept.append(out)
        peer.outbox = kept
        if notify:  # let the receiver fail it and free its blocks now, not at the deadline
            peer.outbox.append(_Out(None, [protocol.encode_abort(st.handle.transfer_id, st.next_seq, reason)], 0))

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for st in list(self._states.values()):
            if now < st.handle.monotonic_deadline:
                continue
            if not st.ended:
                self._end(st, TransferState.EXPIRED, "deadline passed before the receiver confirmed", notify=False)
            if st.num_inflight > st.num_dying:  # zmq holds pool views for a peer that does not drain
                self._reset(st.peer, "deadline passed with frames still queued")
        for out in [o for o in self._dying if o.tracker.done or now - o.dead_since > _DYING_GRACE_S]:
            if not out.tracker.done:
                logger.error("zmq kept KV frames %.0fs after close; releasing anyway", _DYING_GRACE_S)
            self._dying.remove(out)
            self._release_out(out, dying=True)

    def _reset(self, peer: _Peer, reason: str) -> None:
        """Close the peer's socket (linger 0 drops its queue) and fail what rode on it."""
        if peer.sock is not None:
            self._poller.unregister(peer.sock)
            peer.sock.close(linger=0)
            peer.sock = None
        now = time.monotonic()
        for out in peer.inflight:
            out.dead_since = now
            out.state.num_dying += 1
        self._dying.extend(peer.inflight)
        peer.inflight.clear()
        peer.outbox = collections.deque(o for o in peer.outbox if o.state is not None)  # old aborts are moot
        for st in list(peer.states):
            # The receiver bound each started transfer to the old socket's identity.
            if not st.ended and st.next_seq > 0:
                self._end(st, TransferState.FAILED, f"connection reset: {reason}", notify=False)
        if any(not st.ended for st in peer.states):
            self._connect(peer)

    def _release_ended(self) -> None:
        for st in [s for s in self._states.values() if s.ended and not s.num_inflight and not s.num_queued]:
            del self._states[st.handle]
            del self._by_key[(st.handle.target.endpoint, st.handle.transfer_id)]
            st.peer.states.discard(st)
            st.handle._resolve(st.ended[0], st.ended[1], self._on_done)

    def _shutdown(self) -> None:
        for st in list(self._states.values()):
            self._end(st, TransferState.FAILED, "sender closed", notify=False)
        for peer in self._peers.values():
            if peer.sock is not None:
                self._reset(peer, "sender closed")
        deadline = time.monotonic() + _DYING_GRACE_S
        while self._dying and time.monotonic() < deadline:
            self._check_deadlines()
            time.sleep(_TRACKER_POLL_S)
        for out in self._dying:
            self._release_out(out, dying=True)
        self._dying.clear()
        self._release_ended()
        self._fail_leftover_cmds()

    def _fail_leftover_cmds(self) -> None:
        """Commands that raced with close(): nothing will run them, so end them here."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "start":
                cmd[1]._resolve(TransferState.FAILED, "sender closed", self._on_done)
            elif cmd[0] == "layer":
                self._budget.release(cmd[1].target.endpoint, cmd[3])


def _frame(t: torch.Tensor) -> Any:
    """A buffer over the tensor's bytes for zmq: no copy for CPU tensors."""
    if t.device.type != "cpu":  # device pools stage through host memory (one D2H copy)
        t = t.cpu()
    return t.reshape(-1).view(torch.uint8).numpy()

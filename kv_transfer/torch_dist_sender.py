"""torch.distributed sender (prefill side): the compute thread queues layers, one I/O thread sends.

Sends are point-to-point on a private two-rank group per receiver (see
torch_dist_common). Each send is waited for, bounded by the transfer's deadline, so
when a transfer ends nothing of it is left inside the transport and its future can
resolve at once. A failed or timed-out operation breaks the pair: every transfer on it
fails and the next transfer to that receiver builds a new pair.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from kv_transfer import protocol
from kv_transfer.base import PoolGeometry, SendTransfer, TransferResult, TransferState
from kv_transfer.sender_core import ByteBudget, QueuedKVSender
from kv_transfer.torch_dist_common import (
    KEEPALIVE_S,
    PAIR_IDLE_DROP_S,
    TAG,
    ack_key,
    comm_device,
    make_group,
    parse_endpoint,
    peer_key,
    wait,
)

logger = logging.getLogger(__name__)
_ACK_POLL_S = 0.005
_ACK_STATES = {"done": TransferState.DONE, "failed": TransferState.FAILED, "expired": TransferState.EXPIRED}


@dataclass(eq=False)
class _Pair:
    endpoint: str
    ready: concurrent.futures.Future  # (store, group, k) once the connect thread formed the pair
    store: Any = None
    pg: Any = None
    k: int = -1
    next_ack: int = 0
    last_used: float = field(default_factory=time.monotonic)  # last transfer message
    last_sent: float = field(default_factory=time.monotonic)  # last message or keepalive
    states: dict[str, "_State"] = field(default_factory=dict)  # transfer id -> open transfer
    aborts: list[bytes] = field(default_factory=list)  # abort headers of transfers ended while it formed


@dataclass(eq=False)
class _State:
    handle: SendTransfer
    pair: _Pair
    plan: list[protocol.MessagePlan]
    next_seq: int = 0
    pending: list = field(default_factory=list)  # (layer, nbytes, cuda event) waiting for the pair


def _form_pair(endpoint: str, local_host: str, timeout_s: float) -> tuple[Any, Any, int]:
    backend, host, port = parse_endpoint(endpoint)
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    k = store.add("kvt/num_peers", 1) - 1
    store.set(peer_key(k), b"1")
    return store, make_group(store, k, 1, backend, local_host, timeout_s), k


class TorchDistKVSender(QueuedKVSender):
    def __init__(self, kv_caches, *, on_done: Callable[[TransferResult], None] | None = None,
                 local_host: str = "127.0.0.1", max_pending_bytes_per_peer: int = 256 << 20,
                 max_message_bytes: int = 16 << 20, connect_timeout_s: float = 30.0) -> None:
        self._geo = PoolGeometry.of(kv_caches)
        self._kv = list(kv_caches)
        self._on_done = on_done
        self._local_host = local_host
        self._max_message_bytes = max_message_bytes
        self._connect_timeout_s = connect_timeout_s
        self._budget = ByteBudget(max_pending_bytes_per_peer)
        self._cmds: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._pairs: dict[str, _Pair] = {}
        self._states: dict[SendTransfer, _State] = {}
        self._connecting: list[tuple[threading.Thread, float]] = []  # (thread, monotonic time it gives up)
        self._stop = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-dist-send", daemon=True)
        self._thread.start()

    def _check_endpoint(self, endpoint: str) -> None:
        parse_endpoint(endpoint)

    def _post(self, *cmd: Any) -> None:
        self._cmds.put(cmd)

    def close(self, timeout_s: float = 5.0) -> None:
        if not self._stop_io_thread(timeout_s):
            return
        # A thread still inside c10d at interpreter exit aborts the process: wait for connect
        # threads too; each gives up by its own (bounded) timeout.
        for th, gives_up in self._connecting:
            th.join(max(0.0, gives_up - time.monotonic()) + 1.0)

    # --- I/O thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                busy = any(s.next_seq for s in self._states.values()) or any(
                    p.pg is None for p in self._pairs.values())  # acks to poll or a pair forming
                timeout = _ACK_POLL_S if busy else 0.2
                now = time.monotonic()
                for st in self._states.values():
                    timeout = min(timeout, max(0.0, st.handle.monotonic_deadline - now))
                for pair in self._pairs.values():
                    timeout = min(timeout, max(0.0, pair.last_sent + KEEPALIVE_S - now))
                try:
                    self._handle(self._cmds.get(timeout=timeout))
                except queue.Empty:
                    pass
                self._check_pairs()
                self._poll_acks()
                self._check_deadlines()
                self._keepalive()
        except Exception:
            logger.exception("KV sender I/O thread crashed")
        finally:
            for pair in list(self._pairs.values()):  # closing our end ends the receiver's pair thread
                self._drop_pair(pair, "sender closed")
            while True:  # commands that raced with close()
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "start":
                    cmd[1]._resolve(TransferState.FAILED, "sender closed", self._on_done)
                elif cmd[0] == "layer":
                    self._budget.release(cmd[1].target.endpoint, cmd[3])

    def _handle(self, cmd: tuple[Any, ...]) -> None:
        kind = cmd[0]
        if kind == "close":
            self._stop = True
            return
        handle = cmd[1]
        if kind == "start":
            self._start(handle, cmd[2])
            return
        st = self._states.get(handle)
        if kind == "layer":
            if st is not None and st.pair.pg is None:  # sent once the pair has formed
                st.pending.append((cmd[2], cmd[3], cmd[4]))
                return
            try:
                if st is not None:
                    self._send_layer(st, cmd[2], cmd[4])
            finally:
                self._budget.release(handle.target.endpoint, cmd[3])
        elif st is None:
            return
        elif kind == "finish" and cmd[2] != self._geo.num_layers:
            self._abort(st, f"finish() after {cmd[2]} of {self._geo.num_layers} layers")
        elif kind == "abort":
            self._abort(st, cmd[2])

    def _start(self, handle: SendTransfer, error: str | None) -> None:
        endpoint = handle.target.endpoint
        pair = self._pairs.get(endpoint)
        if error is None and pair is not None and handle.transfer_id in pair.states:
            error = "a transfer with this id to this endpoint is already open"
        if error is not None:
            handle._resolve(TransferState.FAILED, error, self._on_done)
            return
        if pair is None:
            # Forming a pair blocks (store connect, group rendezvous): do it off the I/O thread so
            # that a receiver which is gone cannot hold other transfers past their deadlines.
            ready: concurrent.futures.Future = concurrent.futures.Future()
            pair = self._pairs[endpoint] = _Pair(endpoint, ready)
            timeout = min(self._connect_timeout_s, max(0.1, handle.monotonic_deadline - time.monotonic()))
            th = threading.Thread(target=_run_into, args=(ready, _form_pair, endpoint, self._local_host, timeout),
                                  name="kv-dist-connect", daemon=True)
            th.start()
            # Two bounded phases (store connect, group rendezvous), each within `timeout`.
            self._connecting = [c for c in self._connecting if c[0].is_alive()] + [(th, time.monotonic() + 2 * timeout)]
        plan = protocol.plan_messages(handle.src_block_ids, handle.block_bytes, self._max_message_bytes,
                                      gather_below_bytes=0)  # whole runs only; no zero-copy floor here
        st = self._states[handle] = _State(handle, pair, plan)
        pair.states[handle.transfer_id] = st

    def _check_pairs(self) -> None:
        for pair in [p for p in self._pairs.values() if p.pg is None and p.ready.done()]:
            try:
                pair.store, pair.pg, pair.k = pair.ready.result()
            except Exception as e:
                self._drop_pair(pair, f"cannot reach receiver: {e}")
                continue
            pair.last_sent = time.monotonic()
            aborts, pair.aborts = pair.aborts, []
            for header in aborts:  # the receiver may hold other senders' parts of these transfers
                if not self._send_raw(pair, header, [], KEEPALIVE_S * 4):
                    break
            for st in list(pair.states.values()):
                pending, st.pending = st.pending, []
                for layer, nbytes, ready in pending:
                    if self._states.get(st.handle) is st:
                        self._send_layer(st, layer, ready)
                    self._budget.release(pair.endpoint, nbytes)

    def _send_layer(self, st: _State, layer: int, ready: Any) -> None:
        if ready is not None:
            ready.synchronize()  # a device pool: the layer's forward must have finished
        k_cache, v_cache = self._kv[layer]
        geo, h = self._geo, st.handle
        wire_shape, head_start = self._wire_slice(h)
        if h.heads is not None:  # [num_blocks, block_size, num_heads, head_dim] -> the range it sends
            s0 = h.heads.src_start
            k_cache, v_cache = k_cache[:, :, s0:s0 + h.heads.num_heads], v_cache[:, :, s0:s0 + h.heads.num_heads]
        for m in st.plan:
            tensors = []
            for cache in (k_cache, v_cache):
                for p in m.pieces:  # whole runs of consecutive pool ids: views, no copy (a head range: one copy)
                    run = cache[p.src_start:p.src_start + p.num_blocks].contiguous()
                    tensors.append(run.reshape(-1).view(torch.uint8))
            header = protocol.encode_kv(h.transfer_id, st.next_seq, layer, m.first, m.num_blocks, geo.dtype,
                                        wire_shape, [p.num_blocks for p in m.pieces], head_start=head_start)
            st.next_seq += 1
            if not self._send_message(st, header, tensors):
                return

    def _send_message(self, st: _State, header: bytes, tensors: list[torch.Tensor]) -> bool:
        if not self._send_raw(st.pair, header, tensors, st.handle.monotonic_deadline - time.monotonic()):
            return False
        st.pair.last_used = time.monotonic()
        if st.handle.state is TransferState.WAITING:
            st.handle.state = TransferState.TRANSFERRING
        return True

    def _send_raw(self, pair: _Pair, header: bytes, tensors: list[torch.Tensor], timeout_s: float) -> bool:
        dev = comm_device(pair.endpoint.partition(":")[0], self._kv[0][0].device)
        pre = torch.tensor([len(header), len(tensors)], dtype=torch.int64, device=dev)
        parts = [pre]
        if tensors:
            parts.append(torch.tensor([t.numel() for t in tensors], dtype=torch.int64, device=dev))
        if header:
            parts.append(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(dev))
        try:
            for t in parts + tensors:
                wait(pair.pg.send([t], 0, TAG), timeout_s)
        except Exception as e:
            self._drop_pair(pair, f"send failed: {e}")
            return False
        pair.last_sent = time.monotonic()
        return True

    def _keepalive(self) -> None:
        now = time.monotonic()
        for pair in [p for p in self._pairs.values() if p.pg is not None]:
            if not pair.states and now - pair.last_used > PAIR_IDLE_DROP_S:
                self._drop_pair(pair, "idle")
            elif now - pair.last_sent >= KEEPALIVE_S:
                self._send_raw(pair, b"", [], KEEPALIVE_S * 4)

    def _abort(self, st: _State, reason: str) -> None:
        # Let the receiver fail it and free its blocks now, once the pair has formed.
        header = protocol.encode_abort(st.handle.transfer_id, st.next_seq, reason)
        if st.pair.pg is not None:
            self._send_message(st, header, [])
        else:
            st.pair.aborts.append(header)
        self._end(st, TransferState.FAILED, reason)

    def _poll_acks(self) -> None:
        for pair in list(self._pairs.values()):
            if pair.pg is None or not any(st.next_seq for st in pair.states.values()):
                continue
            try:
                while pair.store.check([ack_key(pair.k, pair.next_ack)]):
                    key = ack_key(pair.k, pair.next_ack)
                    payload = pair.store.get(key)
                    pair.store.delete_key(key)
                    pair.next_ack += 1
                    try:
                        h = protocol.decode(payload)
                    except protocol.ProtocolError:
                        continue
                    st = pair.states.get(h.transfer_id) if h.op == "ack" else None
                    if st is not None and h.state in _ACK_STATES:
                        self._end(st, _ACK_STATES[h.state], h.reason and f"receiver: {h.reason}")
            except Exception as e:  # the receiver's store is gone: so is the receiver
                self._drop_pair(pair, f"receiver unreachable: {e}")

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for st in [s for s in self._states.values() if now >= s.handle.monotonic_deadline]:
            self._end(st, TransferState.EXPIRED, "deadline passed before the receiver confirmed")

    def _drop_pair(self, pair: _Pair, reason: str) -> None:
        if self._pairs.get(pair.endpoint) is pair:
            del self._pairs[pair.endpoint]
        for st in list(pair.states.values()):
            self._end(st, TransferState.FAILED, f"connection lost: {reason}")
        try:
            if pair.pg is not None:
                pair.pg.abort()  # drop the pair's sockets; any op of it is over
        except Exception:
            pass

    def _end(self, st: _State, state: TransferState, reason: str) -> None:
        """Sends are waited for, so nothing of an ended transfer is in flight: resolve now."""
        if self._states.pop(st.handle, None) is None:
            return
        st.pair.states.pop(st.handle.transfer_id, None)
        for _, nbytes, _ in st.pending:
            self._budget.release(st.pair.endpoint, nbytes)
        st.pending = []
        st.handle._resolve(state, reason, self._on_done)


def _run_into(future: concurrent.futures.Future, fn: Callable[..., Any], *args: Any) -> None:
    try:
        future.set_result(fn(*args))
    except BaseException as e:
        future.set_exception(e)

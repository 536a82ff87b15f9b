"""ZeroMQ receiver (decode side): one ROUTER socket, one I/O thread that owns it.

Senders connect DEALER sockets; the ROUTER learns each sender's identity, so the
receiver can ack DONE/FAILED/EXPIRED back to exactly that sender. All reservation
state lives on the I/O thread (kv_transfer.receiver_core.QueuedKVReceiver).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kv_transfer import protocol
from kv_transfer.base import TransferResult
from kv_transfer.receiver_core import QueuedKVReceiver, ReservationTable
from kv_transfer.zmq_common import DEFAULT_ENDPOINT, CurveConfig, KeyAllowList, WakePipe, check_endpoint, common_options

logger = logging.getLogger(__name__)
_MAX_BATCH = 64  # messages handled per poll round, so deadlines and commands still get a turn


class ZmqKVReceiver(QueuedKVReceiver):
    def __init__(self, kv_caches, endpoint: str = DEFAULT_ENDPOINT, *,
                 on_done: Callable[[TransferResult], None] | None = None, curve: CurveConfig | None = None,
                 advertise_endpoint: str | None = None, rcvhwm: int = 16) -> None:
        check_endpoint(endpoint)
        self._table = ReservationTable(kv_caches, on_done)
        geo = self._table.geo
        self._curve = curve
        self._ctx = zmq.Context()
        self._auth = None
        if curve is not None:  # the ZAP handler must run before the first handshake
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", KeyAllowList(curve.allowed))
        self._sock = self._ctx.socket(zmq.ROUTER)
        common_options(self._sock)
        self._sock.rcvhwm = rcvhwm  # messages; with the frame cap below this bounds queued memory
        # No legitimate frame exceeds one layer of the whole pool; a larger one drops the peer.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max(geo.num_blocks * geo.block_bytes, protocol.MAX_HEADER_BYTES))
        if curve is not None:
            curve.apply_server(self._sock)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError:  # address in use, bad path: leave no thread or context behind
            self._sock.close(linger=0)
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()
            raise
        self._endpoint = advertise_endpoint or self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._init_commands()
        self._wake = WakePipe()
        self._closed = False  # guarded by _ids_lock
        self._stop = False  # set on the I/O thread when it dequeues "close"
        self._thread = threading.Thread(target=self._run, name="kv-recv-io", daemon=True)
        self._thread.start()  # hands the socket over (a full memory barrier, as zmq requires)

    def _post(self, *cmd: Any) -> None:
        self._cmds.put(cmd)
        self._wake.wake()

    def _is_closed(self) -> bool:
        return self._closed or not self._thread.is_alive()

    def _sender_public_key(self) -> bytes | None:
        return self._curve.public_key if self._curve else None

    def close(self, timeout_s: float = 5.0) -> None:
        with self._ids_lock:
            if self._closed:
                return
            self._closed = True
        self._post("close")
        self._thread.join(timeout_s)
        if self._auth is not None:
            self._auth.stop()
        if self._thread.is_alive():  # never hang the caller; the daemon thread dies with the process
            logger.error("KV receiver I/O thread did not stop within %.1fs", timeout_s)
            return
        self._wake.close()
        self._ctx.term()

    # --- I/O thread -------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake.read_fd, zmq.POLLIN)
        try:
            while True:
                nd = self._table.next_deadline()
                timeout_ms = 200 if nd is None else min(200, max(0, (nd - time.monotonic()) * 1000))
                events = dict(poller.poll(timeout_ms))
                if events.get(self._wake.read_fd):
                    self._wake.drain()
                self._drain_cmds()
                if self._stop:
                    break
                if events.get(self._sock):
                    # Check EVENTS rather than recv until zmq.Again: an exception per poll
                    # round is measurable CPU when each layer is one message.
                    for _ in range(_MAX_BATCH):
                        if not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                            break
                        parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        self._send_acks(self._on_message(parts))
                self._send_acks(self._table.expire(time.monotonic()))
        except Exception:  # a bug here must not leave owners waiting: fail everything
            logger.exception("KV receiver I/O thread crashed")
        finally:
            self._table.close("receiver closed")
            self._sock.close(linger=0)

    def _drain_cmds(self) -> None:
        while not self._stop:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "register":
                self._table.add(cmd[1], cmd[2], cmd[3])
            elif cmd[0] == "cancel":
                self._send_acks(self._table.cancel(cmd[1], cmd[2]))
            elif cmd[0] == "close":
                self._stop = True

    def _on_message(self, parts: list[zmq.Frame]):
        if len(parts) < 2:  # identity only: nothing to attribute
            self._table.counters["dropped_bad_header"] += 1
            return []
        peer = parts[0].bytes
        frames = [p.buffer for p in parts[2:]]
        res, h, acks = self._table.prepare(peer, parts[1].buffer, [f.nbytes for f in frames], self._drain_cmds)
        if res is None:
            return acks
        return self._table.commit(res, h, peer, frames)

    def _send_acks(self, acks: list[tuple[bytes, bytes]]) -> None:
        for peer, payload in acks:
            try:  # a vanished or slow sender must not stall the receiver: drop the ack instead
                self._sock.send_multipart([peer, payload], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

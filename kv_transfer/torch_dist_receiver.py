"""torch.distributed receiver (decode side): a TCPStore for rendezvous, one thread per sender.

Each pair thread reads messages from its sender's two-rank group. The header is
validated against the reservation before the frames are received; the frames land in
a staging buffer and are copied into the pool once (under the table lock, so a
cancel or an expiry can never be followed by a write). Rejected messages are still
drained, so the stream stays in step and the pair keeps serving other transfers.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from kv_transfer import protocol
from kv_transfer.base import TransferResult
from kv_transfer.receiver_core import QueuedKVReceiver, ReservationTable
from kv_transfer.torch_dist_common import (
    BACKENDS,
    IDLE_TIMEOUT_S,
    TAG,
    ack_key,
    comm_device,
    make_group,
    peer_key,
    wait,
)

logger = logging.getLogger(__name__)
_HOUSEKEEPING_S = 0.01  # cadence of new-peer checks, cancels and deadline expiry


class TorchDistKVReceiver(QueuedKVReceiver):
    def __init__(self, kv_caches, host: str = "127.0.0.1", port: int = 0, backend: str = "gloo", *,
                 on_done: Callable[[TransferResult], None] | None = None, frame_timeout_s: float = 30.0,
                 idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}")
        self._table = ReservationTable(kv_caches, on_done)
        self._backend, self._host = backend, host
        self._device = comm_device(backend, kv_caches[0][0].device)
        self._frame_timeout_s, self._idle_timeout_s = frame_timeout_s, idle_timeout_s
        self._max_frame = self._table.geo.num_blocks * self._table.geo.block_bytes
        # TCPStore's own server listens on every interface; hand it a socket bound to `host`.
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.create_server((host, port), family=family, backlog=128)
        port = listener.getsockname()[1]
        self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=frame_timeout_s), master_listen_fd=listener.detach())
        self._endpoint = f"{backend}://{host}:{port}"
        self._lock = threading.Lock()        # the reservation table
        self._store_lock = threading.Lock()  # our store client
        self._init_commands()
        self._acks: list[tuple[Any, bytes]] = []
        self._ack_next: dict[int, int] = {}
        self._stop = threading.Event()
        self._pair_threads: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._housekeeping, name="kv-dist-recv", daemon=True)
        self._thread.start()

    def _post(self, *cmd: Any) -> None:
        self._cmds.put(cmd)  # the housekeeping thread drains it within _HOUSEKEEPING_S

    def _is_closed(self) -> bool:
        return self._stop.is_set()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5.0)
        with self._lock:
            self._sync()
            self._table.close("receiver closed")
        # A pair thread sees the stop flag at its sender's next message or keepalive, or gives
        # up after the idle (or, while forming, the frame) timeout. Joining them keeps c10d
        # teardown out of interpreter exit, where a thread still inside it aborts the process.
        deadline = time.monotonic() + max(self._idle_timeout_s, self._frame_timeout_s) + 1.0
        for th in self._pair_threads:
            th.join(max(0.0, deadline - time.monotonic()))

    # --- background threads -------------------------------------------------------------

    def _sync(self) -> None:
        """Apply queued registrations and cancels. Caller holds self._lock."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "register":
                self._table.add(cmd[1], cmd[2], cmd[3])
            else:
                self._acks += self._table.cancel(cmd[1], cmd[2])

    def _flush_acks(self) -> None:
        with self._lock:
            acks, self._acks = self._acks, []
        with self._store_lock:
            for k, payload in acks:
                i = self._ack_next.get(k, 0)
                self._ack_next[k] = i + 1
                self._store.set(ack_key(k, i), payload)

    def _housekeeping(self) -> None:
        num_peers = 0
        while not self._stop.wait(_HOUSEKEEPING_S):
            try:
                with self._lock:
                    self._sync()
                    self._acks += self._table.expire(time.monotonic())
                self._flush_acks()
                with self._store_lock:
                    new_peer = self._store.check([peer_key(num_peers)])
                if new_peer:
                    th = threading.Thread(target=self._serve_pair, args=(num_peers,), name=f"kv-dist-pair-{num_peers}",
                                          daemon=True)
                    th.start()
                    self._pair_threads = [t for t in self._pair_threads if t.is_alive()] + [th]
                    num_peers += 1
            except Exception:
                logger.exception("KV receiver housekeeping failed")

    def _serve_pair(self, k: int) -> None:
        try:
            pg = make_group(self._store, k, 0, self._backend, self._host, self._frame_timeout_s)
        except Exception as e:
            logger.warning("KV pair %d could not form: %s", k, e)
            return
        try:
            while not self._stop.is_set():
                self._serve_message(pg, k)
        except Exception as e:  # peer gone, timeout or broken framing: its open transfers expire
            logger.info("KV pair %d closed: %s", k, e)

    def _recv(self, pg, n: int, dtype: torch.dtype, timeout_s: float) -> torch.Tensor:
        t = torch.empty(n, dtype=dtype, device=self._device)
        wait(pg.recv([t], 1, TAG), timeout_s)
        return t

    def _serve_message(self, pg, k: int) -> None:
        header_len, num_frames = self._recv(pg, 2, torch.int64, self._idle_timeout_s).tolist()
        if header_len == 0 and num_frames == 0:
            return  # keepalive
        if not 0 < header_len <= protocol.MAX_HEADER_BYTES or not 0 <= num_frames <= 2 * protocol.MAX_SPLITS:
            raise ConnectionError(f"bad preamble ({header_len}, {num_frames})")
        sizes = self._recv(pg, num_frames, torch.int64, self._frame_timeout_s).tolist() if num_frames else []
        if any(not 0 < s <= self._max_frame for s in sizes):
            raise ConnectionError("frame larger than a whole layer of the pool")
        header = self._recv(pg, header_len, torch.uint8, self._frame_timeout_s).cpu().numpy()
        with self._lock:
            res, h, acks = self._table.prepare(k, header, sizes, self._sync)
            self._acks += acks
        self._flush_acks()
        # Drain the frames even when rejected: the next message starts right after them.
        timeout = self._frame_timeout_s if res is None else res.monotonic_deadline - time.monotonic()
        frames = [self._recv(pg, s, torch.uint8, timeout) for s in sizes]
        if res is not None:
            with self._lock:
                self._acks += self._table.commit(res, h, k, frames)
            self._flush_acks()

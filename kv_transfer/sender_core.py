"""The compute-thread half every sender shares, and the per-peer byte cap.

The prefill model runner calls `send_layer` on its own thread right after a layer's
K/V is written. That call only checks, reserves bytes under the per-peer cap (the one
place it may wait, and never past the transfer's deadline) and posts a command; the
connector's I/O thread does all network work, since sockets are not thread-safe.
"""
from __future__ import annotations

import numbers
import threading
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from kv_transfer.base import HeadRange, KVSender, KVTarget, PoolGeometry, SendTransfer, check_transfer_id


class QueuedKVSender(KVSender):
    """The compute-thread half every sender shares: checks, the byte cap, and commands
    posted to the connector's I/O thread (`_post`), which does all network work."""

    _geo: PoolGeometry
    _kv: list[tuple[torch.Tensor, torch.Tensor]]
    _budget: ByteBudget
    _thread: threading.Thread  # the I/O thread; a handle started without it would never resolve
    _states: dict[SendTransfer, Any]  # open transfers, by handle
    _closed: bool = False

    @abstractmethod
    def _post(self, *cmd: Any) -> None: ...

    @abstractmethod
    def _check_endpoint(self, endpoint: str) -> None: ...

    def start(self, src_block_ids: Sequence[int], target: KVTarget | dict,
              heads: HeadRange | None = None) -> SendTransfer:
        if isinstance(target, dict):
            target = KVTarget.from_dict(target)
        check_transfer_id(target.transfer_id)
        self._check_endpoint(target.endpoint)
        src = [int(b) for b in src_block_ids]
        if any(not 0 <= b < self._geo.num_blocks for b in src):
            raise ValueError(f"source block ids must be in [0, {self._geo.num_blocks})")
        if self._closed or not self._thread.is_alive():
            raise RuntimeError("sender is closed")
        if heads is not None:
            if not isinstance(heads, HeadRange):
                raise TypeError(f"heads must be a HeadRange or None, got {type(heads).__name__}")
            fields = (heads.src_start, heads.dst_start, heads.num_heads)
            if all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in fields):
                heads = HeadRange(*(int(x) for x in fields))  # numpy ints would not survive msgpack
        error = target.geometry_error(self._geo, len(src), heads)
        heads = None if error else target.partial_heads(self._geo, heads)
        block_bytes = self._geo.block_bytes
        if heads is not None:
            block_bytes = block_bytes // self._geo.block_shape[1] * heads.num_heads
        handle = SendTransfer(target, src, heads, block_bytes)
        # A geometry mismatch still goes through the I/O thread, so every handle ends there.
        self._post("start", handle, error)
        return handle

    def send_layer(self, transfer: SendTransfer, layer_idx: int) -> bool:
        if transfer.state.terminal or transfer.future.done():
            return False
        if not 0 <= layer_idx < self._geo.num_layers or layer_idx in transfer.layers_queued:
            raise ValueError(f"layer {layer_idx} out of range or already sent")
        nbytes = 2 * len(transfer.src_block_ids) * transfer.block_bytes
        if not self._budget.acquire(transfer.target.endpoint, nbytes, transfer.monotonic_deadline,
                                    lambda: transfer.state.terminal):
            return False  # deadline or end reached while waiting; the I/O thread ends it
        transfer.layers_queued.add(layer_idx)
        ready = None
        if self._kv[0][0].is_cuda:  # the layer's kernels may still run: the I/O thread waits on this
            ready = torch.cuda.Event()
            ready.record()
        self._post("layer", transfer, layer_idx, nbytes, ready)
        return True

    def finish(self, transfer: SendTransfer) -> None:
        self._post("finish", transfer, len(transfer.layers_queued))

    def abort(self, transfer: SendTransfer, reason: str = "aborted") -> None:
        self._post("abort", transfer, reason)

    def _wire_slice(self, transfer: SendTransfer) -> tuple[tuple[int, ...], int]:
        """(the block shape its messages carry, the receiver's first head they land in)."""
        if transfer.heads is None:
            return self._geo.block_shape, 0
        block_size, _, head_dim = self._geo.block_shape
        return (block_size, transfer.heads.num_heads, head_dim), transfer.heads.dst_start

    def pending_bytes(self) -> int:
        """Bytes queued or still inside the transport, over all peers (0 when idle)."""
        return self._budget.pending()

    def num_open(self) -> int:
        """Transfers started and not yet ended."""
        return len(self._states)

    def _stop_io_thread(self, timeout_s: float) -> bool:
        """Ask the I/O thread to stop and wait up to timeout_s; False if already closed."""
        if self._closed:
            return False
        self._closed = True
        self._post("close")
        self._thread.join(timeout_s)
        return True


@dataclass
class ByteBudget:
    """Caps bytes queued-but-not-released per peer; the compute thread waits here, bounded."""

    cap: int
    on_wait: Callable[[], None] | None = None  # a caller starts waiting: wake whoever releases bytes
    num_waiting: int = 0
    _pending: dict[str, int] = field(default_factory=dict)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def acquire(self, peer: str, nbytes: int, monotonic_deadline: float, is_cancelled: Callable[[], bool]) -> bool:
        with self._cond:
            waiting = False
            try:
                # One message larger than the cap is let through alone, else it could never go.
                while self._pending.get(peer, 0) > 0 and self._pending.get(peer, 0) + nbytes > self.cap:
                    left = monotonic_deadline - time.monotonic()
                    if left <= 0 or is_cancelled():
                        return False
                    if not waiting:
                        waiting, self.num_waiting = True, self.num_waiting + 1
                        if self.on_wait is not None:
                            self.on_wait()
                    self._cond.wait(min(left, 0.1))
                self._pending[peer] = self._pending.get(peer, 0) + nbytes
                return True
            finally:
                self.num_waiting -= waiting

    def release(self, peer: str, nbytes: int) -> None:
        with self._cond:
            self._pending[peer] = self._pending.get(peer, 0) - nbytes
            self._cond.notify_all()

    def pending(self, peer: str | None = None) -> int:
        with self._cond:
            return sum(self._pending.values()) if peer is None else self._pending.get(peer, 0)

"""Connector interface shared by every KV transport.

Decode owns the destination blocks: it `register`s an expected transfer with its
`KVReceiver`, which hands back a `KVTarget` (plain data, msgpack/JSON-able so it can
ride inside an RPC). Prefill gives that target and its own source block ids to its
`KVSender`, pushes layers as they are computed, and frees its source blocks only once
the transfer's future has resolved. Both futures are `concurrent.futures.Future`s so
asyncio code can `await handle` without blocking its loop.
"""
from __future__ import annotations

import concurrent.futures
import enum
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

logger = logging.getLogger(__name__)

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [num_blocks, *block_shape]

# Wire names of the dtypes a pool may hold; anything else is rejected on both sides.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_TRANSFER_ID_LEN = 256


class TransferState(str, enum.Enum):
    WAITING = "waiting"            # registered / started, no byte moved yet
    TRANSFERRING = "transferring"  # at least one message accepted / sent
    DONE = "done"                  # receiver holds every block of every layer
    FAILED = "failed"              # rejected message, cancel, peer lost, local error
    EXPIRED = "expired"            # deadline passed before DONE

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED, TransferState.EXPIRED)


@dataclass(frozen=True)
class PoolGeometry:
    """What both ends must agree on; derived from a `kv_caches` list."""

    num_layers: int
    num_blocks: int
    dtype: str
    block_shape: tuple[int, ...]  # [block_size, num_kv_heads, head_dim]

    @property
    def block_bytes(self) -> int:  # bytes of one block of K (or of V) in one layer
        n = DTYPES[self.dtype].itemsize
        for d in self.block_shape:
            n *= d
        return n

    def kv_bytes(self, num_blocks: int, num_layers: int | None = None) -> int:
        """Bytes of K and V of num_blocks blocks in num_layers layers (default: all)."""
        return 2 * (self.num_layers if num_layers is None else num_layers) * num_blocks * self.block_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers, "num_blocks": self.num_blocks, "dtype": self.dtype,
                "block_shape": list(self.block_shape)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PoolGeometry":
        return cls(int(d["num_layers"]), int(d["num_blocks"]), d["dtype"], tuple(int(s) for s in d["block_shape"]))

    @classmethod
    def of(cls, kv_caches: KVCaches) -> "PoolGeometry":
        if not kv_caches:
            raise ValueError("kv_caches is empty")
        k0 = kv_caches[0][0]
        if k0.dtype not in DTYPE_NAMES:
            raise ValueError(f"unsupported KV dtype {k0.dtype}")
        for k, v in kv_caches:
            for t in (k, v):
                # Frames are sliced straight out of the pool, so every block must be dense.
                if t.shape != k0.shape or t.dtype != k0.dtype or t.device != k0.device or not t.is_contiguous():
                    raise ValueError("every K/V tensor must be contiguous with one shape, dtype and device")
        return cls(len(kv_caches), k0.shape[0], DTYPE_NAMES[k0.dtype], tuple(k0.shape[1:]))


def pool_bytes(kv_caches: KVCaches) -> list[tuple[Any, Any]] | None:
    """Per layer (K, V) flat uint8 numpy views of a CPU pool (None for a device pool).

    Made once: slicing these costs far less per frame than building views through torch,
    and copying through numpy is a plain single-threaded memcpy that releases the GIL.
    """
    if kv_caches[0][0].device.type != "cpu":
        return None
    return [tuple(t.view(-1).view(torch.uint8).numpy() for t in kv) for kv in kv_caches]


@dataclass(frozen=True)
class HeadRange:
    """KV heads a send carries: the sender pool's heads [src_start, src_start + num_heads)
    land in the receiver pool's heads [dst_start, dst_start + num_heads)."""
    src_start: int
    dst_start: int
    num_heads: int


@dataclass(frozen=True)
class KVTarget:
    """Everything a sender needs to reach one reservation; `to_dict()` is msgpack-able."""

    transfer_id: str
    endpoint: str                  # tcp://host:port, ipc:///path, or gloo://host:port
    dst_block_ids: tuple[int, ...]
    num_layers: int
    dtype: str
    block_shape: tuple[int, ...]
    deadline: float                # wall clock, unix seconds
    server_public_key: str | None = None  # CurveZMQ key of the receiver (Z85), if any

    def to_dict(self) -> dict[str, Any]:
        return {"transfer_id": self.transfer_id, "endpoint": self.endpoint,
                "dst_block_ids": list(self.dst_block_ids), "num_layers": self.num_layers,
                "dtype": self.dtype, "block_shape": list(self.block_shape),
                "deadline": self.deadline, "server_public_key": self.server_public_key}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVTarget":
        t = cls(transfer_id=d["transfer_id"], endpoint=d["endpoint"],
                dst_block_ids=tuple(int(b) for b in d["dst_block_ids"]), num_layers=int(d["num_layers"]),
                dtype=d["dtype"], block_shape=tuple(int(s) for s in d["block_shape"]),
                deadline=float(d["deadline"]), server_public_key=d.get("server_public_key"))
        if not isinstance(t.transfer_id, str) or not isinstance(t.endpoint, str) or t.dtype not in DTYPES:
            raise ValueError("malformed KV target")
        return t

    def geometry_error(self, geo: PoolGeometry, num_src_blocks: int, heads: HeadRange | None = None) -> str | None:
        """Why the sender pool `geo` cannot send these blocks (and heads) to this target, or None."""
        mine, theirs = (self.num_layers, self.dtype, self.block_shape), (geo.num_layers, geo.dtype, geo.block_shape)
        if heads is not None:
            if not len(self.block_shape) == len(geo.block_shape) == 3:
                return "a head range needs [block_size, num_kv_heads, head_dim] blocks on both sides"
            # Only the head counts may differ.
            mine, theirs = mine[:2] + (self.block_shape[::2],), theirs[:2] + (geo.block_shape[::2],)
        if mine != theirs:
            return (f"pool mismatch: target has {self.num_layers} layers {self.dtype} {list(self.block_shape)}, "
                    f"sender has {geo.num_layers} layers {geo.dtype} {list(geo.block_shape)}")
        if num_src_blocks != len(self.dst_block_ids):
            return f"{num_src_blocks} source blocks for {len(self.dst_block_ids)} destination blocks"
        if heads is None:
            return None
        ints = (heads.src_start, heads.dst_start, heads.num_heads)
        if any(type(x) is not int for x in ints) or heads.num_heads < 1 or min(ints) < 0:
            return f"bad head range {heads}: starts must be ints >= 0 and num_heads >= 1"
        if heads.src_start + heads.num_heads > geo.block_shape[1]:
            return (f"head range {heads} runs past the sender's {geo.block_shape[1]} heads "
                    f"(heads [{heads.src_start}, {heads.src_start + heads.num_heads}))")
        if heads.dst_start + heads.num_heads > self.block_shape[1]:
            return (f"head range {heads} runs past the receiver's {self.block_shape[1]} heads "
                    f"(heads [{heads.dst_start}, {heads.dst_start + heads.num_heads}))")
        return None

    def partial_heads(self, geo: PoolGeometry, heads: HeadRange | None) -> HeadRange | None:
        """`heads` when it is a true slice; None when it covers every head on both sides
        (a valid range assumed), which then travels as whole blocks, zero-copy."""
        if heads is None or (heads.src_start == heads.dst_start == 0
                             and heads.num_heads == geo.block_shape[1] == self.block_shape[1]):
            return None
        return heads


@dataclass(frozen=True)
class TransferResult:
    transfer_id: str
    state: TransferState
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.state is TransferState.DONE


class TransferHandle:
    """One transfer as its owner sees it. `future` resolves exactly once with a TransferResult."""

    def __init__(self, transfer_id: str) -> None:
        self.transfer_id = transfer_id
        self.state = TransferState.WAITING  # written by the connector's I/O thread only
        self.future: concurrent.futures.Future[TransferResult] = concurrent.futures.Future()
        # RUNNING from the start: future.cancel() is then refused, so only the connector can
        # end a transfer (a cancelled future would look finished while blocks are in use).
        self.future.set_running_or_notify_cancel()
        # Monotonic timestamps for metrics: created, first KV message landed (receivers), ended.
        self.started_at = time.monotonic()
        self.first_byte_at: float | None = None
        self.ended_at: float | None = None

    def result(self, timeout: float | None = None) -> TransferResult:
        return self.future.result(timeout)

    def __await__(self):
        import asyncio
        # shield: a cancelled awaiter must not cancel the transfer's own future,
        # or the transfer would look finished while the I/O thread still touches
        # its blocks and the owner would free them too early.
        return asyncio.shield(asyncio.wrap_future(self.future)).__await__()

    def _resolve(self, state: TransferState, reason: str,
                 on_done: Callable[[TransferResult], None] | None) -> TransferResult:
        self.state = state
        res = TransferResult(self.transfer_id, state, reason)
        if not self.future.done():
            self.ended_at = time.monotonic()  # before the result: its callbacks read it
            self.future.set_result(res)
        if on_done is not None:
            try:
                on_done(res)
            except Exception:  # the owner's bug must not kill the connector's I/O thread
                logger.exception("on_done callback failed for transfer %s", self.transfer_id)
        return res


class RecvTransfer(TransferHandle):
    def __init__(self, target: KVTarget) -> None:
        super().__init__(target.transfer_id)
        self.target = target


class SendTransfer(TransferHandle):
    def __init__(self, target: KVTarget, src_block_ids: Sequence[int], heads: HeadRange | None = None,
                 block_bytes: int = 0) -> None:
        super().__init__(target.transfer_id)
        self.target = target
        self.src_block_ids = tuple(int(b) for b in src_block_ids)
        self.heads = heads              # None: every head, whole blocks; else the slice this transfer carries
        self.block_bytes = block_bytes  # bytes one block of K (or V) of one layer puts on the wire
        self.layers_queued: set[int] = set()  # touched by the compute thread only
        self.monotonic_deadline = time.monotonic() + (target.deadline - time.time())


def check_transfer_id(transfer_id: Any) -> None:
    if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= MAX_TRANSFER_ID_LEN:
        raise ValueError(f"transfer id must be a non-empty str of at most {MAX_TRANSFER_ID_LEN} chars")


class KVReceiver(ABC):
    """Decode side. `on_done(result)` runs on the connector's thread; hop threads yourself."""

    @property
    @abstractmethod
    def endpoint(self) -> str: ...

    @abstractmethod
    def register(self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float) -> RecvTransfer:
        """Expect a transfer into `dst_block_ids` (all layers, all heads) within `timeout_s`. Never
        blocks. Several senders may fill it, each with its own disjoint head range."""

    @abstractmethod
    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        """Fail the transfer; its future resolves once no write into its blocks can follow."""

    @abstractmethod
    def stats(self) -> dict[str, int]: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KVSender(ABC):
    """Prefill side. `send_layer` is called on the compute thread; I/O runs on a background thread."""

    @abstractmethod
    def start(self, src_block_ids: Sequence[int], target: KVTarget | dict,
              heads: HeadRange | None = None) -> SendTransfer:
        """Begin a transfer; the handle's future resolves (DONE or not) once the source blocks are free.

        `heads` sends only that head range of each block (tensor-parallel pools of different
        sizes); None sends every head, which the target's pool must then match exactly."""

    @abstractmethod
    def send_layer(self, transfer: SendTransfer, layer_idx: int) -> bool:
        """Queue one layer (final after its forward). Blocks only while the per-peer byte cap is
        full, and never past the transfer's deadline. False if the transfer already ended."""

    @abstractmethod
    def finish(self, transfer: SendTransfer) -> None:
        """Every layer has been queued; a missing layer fails the transfer now, not at its deadline."""

    @abstractmethod
    def abort(self, transfer: SendTransfer, reason: str = "aborted") -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def send_all(self, src_block_ids: Sequence[int], target: KVTarget | dict,
                 heads: HeadRange | None = None) -> SendTransfer:
        """Whole-request send, for when layer-wise pipelining is off."""
        t = self.start(src_block_ids, target, heads)
        for layer in range(t.target.num_layers):
            if not self.send_layer(t, layer):
                break
        self.finish(t)
        return t

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

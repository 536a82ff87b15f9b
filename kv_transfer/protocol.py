"""Wire schema of a KV message, its validation, and how blocks are cut into frames.

A KV message is one msgpack header followed by raw frames. It covers blocks
[first, first + nblk) of the transfer's block list in layers [layer, layer + nlay),
and of each block the receiver's KV heads [h0, h0 + nh); `shape` is that slice of one
block, [block_size, nh, head_dim]. Per layer come the K frames, then the V frames, one
per entry of `splits` (block counts summing to `nblk`), each holding its blocks' slices
back to back. `nlay` > 1 batches small layers into one message, since each message
costs tens of microseconds on both ends. Several senders may fill one reservation,
each with its own disjoint head range; sequence numbers and block order are per range.
Headers are decoded with hard size limits and checked against a strict schema; nothing
is ever unpickled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import msgpack

from kv_transfer.base import DTYPES, MAX_TRANSFER_ID_LEN

VERSION = 2
MAX_HEADER_BYTES = 64 << 10
MAX_SPLITS = 4096          # frames per message / 2; the planner never gets near it
MAX_REASON_LEN = 1024
MAX_INT = 1 << 31
OPS = ("kv", "abort", "ack")
_KEYS = {
    "kv": {"v", "op", "tid", "seq", "layer", "nlay", "first", "nblk", "h0", "nh", "dtype", "shape", "splits"},
    "abort": {"v", "op", "tid", "seq", "reason"},
    "ack": {"v", "op", "tid", "state", "reason"},
}


class ProtocolError(ValueError):
    """A header we cannot even attribute to a transfer, or one that breaks the schema."""

    def __init__(self, msg: str, transfer_id: str | None = None) -> None:
        super().__init__(msg)
        self.transfer_id = transfer_id


@dataclass(frozen=True)
class Header:
    op: str
    transfer_id: str
    seq: int = 0
    layer: int = 0
    num_layers: int = 1
    first: int = 0
    num_blocks: int = 0
    dtype: str = ""
    block_shape: tuple[int, ...] = ()
    splits: tuple[int, ...] = ()
    head_start: int = 0  # kv only: the receiver's heads [head_start, head_start + num_heads)
    num_heads: int = 0
    state: str = ""   # ack only: done / failed / expired
    reason: str = ""  # abort and ack


def encode_kv(transfer_id: str, seq: int, layer: int, first: int, num_blocks: int, dtype: str,
              block_shape: Sequence[int], splits: Sequence[int], num_layers: int = 1, head_start: int = 0) -> bytes:
    """`block_shape` is the slice of one block that travels, [block_size, num_heads, head_dim]."""
    return msgpack.packb({"v": VERSION, "op": "kv", "tid": transfer_id, "seq": seq, "layer": layer,
                          "nlay": num_layers, "first": first, "nblk": num_blocks,
                          "h0": head_start, "nh": block_shape[1] if len(block_shape) > 1 else 1,
                          "dtype": dtype, "shape": list(block_shape), "splits": list(splits)})


def encode_abort(transfer_id: str, seq: int, reason: str) -> bytes:
    return msgpack.packb({"v": VERSION, "op": "abort", "tid": transfer_id, "seq": seq,
                          "reason": reason[:MAX_REASON_LEN]})


def encode_ack(transfer_id: str, state: str, reason: str) -> bytes:
    return msgpack.packb({"v": VERSION, "op": "ack", "tid": transfer_id, "state": state,
                          "reason": reason[:MAX_REASON_LEN]})


def _int(x: Any, name: str, tid: str, lo: int = 0) -> int:
    if type(x) is not int or not lo <= x < MAX_INT:  # bool is an int subclass; refuse it
        raise ProtocolError(f"header field {name!r} must be an int in [{lo}, 2^31)", tid)
    return x


def decode(buf: Any) -> Header:
    """Decode and schema-check one header frame. Raises ProtocolError, never anything else."""
    if memoryview(buf).nbytes > MAX_HEADER_BYTES:
        raise ProtocolError("header frame too large")
    try:
        d = msgpack.unpackb(buf, raw=False, strict_map_key=True, use_list=True, max_str_len=4 * MAX_REASON_LEN,
                            max_bin_len=0, max_array_len=MAX_SPLITS, max_map_len=16, max_ext_len=0)
    except Exception as e:  # msgpack raises many types (ValueError, ExtraData, StackError, ...)
        raise ProtocolError(f"undecodable header: {type(e).__name__}") from None
    if not isinstance(d, dict) or d.get("op") not in OPS:
        raise ProtocolError("header is not a KV message")
    tid = d.get("tid")
    if not isinstance(tid, str) or not 0 < len(tid) <= MAX_TRANSFER_ID_LEN:
        raise ProtocolError("header has no valid transfer id")
    op = d["op"]
    # From here on the message is attributable: errors carry the transfer id.
    if set(d) != _KEYS[op] or d["v"] != VERSION:
        raise ProtocolError(f"header fields {sorted(d)} do not match {op!r} v{VERSION}", tid)
    if op in ("abort", "ack"):
        reason, state = d["reason"], d.get("state", "")
        if not isinstance(reason, str) or not isinstance(state, str):
            raise ProtocolError("reason/state must be strings", tid)
        return Header(op, tid, seq=_int(d["seq"], "seq", tid) if op == "abort" else 0, state=state, reason=reason)
    shape, splits = d["shape"], d["splits"]
    if (not isinstance(shape, list) or not 0 < len(shape) <= 8 or not isinstance(splits, list)
            or not isinstance(d["dtype"], str)):
        raise ProtocolError("dtype/shape/splits have wrong types", tid)
    for x in shape:
        _int(x, "shape", tid, lo=1)
    for x in splits:
        _int(x, "splits", tid, lo=1)
    return Header("kv", tid, seq=_int(d["seq"], "seq", tid), layer=_int(d["layer"], "layer", tid),
                  num_layers=_int(d["nlay"], "nlay", tid, lo=1),
                  first=_int(d["first"], "first", tid), num_blocks=_int(d["nblk"], "nblk", tid, lo=1),
                  dtype=d["dtype"], block_shape=tuple(shape), splits=tuple(splits),
                  head_start=_int(d["h0"], "h0", tid), num_heads=_int(d["nh"], "nh", tid, lo=1))


def check_kv(h: Header, frame_sizes: Sequence[int], *, next_seq: int, num_layers: int, dtype: str,
             block_shape: tuple[int, ...], block_bytes: int, num_dst_blocks: int,
             blocks_done: Sequence[int]) -> str | None:
    """Why this KV message cannot be written into its reservation, or None if it can.

    `block_shape` and `block_bytes` are the reservation's whole block ([block_size,
    num_kv_heads, head_dim]); `next_seq` and `blocks_done[l]` (how many blocks of layer l
    already landed) belong to the message's head range. Blocks of a layer must arrive in
    order, so any overlap, a repeated layer or a repeated message shows up as a wrong
    `first` or `seq`. Overlap between head ranges is the reservation's to check.
    """
    num_heads = block_shape[1] if len(block_shape) > 1 else 1
    if h.head_start + h.num_heads > num_heads:
        return (f"heads [{h.head_start}, {h.head_start + h.num_heads}) run past the reservation's "
                f"{num_heads} heads")
    if h.seq != next_seq:
        return f"sequence number {h.seq}, expected {next_seq} (lost, repeated or reordered message)"
    if h.layer + h.num_layers > num_layers:
        return f"layer index {h.layer + h.num_layers - 1} out of range (reservation has {num_layers} layers)"
    if h.dtype != dtype or h.dtype not in DTYPES:
        return f"dtype {h.dtype!r} differs from the reservation's {dtype!r}"
    slice_shape = block_shape[:1] + (h.num_heads,) + block_shape[2:] if len(block_shape) > 1 else block_shape
    if h.block_shape != slice_shape:
        return (f"block shape {list(h.block_shape)} differs from the reservation's {list(block_shape)} "
                f"cut to {h.num_heads} heads")
    for layer in range(h.layer, h.layer + h.num_layers):
        if blocks_done[layer] >= num_dst_blocks:
            return f"duplicate layer {layer}"
        if h.first != blocks_done[layer]:
            return f"layer {layer} blocks start at {h.first}, expected {blocks_done[layer]}"
    if h.first + h.num_blocks > num_dst_blocks:
        return f"blocks [{h.first}, {h.first + h.num_blocks}) overflow the reservation of {num_dst_blocks}"
    if sum(h.splits) != h.num_blocks:
        return f"splits sum to {sum(h.splits)}, header says {h.num_blocks} blocks"
    if len(frame_sizes) != 2 * h.num_layers * len(h.splits):
        return (f"{len(frame_sizes)} data frames, expected {2 * h.num_layers * len(h.splits)} "
                f"(truncated or extra frame)")
    slice_bytes = block_bytes // num_heads * h.num_heads
    for i, size in enumerate(frame_sizes):
        want = h.splits[i % len(h.splits)] * slice_bytes
        if size != want:
            return f"data frame {i} has {size} bytes, expected {want} (truncated or extra bytes)"
    return None


@dataclass(frozen=True)
class Piece:
    """Blocks [first, first + num_blocks) of the transfer list that travel as one frame."""

    first: int
    num_blocks: int
    src_start: int | None  # pool id of a contiguous run: sent as a zero-copy view; None: gathered


@dataclass(frozen=True)
class MessagePlan:
    first: int
    num_blocks: int
    pieces: tuple[Piece, ...]


def plan_messages(src_block_ids: Sequence[int], block_bytes: int, max_message_bytes: int,
                  gather_below_bytes: int) -> list[MessagePlan]:
    """Cut one layer's blocks into messages of <= max_message_bytes (K + V) and frames.

    Runs of consecutive pool ids become zero-copy views; runs smaller than
    `gather_below_bytes` (zmq would copy them anyway) are merged with their small
    neighbours into one gathered frame, so a fragmented pool still sends few frames.
    The plan depends only on the block ids, so it is computed once per transfer.
    """
    max_blocks = max(1, max_message_bytes // (2 * block_bytes))
    runs: list[tuple[int, int, int]] = []  # (list index, pool id, length)
    for i, b in enumerate(src_block_ids):
        if runs and b == runs[-1][1] + runs[-1][2] and i - runs[-1][0] == runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, b, 1))
    plans: list[MessagePlan] = []
    pieces: list[list] = []  # [first, num_blocks, src_start, runs merged, big]
    msg_first = msg_blocks = 0

    def close_message() -> None:
        # A "gathered" piece holding a single run is just a view: nothing to merge.
        plans.append(MessagePlan(msg_first, msg_blocks, tuple(
            Piece(f, n, start if big or merged == 1 else None) for f, n, start, merged, big in pieces)))

    for first, start, length in runs:
        while length > 0:
            n = min(length, max_blocks - msg_blocks)
            big = n * block_bytes >= gather_below_bytes
            if not big and pieces and not pieces[-1][4]:
                pieces[-1][1] += n  # extend the gathered frame of small neighbours
                pieces[-1][3] += 1
            else:
                pieces.append([first, n, start, 1, big])
            msg_blocks += n
            first, start, length = first + n, start + n, length - n
            if msg_blocks == max_blocks:
                close_message()
                pieces, msg_first, msg_blocks = [], msg_first + msg_blocks, 0
    if msg_blocks:
        close_message()
    return plans

"""Which prefill rank sends which KV heads to which decode rank, for any pair of
tensor-parallel sizes (NIXL's heterogeneous TP, beyond vLLM's P2P-NCCL connector that
needs equal sizes).

Under TP every rank's pool holds a contiguous range of the model's KV heads, split
evenly, or with more ranks than heads one head replicated on adjacent ranks
(kv_head_partition). A decode rank needs each of its heads from exactly one prefill
rank; where several prefill ranks hold a head (replicas) the decode ranks are spread
over them. Both ranges are contiguous, so one (prefill rank, decode rank) pair carries
at most one contiguous slice. No tensors: the prefill's handshake check and every
sending rank compute the same plan from the same three numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.engine.models.parallel_layers import kv_head_partition


class KVLayoutMismatchError(ValueError):
    """Two pools whose KV heads cannot be mapped onto each other."""


@dataclass(frozen=True)
class HeadSlice:
    """Prefill rank src_rank's local heads [src_start, src_start + num_heads) are decode
    rank dst_rank's local heads [dst_start, dst_start + num_heads)."""

    src_rank: int
    dst_rank: int
    src_start: int
    dst_start: int
    num_heads: int


def check_tp_size(num_kv_heads: int, tp_size: int) -> None:
    if tp_size < 1:
        raise KVLayoutMismatchError(f"tensor parallel size must be >= 1, got {tp_size}")
    if (tp_size < num_kv_heads and num_kv_heads % tp_size) or (tp_size >= num_kv_heads and tp_size % num_kv_heads):
        raise KVLayoutMismatchError(f"{num_kv_heads} KV heads cannot be split over {tp_size} tensor-parallel ranks")


def heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    check_tp_size(num_kv_heads, tp_size)
    return kv_head_partition(num_kv_heads, 0, tp_size)[1]


def plan_head_slices(num_kv_heads: int, src_tp_size: int, dst_tp_size: int) -> list[HeadSlice]:
    """Every slice of the transfer from a src_tp_size pool to a dst_tp_size pool, ordered by
    decode rank then head: together they cover each decode rank's heads exactly once."""
    check_tp_size(num_kv_heads, src_tp_size)
    check_tp_size(num_kv_heads, dst_tp_size)
    src_ranges = [kv_head_partition(num_kv_heads, r, src_tp_size) for r in range(src_tp_size)]
    slices: list[HeadSlice] = []
    for dst_rank in range(dst_tp_size):
        dst_first, dst_count = kv_head_partition(num_kv_heads, dst_rank, dst_tp_size)
        for head in range(dst_first, dst_first + dst_count):
            holders = [r for r, (first, count) in enumerate(src_ranges) if first <= head < first + count]
            src_rank = holders[dst_rank % len(holders)]
            src_start, dst_start = head - src_ranges[src_rank][0], head - dst_first
            last = slices[-1] if slices else None
            if (last is not None and last.dst_rank == dst_rank and last.src_rank == src_rank
                    and last.src_start + last.num_heads == src_start and last.dst_start + last.num_heads == dst_start):
                slices[-1] = HeadSlice(src_rank, dst_rank, last.src_start, last.dst_start, last.num_heads + 1)
            else:
                slices.append(HeadSlice(src_rank, dst_rank, src_start, dst_start, 1))
    return slices


def check_pool_pairing(*, num_kv_heads: int, head_dim: int, block_size: int, src_tp_size: int,
                       dst_tp_size: int, dst_block_shape: list[int] | tuple[int, ...]) -> None:
    """Raise KVLayoutMismatchError, naming both layouts, unless a src_tp_size pool of this
    model can fill a dst_tp_size pool whose ranks' blocks are dst_block_shape
    ([block_size, local KV heads, head_dim])."""
    try:
        want = [block_size, heads_per_rank(num_kv_heads, dst_tp_size), head_dim]
        plan_head_slices(num_kv_heads, src_tp_size, dst_tp_size)
    except KVLayoutMismatchError as e:
        raise KVLayoutMismatchError(f"KV layouts cannot be mapped: {e}") from None
    if list(dst_block_shape) != want:
        raise KVLayoutMismatchError(
            f"KV layouts cannot be mapped: {dst_tp_size} decode rank(s) with blocks {list(dst_block_shape)}, but "
            f"{num_kv_heads} KV heads of {head_dim} over {dst_tp_size} rank(s) in blocks of {block_size} make "
            f"{want}; this prefill instance runs tensor parallel size {src_tp_size}")

"""Triton paged attention: decode (one query per sequence) and ragged causal prefill.

Both kernels walk the cache in tiles of BLOCK_N token positions and look each
position's block up in the block table, so a tile may span several cache blocks and
any block_size works (tl.dot needs tiles of at least 16). Softmax is the online
(flash) form in base 2 with fp32 statistics and accumulator. Dots use "ieee"
precision: for fp32 inputs it avoids TF32's 1e-3 error, for fp16/bf16 it is ignored.

The Triton interpreter (CPU tests) multiplies bfloat16 bit patterns in tl.dot
(triton-lang/triton#11584, unsupported upstream), so under it bf16 tiles are cast to
fp32 first (UPCAST); compiled GPU code never takes that branch.

A cache of fp8 codes (E4M3 / E5M2, no scales) is widened tile by tile to the query's
dtype, exactly: both formats' values are bf16 and fp32 values (WIDEN).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
                 start, seq_len, q_pos, dim_ids, head_dim,
                 stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
                 scale_log2, CAUSAL: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, WIDEN: tl.constexpr):
    """Fold key positions [start, start + BLOCK_N) into the running softmax state."""
    positions = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    pos_mask = positions < seq_len
    block_ids = tl.load(block_table_ptr + positions // BLOCK_SIZE, mask=pos_mask, other=0)
    # int64 so block_id * stride cannot overflow on large pools.
    block_ids = block_ids.to(tl.int64)
    block_offsets = positions % BLOCK_SIZE
    kv_mask = pos_mask[:, None] & (dim_ids[None, :] < head_dim)
    k = tl.load(k_cache_ptr + block_ids[:, None] * stride_kb + block_offsets[:, None] * stride_ko
                + kv_head * stride_kh + dim_ids[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(v_cache_ptr + block_ids[:, None] * stride_vb + block_offsets[:, None] * stride_vo
                + kv_head * stride_vh + dim_ids[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    if WIDEN:  # to q's dtype: fp32 under UPCAST, else the model's
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [BLOCK_M, BLOCK_N]
    visible = pos_mask[None, :]
    if CAUSAL:
        visible = visible & (positions[None, :] <= q_pos[:, None])
    scores = tl.where(visible, scores, float("-inf"))
    # Every row sees key 0 in the first tile, so m_new is finite from then on.
    m_new = tl.maximum(m_i, tl.max(scores, 1))  # [BLOCK_M]
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


# Triton compiles a variant per value class (1, a multiple of 16, other) of each int
# argument; block_tables' row stride (the step's widest block table) and num_seqs change
# from step to step, and each new class would compile mid-serving (~0.5 s on a GPU).
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale_log2,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_bt,
    head_dim, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, WIDEN: tl.constexpr,
):
    # One program per (sequence, kv head): the GQA group shares each K/V load.
    seq_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    group_ids = tl.arange(0, BLOCK_G)
    dim_ids = tl.arange(0, BLOCK_D)
    head_ids = kv_head * GROUP + group_ids  # [BLOCK_G]
    qo_mask = (group_ids[:, None] < GROUP) & (dim_ids[None, :] < head_dim)
    q = tl.load(q_ptr + seq_idx * stride_qs + head_ids[:, None] * stride_qh + dim_ids[None, :],
                mask=qo_mask, other=0.0)  # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_table_ptr = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt
    for start in range(0, seq_len, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, start, seq_len,
            group_ids, dim_ids, head_dim, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo,
            stride_vh, scale_log2, CAUSAL=False, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N,
            WIDEN=WIDEN)
    # seq_len 0 (batch padding) leaves l_i at 0: write zeros rather than NaN.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + seq_idx * stride_os + head_ids[:, None] * stride_oh + dim_ids[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qo_mask)


@triton.jit
def _find_seq_idx(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_M: tl.constexpr):
    # Sequence i owns tiles [qsl[i] // BLOCK_M + i, qsl[i+1] // BLOCK_M + i + 1), which is at
    # least cdiv(query_len, BLOCK_M) tiles; binary-search the last start <= tile_idx.
    # Typed so both stay int32 loop-carried values even if num_seqs gets specialised.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])  # see _decode_kernel
def _prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr,
    seq_lens_ptr, scale_log2, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_bt,
    head_dim, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, WIDEN: tl.constexpr,
):
    # One program per (query tile of one sequence, q head); the grid has a few spare
    # tiles (see _find_seq_idx) that exit at once, so no max_query_len sync is needed.
    tile_idx = tl.program_id(0)
    head = tl.program_id(1)
    seq_idx = _find_seq_idx(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_M)
    if seq_idx < 0:
        return
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    query_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    m_start = (tile_idx - (q_start // BLOCK_M + seq_idx)) * BLOCK_M
    if m_start >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - query_len
    kv_head = head // GROUP
    row_ids = m_start + tl.arange(0, BLOCK_M)  # [BLOCK_M], index within this sequence's queries
    dim_ids = tl.arange(0, BLOCK_D)
    qo_mask = (row_ids[:, None] < query_len) & (dim_ids[None, :] < head_dim)
    token_ids = (q_start + row_ids).to(tl.int64)  # [BLOCK_M]
    q = tl.load(q_ptr + token_ids[:, None] * stride_qt + head * stride_qh + dim_ids[None, :],
                mask=qo_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context_len + row_ids  # [BLOCK_M], absolute positions
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table_ptr = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt
    # Keys past this tile's last query position are masked for every row: stop there.
    kv_end = tl.minimum(seq_len, context_len + m_start + BLOCK_M)
    for start in range(0, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, start, seq_len,
            q_pos, dim_ids, head_dim, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo,
            stride_vh, scale_log2, CAUSAL=True, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N,
            WIDEN=WIDEN)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + token_ids[:, None] * stride_ot + head * stride_oh + dim_ids[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qo_mask)


def _upcast(q: torch.Tensor) -> bool:
    # Only the interpreter (non-CUDA tensors) needs the bf16 workaround.
    return q.dtype == torch.bfloat16 and q.device.type != "cuda"


def _widen(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the tiles read from the cache take the query's compute dtype first: fp8
    codes, or bf16 values under the interpreter (_upcast)."""
    return k_cache.dtype != q.dtype or _upcast(q)


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    return (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))


def decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_seqs, num_q_heads, head_dim]
    if num_seqs == 0:
        return out
    _decode_kernel[(num_seqs, num_kv_heads)](
        out, q, k_cache, v_cache, block_tables, seq_lens, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *_cache_strides(k_cache, v_cache), block_tables.stride(0),
        head_dim, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot wants >= 16 rows
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=64 if q.element_size() <= 2 else 32,
        UPCAST=_upcast(q), WIDEN=_widen(q, k_cache),
    )
    return out


def prefill_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                             scale) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_tokens, num_q_heads, head_dim]
    if num_tokens == 0 or num_seqs == 0:
        return out
    # fp32 tiles are twice the bytes: halve them to stay within shared memory.
    block_m = 64 if q.element_size() <= 2 else 32
    num_tiles = num_tokens // block_m + num_seqs
    _prefill_kernel[(num_tiles, num_q_heads)](
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale * _LOG2E,
        num_seqs, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *_cache_strides(k_cache, v_cache), block_tables.stride(0),
        head_dim, GROUP=num_q_heads // k_cache.shape[2], BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_m, UPCAST=_upcast(q), WIDEN=_widen(q, k_cache),
    )
    return out

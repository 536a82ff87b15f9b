"""Plain-torch paged attention: the reference for the Triton kernels and the CPU path.

Inputs are validated by kernels.attention; here we only compute. Half-precision
inputs are upcast to fp32 so the reference is as exact as the dtype allows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_Q_CHUNK = 128  # query rows per SDPA call in prefill (measured on CPU, see below)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, H, D], block_table [..., n] -> [..., n * block_size, H, D]."""
    # index_select on a flat index is several times faster on CPU than advanced indexing.
    gathered = cache.index_select(0, block_table.reshape(-1))
    return gathered.view(*block_table.shape[:-1], -1, *cache.shape[2:])


def decode_attention_torch(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if num_seqs else 0
    num_blocks = max(1, -(-max_seq_len // block_size))
    if num_blocks > block_tables.shape[1]:
        raise ValueError(f"max_seq_len {max_seq_len} needs {num_blocks} blocks but block_tables "
                         f"has {block_tables.shape[1]} columns")
    seq_lens = seq_lens.long()
    # Padded block-table entries may hold anything (even out-of-range ids): send them
    # to block 0, whose positions the length mask hides anyway.
    block_starts = torch.arange(num_blocks, device=q.device) * block_size  # [num_blocks]
    block_table = block_tables[:, :num_blocks].long()  # [num_seqs, num_blocks]
    block_table = block_table.masked_fill(block_starts[None, :] >= seq_lens[:, None], 0)
    k = _gather_kv(k_cache, block_table)  # [num_seqs, max_len, num_kv_heads, head_dim]
    v = _gather_kv(v_cache, block_table)
    positions = torch.arange(k.shape[1], device=q.device)  # [max_len]
    # A seq_len of 0 (batch padding) would mask every key and give NaN: let it see
    # position 0 and zero its output afterwards.
    hidden = positions[None, :] >= seq_lens.clamp(min=1)[:, None]  # [num_seqs, max_len]
    # GQA without copying K/V: the group's q heads act as `group` query rows
    # against their kv head.
    q_grouped = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    if q.dtype != torch.float32:
        q_grouped, k, v = q_grouped.float(), k.float(), v.float()
    # Plain batched matmuls, not SDPA: with one query row per sequence CPU SDPA
    # is ~3x slower than this (32 seqs x 300 tokens: 8.6 ms vs 2.7 ms).
    scores = torch.einsum("shgd,slhd->shgl", q_grouped, k) * scale  # [num_seqs, num_kv_heads, group, max_len]
    scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    out = torch.einsum("shgl,slhd->shgd", scores.softmax(dim=-1), v)  # [num_seqs, num_kv_heads, group, head_dim]
    out = out.reshape(num_seqs, num_q_heads, head_dim)
    out = out.masked_fill((seq_lens == 0)[:, None, None], 0.0)
    return out.to(q.dtype)


def prefill_attention_torch(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    block_size = k_cache.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    query_lens = [end - start for start, end in zip(starts[:-1], starts[1:])]
    if starts[-1] > q.shape[0] or min(query_lens, default=0) < 0:
        raise ValueError(f"query_start_loc must be non-decreasing and end at most at "
                         f"num_tokens={q.shape[0]}, got {starts}")
    if starts[-1] < q.shape[0]:
        out[starts[-1]:] = 0  # padding tokens past the last sequence
    # Decode tokens mixed into the batch (query_len 1) take the batched decode path
    # instead of one SDPA call each.
    single_ids = [i for i, n in enumerate(query_lens) if n == 1]
    if len(single_ids) > 1:
        ids = torch.tensor(single_ids, device=q.device)
        token_ids = query_start_loc[:-1].long()[ids]  # [num_single]
        out[token_ids] = decode_attention_torch(
            q[token_ids], k_cache, v_cache, block_tables[ids], seq_lens[ids], scale,
            max_seq_len=max(lens[i] for i in single_ids))
        done = set(single_ids)
    else:
        done = set()
    for i, (start, query_len, seq_len) in enumerate(zip(starts, query_lens, lens)):
        if i in done or query_len == 0:
            continue
        context_len = seq_len - query_len
        if context_len < 0:
            raise ValueError(f"sequence {i}: seq_len {seq_len} < query_len {query_len}")
        num_blocks = -(-seq_len // block_size)
        if num_blocks > block_tables.shape[1]:
            raise ValueError(f"sequence {i}: seq_len {seq_len} needs {num_blocks} blocks but "
                             f"block_tables has {block_tables.shape[1]} columns")
        block_table = block_tables[i, :num_blocks].long()  # [num_blocks]
        # Contiguous once here, or SDPA would copy the strided views in every chunk below.
        k = _gather_kv(k_cache, block_table)[:seq_len].transpose(0, 1).contiguous()
        v = _gather_kv(v_cache, block_table)[:seq_len].transpose(0, 1).contiguous()
        # k, v: [num_kv_heads, seq_len, head_dim]
        q_seq = q[start:start + query_len].transpose(0, 1)  # [num_q_heads, query_len, head_dim]
        if q.dtype != torch.float32:
            q_seq, k, v = q_seq.float(), k.float(), v.float()
        # CPU SDPA is 2-3x slower on one long causal call (>= ~700 query rows) than on
        # 128-row query chunks, each seeing keys [0, its last position] under an offset mask.
        for chunk_start in range(0, query_len, _Q_CHUNK):
            chunk_end = min(query_len, chunk_start + _Q_CHUNK)
            num_keys = context_len + chunk_end
            q_pos = torch.arange(context_len + chunk_start, num_keys, device=q.device)  # [chunk]
            k_pos = torch.arange(num_keys, device=q.device)  # [num_keys]
            mask = k_pos[None, :] <= q_pos[:, None]  # [chunk, num_keys]
            o = F.scaled_dot_product_attention(
                q_seq[:, chunk_start:chunk_end], k[:, :num_keys], v[:, :num_keys],
                attn_mask=mask, scale=scale, enable_gqa=True)  # [num_q_heads, chunk, head_dim]
            out[start + chunk_start:start + chunk_end] = o.transpose(0, 1)
    return out

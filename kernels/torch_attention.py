"""Plain-torch paged attention: the reference for the Triton kernels and the CPU path.

Inputs are validated by kernels.attention; here we only compute. Half-precision
inputs are upcast to fp32 so the reference is as exact as the dtype allows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_Q_CHUNK = 256  # query rows per SDPA call in a prompt's later chunks (measured on CPU)
# Decode sequences are taken in groups of at most this many padded key positions:
# sorted by length, a group pads to its own longest sequence, not the batch's, and
# its gathered K/V stay in cache for the two matmuls (one batch-wide gather of
# 128 mixed-length sequences was ~10x slower per layer).
_DECODE_GROUP_KEYS = 16_384


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, H, D], block_table [..., n] -> [..., n * block_size, H, D]."""
    # index_select over one flat row per block: ~4x faster on CPU than over the 4-d
    # cache, and several times faster than advanced indexing.
    gathered = cache.view(cache.shape[0], -1).index_select(0, block_table.reshape(-1))
    return gathered.view(*block_table.shape[:-1], -1, *cache.shape[2:])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, logit_softcap: float | None, is_causal: bool = False) -> torch.Tensor:
    """q [B, num_q_heads, Lq, D], k/v [B, num_kv_heads, Lk, D], mask broadcast to [B, H, Lq, Lk]
    (True: visible) -> [B, num_q_heads, Lq, D]."""
    if logit_softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    # SDPA has no hook between the scores and the softmax, so soft-capped layers
    # (Gemma 2) take the explicit matmul path.
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, Lq, Lk]
    scores = torch.tanh(scores / logit_softcap) * logit_softcap
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(
            scores.shape[-1] - scores.shape[-2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _length_groups(seq_ids: list[int], lens: list[int], block_size: int) -> list[list[int]]:
    """seq_ids sorted by length, split so each group's padded keys fit _DECODE_GROUP_KEYS."""
    groups: list[list[int]] = []
    for i in seq_ids:
        padded = -(-lens[i] // block_size) * block_size
        if groups and (len(groups[-1]) + 1) * padded <= _DECODE_GROUP_KEYS:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def decode_attention_torch(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    lens = seq_lens.tolist()
    if max_seq_len is None:
        max_seq_len = max(lens, default=0)
    if -(-max_seq_len // block_size) > block_tables.shape[1]:
        raise ValueError(f"max_seq_len {max_seq_len} needs {-(-max_seq_len // block_size)} blocks but "
                         f"block_tables has {block_tables.shape[1]} columns")
    # A seq_len of 0 is batch padding: its output stays zero.
    out = torch.zeros(num_seqs, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    live_ids = sorted((i for i in range(num_seqs) if lens[i] > 0), key=lens.__getitem__)
    for seq_ids in _length_groups(live_ids, lens, block_size):
        ids = torch.tensor(seq_ids, device=q.device)
        group_lens = seq_lens[ids].long()  # [n]
        num_blocks = -(-lens[seq_ids[-1]] // block_size)  # the group's longest is last
        # Padded block-table entries may hold anything (even out-of-range ids): send
        # them to block 0, whose positions the length mask hides anyway.
        block_starts = torch.arange(num_blocks, device=q.device) * block_size  # [num_blocks]
        block_table = block_tables[ids, :num_blocks].long()  # [n, num_blocks]
        block_table = block_table.masked_fill(block_starts[None, :] >= group_lens[:, None], 0)
        k = _gather_kv(k_cache, block_table).float()  # [n, max_len, num_kv_heads, head_dim]
        v = _gather_kv(v_cache, block_table).float()
        positions = torch.arange(k.shape[1], device=q.device)  # [max_len]
        visible = positions[None, :] < group_lens[:, None]  # [n, max_len]
        if sliding_window is not None:  # the new token at seq_len - 1 sees the last window keys
            visible &= positions[None, :] >= group_lens[:, None] - sliding_window
        # 4-d SDPA takes CPU's flash kernel, which reads the head-strided K/V views
        # in place and never materialises the scores (~3x the batched matmuls).
        o = _attend(q[ids].float()[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                    visible[:, None, None, :], scale, logit_softcap)  # [n, num_q_heads, 1, head_dim]
        out[ids] = o[:, :, 0]
    return out.to(q.dtype)


def prefill_attention_torch(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
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
            max_seq_len=max(lens[i] for i in single_ids), sliding_window=sliding_window,
            logit_softcap=logit_softcap)
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
        k = _gather_kv(k_cache, block_table)[:seq_len].transpose(0, 1).contiguous()[None]
        v = _gather_kv(v_cache, block_table)[:seq_len].transpose(0, 1).contiguous()[None]
        # k, v: [1, num_kv_heads, seq_len, head_dim]
        q_seq = q[start:start + query_len].transpose(0, 1)[None]  # [1, num_q_heads, query_len, head_dim]
        q_seq, k, v = q_seq.float(), k.float(), v.float()  # no copies where they are fp32 already
        # 4-d inputs: CPU SDPA takes its flash kernel (GQA and masks included) only
        # with a batch dimension; 3-d ones fall back to the math path, 3-6x slower.
        if context_len == 0 and sliding_window is None:  # the whole prompt: plain causal, no mask to build
            o = _attend(q_seq, k, v, None, scale, logit_softcap, is_causal=True)
            out[start:start + query_len] = o[0].transpose(0, 1)
            continue
        # A chunk of a longer prompt (or a windowed layer): query chunks, each seeing
        # keys [first in its window, its last position] under an offset mask, skip the
        # keys no row of the chunk sees.
        for chunk_start in range(0, query_len, _Q_CHUNK):
            chunk_end = min(query_len, chunk_start + _Q_CHUNK)
            num_keys = context_len + chunk_end
            first_key = 0 if sliding_window is None else max(0, context_len + chunk_start - sliding_window + 1)
            q_pos = torch.arange(context_len + chunk_start, num_keys, device=q.device)  # [chunk]
            k_pos = torch.arange(first_key, num_keys, device=q.device)  # [chunk_keys]
            mask = k_pos[None, :] <= q_pos[:, None]  # [chunk, chunk_keys]
            if sliding_window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
            o = _attend(q_seq[:, :, chunk_start:chunk_end], k[:, :, first_key:num_keys],
                        v[:, :, first_key:num_keys], mask, scale,
                        logit_softcap)  # [1, num_q_heads, chunk, head_dim]
            out[start + chunk_start:start + chunk_end] = o[0].transpose(0, 1)
    return out

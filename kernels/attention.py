"""Paged attention over the KV cache: public entry points.

Each function checks its inputs, then runs the Triton kernel for CUDA tensors, the
native C++ kernel on CPU when it builds (kernels/cpu_attention.py; PDSERVE_CPU_ATTENTION
=torch keeps CPU on the reference), or the plain-torch reference otherwise
(`backend="triton"|"torch"|"native"` forces one). Checks only look at
shapes/dtypes/devices so they never synchronise with the GPU.

Sliding-window and logit-soft-capped layers (Mistral, Gemma 2) run on the torch path
on CUDA: the Triton kernels implement neither, and a layer asking for them is sent to
the reference rather than computed wrongly. The native CPU kernel implements both.
Caches of fp8 codes: every backend reads them (widened exactly to the query's dtype).
"""
from __future__ import annotations

import torch

from kernels._backend import (
    check_cache_dtypes,
    check_float_dtype,
    check_int32_1d,
    check_last_dim_contiguous,
    select_backend,
)
from kernels.cpu_attention import (
    attention_with_kv_write_native,
    cpu_attention_backend,
    decode_attention_native,
    native_attention_serves,
    prefill_attention_native,
)
from kernels.torch_attention import decode_attention_torch, prefill_attention_torch


def decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim], the token at position seq_len - 1
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, padding entries arbitrary
    seq_lens: torch.Tensor,  # [num_seqs] int32, including the new token
    scale: float,
    max_seq_len: int | None = None,
    backend: str | None = None,
    sliding_window: int | None = None,  # see only the last sliding_window positions
    logit_softcap: float | None = None,  # scores become tanh(scores / cap) * cap
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """One new token per sequence attends to cache positions [0, seq_len).

    max_seq_len, if given, must be >= max(seq_lens) (the torch path sizes its gather with
    it; Triton ignores it). A seq_len of 0 yields zeros. The result is contiguous.
    """
    num_seqs = _check_common(q, k_cache, v_cache, block_tables, max_seq_len, "max_seq_len")
    if q.shape[0] != num_seqs:
        raise ValueError(f"q has {q.shape[0]} rows but block_tables has {num_seqs} sequences")
    check_int32_1d("seq_lens", seq_lens, num_seqs, q.device)
    _check_layer_features(sliding_window, logit_softcap)
    chosen = _backend_for(q.device, backend, sliding_window, logit_softcap, q.dtype, k_cache.dtype)
    if chosen == "triton":
        from kernels.triton_attention import decode_attention_triton

        return decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale)
    if chosen == "native":
        return decode_attention_native(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                       sliding_window=sliding_window, logit_softcap=logit_softcap)
    return decode_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len,
                                  sliding_window=sliding_window, logit_softcap=logit_softcap)


def prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], all sequences' new tokens
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor,  # [num_seqs] int32, context_len + query_len
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    backend: str | None = None,
    sliding_window: int | None = None,  # query at p sees keys (p - sliding_window, p]
    logit_softcap: float | None = None,  # scores become tanh(scores / cap) * cap
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Causal attention for ragged chunks whose K/V (and their context's) are in the cache.

    Query j of sequence i sits at position context_len + j and sees [0, context_len + j].
    max_query_len / max_seq_len are accepted so callers can pass what they know; the
    kernels derive everything from the metadata tensors and never need them.
    query_start_loc[0] should be 0; rows past query_start_loc[-1] are padding whose output
    is unspecified (zeros on the torch path). The result is contiguous.
    """
    num_seqs = _check_common(q, k_cache, v_cache, block_tables, max_seq_len, "max_seq_len")
    check_int32_1d("query_start_loc", query_start_loc, num_seqs + 1, q.device)
    check_int32_1d("seq_lens", seq_lens, num_seqs, q.device)
    if max_query_len is not None and max_query_len > q.shape[0]:
        raise ValueError(f"max_query_len {max_query_len} > num_tokens {q.shape[0]}")
    _check_layer_features(sliding_window, logit_softcap)
    chosen = _backend_for(q.device, backend, sliding_window, logit_softcap, q.dtype, k_cache.dtype)
    if chosen == "triton":
        from kernels.triton_attention import prefill_attention_triton

        return prefill_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc,
                                        seq_lens, scale)
    if chosen == "native":
        return prefill_attention_native(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                        sliding_window=sliding_window, logit_softcap=logit_softcap)
    return prefill_attention_torch(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                   scale, sliding_window=sliding_window, logit_softcap=logit_softcap)


def attention_with_kv_write(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], decodes are queries of length 1
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], the new tokens' keys
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], their values
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 means skip (padding)
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor,  # [num_seqs] int32, context_len + query_len
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor | None:  # [num_tokens, num_q_heads, head_dim]
    """write_kv_cache, then prefill_attention over the whole step (decodes and chunks alike),
    in one native CPU call: a decode step's per-layer cost is mostly the Python and
    dispatch around the kernel (~50 us per layer split in three calls, ~15 us fused).
    None where that kernel does not serve this call (not CPU, the torch path chosen, or
    caches that are not contiguous): the caller then makes the separate calls."""
    if q.device.type != "cpu" or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    if _backend_for(q.device, None, sliding_window, logit_softcap, q.dtype, k_cache.dtype) != "native":
        return None
    _check_layer_features(sliding_window, logit_softcap)
    return attention_with_kv_write_native(q, k, v, k_cache, v_cache, slot_mapping, block_tables, query_start_loc,
                                          seq_lens, scale, sliding_window, logit_softcap)


def _check_layer_features(sliding_window: int | None, logit_softcap: float | None) -> None:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive number of positions, got {sliding_window}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be positive, got {logit_softcap}")


def _backend_for(device: torch.device, backend: str | None, sliding_window: int | None,
                 logit_softcap: float | None, dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
    """The backend for one call: CPU takes the native kernel unless told otherwise (or its
    build lacks the call's dtypes), and features the Triton kernels lack send a CUDA call to torch."""
    needs_torch = sliding_window is not None or logit_softcap is not None
    if needs_torch and backend == "triton":
        raise ValueError("the Triton attention kernels implement neither sliding windows nor logit soft-capping; "
                         "use backend='torch', 'native' or None for such layers")
    if backend is None and device.type == "cpu":
        chosen = cpu_attention_backend()
        return "torch" if chosen == "native" and not native_attention_serves(dtype, cache_dtype) else chosen
    if backend is None and needs_torch:
        return "torch"
    return select_backend(device, backend)


def _check_common(q, k_cache, v_cache, block_tables, max_seq_len, max_name) -> int:
    """Checks shared by decode and prefill; returns num_seqs (rows of block_tables)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, num_q_heads, head_dim], got {list(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError("k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {list(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {list(v_cache.shape)} != k_cache shape {list(k_cache.shape)}")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    check_float_dtype("q", q)
    check_last_dim_contiguous("q", q)
    check_cache_dtypes(q.dtype, k_cache, v_cache)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {list(block_tables.shape)}")
    if block_tables.device != q.device:
        raise ValueError(f"block_tables is on {block_tables.device}, q on {q.device}")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be contiguous in its last dimension")
    if max_seq_len is not None and max_seq_len > block_tables.shape[1] * k_cache.shape[1]:
        raise ValueError(f"{max_name} {max_seq_len} exceeds block_tables capacity "
                         f"{block_tables.shape[1]} blocks x {k_cache.shape[1]}")
    return block_tables.shape[0]

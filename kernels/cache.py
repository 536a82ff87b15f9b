"""Writing new tokens' K/V into the paged cache.

Cache layout, per layer: k_cache and v_cache are each
[num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is
block_id * block_size + offset_in_block.
"""
from __future__ import annotations

import torch

from kernels._backend import (
    FP8_CACHE_DTYPES,
    check_cache_dtypes,
    check_float_dtype,
    check_last_dim_contiguous,
    select_backend,
    to_cache_dtype,
)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 means skip (padding)
    backend: str | None = None,
) -> None:
    """Store key[i]/value[i] at slot slot_mapping[i] of k_cache/v_cache, in place; an fp8 cache
    stores their codes (kernels._backend.to_cache_dtype)."""
    _check_write_args(key, value, k_cache, v_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    if select_backend(k_cache.device, backend) == "triton":
        from kernels.triton_cache import write_kv_cache_triton

        if k_cache.dtype in FP8_CACHE_DTYPES:
            # torch makes the codes (elementwise, so a CUDA graph may hold it), the kernel
            # scatters them as bytes: one rounding, torch's, on every device.
            key, value = to_cache_dtype(key, k_cache.dtype), to_cache_dtype(value, v_cache.dtype)
            key, value = key.view(torch.uint8), value.view(torch.uint8)
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_cache_torch(key, value, k_cache, v_cache, slot_mapping)


def write_kv_cache_torch(key, value, k_cache, v_cache, slot_mapping) -> None:
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0  # [num_tokens]
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    key, value = to_cache_dtype(key, k_cache.dtype), to_cache_dtype(value, v_cache.dtype)
    if k_cache.dtype in FP8_CACHE_DTYPES:  # index_copy_ has no fp8 CPU kernel: the codes go as bytes
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        # One row per slot: index_copy_ on the flat view is several times faster on
        # CPU than advanced-index assignment into the 4-D cache.
        row = k_cache.shape[2] * k_cache.shape[3]
        k_cache.view(-1, row).index_copy_(0, slot_mapping, key.reshape(-1, row))
        v_cache.view(-1, row).index_copy_(0, slot_mapping, value.reshape(-1, row))
        return
    # Strided caches: index the 4-D tensor so the write lands in the caller's storage.
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")  # [num_valid]
    offsets = slot_mapping % block_size  # [num_valid]
    k_cache[block_ids, offsets] = key
    v_cache[block_ids, offsets] = value


def _check_write_args(key, value, k_cache, v_cache, slot_mapping) -> None:
    if key.dim() != 3:
        raise ValueError(f"key must be [num_tokens, num_kv_heads, head_dim], got {list(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {list(value.shape)} != key shape {list(key.shape)}")
    if k_cache.dim() != 4:
        raise ValueError("k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {list(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {list(v_cache.shape)} != k_cache shape {list(k_cache.shape)}")
    if tuple(k_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(f"key heads/head_dim {list(key.shape[1:])} do not match the cache's "
                         f"{list(k_cache.shape[2:])}")
    for name, t in (("key", key), ("value", value)):
        check_float_dtype(name, t)
        check_last_dim_contiguous(name, t)
    for name, t in (("key", key), ("value", value), ("v_cache", v_cache)):
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device}, k_cache on {k_cache.device}")
    if key.dtype != value.dtype:
        raise ValueError(f"dtype mismatch: key {key.dtype}, value {value.dtype}")
    check_cache_dtypes(key.dtype, k_cache, v_cache, what="key")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must have shape [{key.shape[0]}], got {list(slot_mapping.shape)}")
    if slot_mapping.device != k_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, k_cache on {k_cache.device}")

"""Triton kernel: scatter new tokens' K/V into the paged cache by slot mapping."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,  # key/value token and head strides
    stride_cb, stride_co, stride_ch,  # cache block, offset-in-block, head strides
    stride_vcb, stride_vco, stride_vch,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token_idx = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token_idx)
    if slot < 0:  # padding token
        return
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE
    head_ids = tl.arange(0, BLOCK_H)
    dim_ids = tl.arange(0, BLOCK_D)
    mask = (head_ids[:, None] < num_kv_heads) & (dim_ids[None, :] < head_dim)

    k = tl.load(key_ptr + token_idx * stride_kt + head_ids[:, None] * stride_kh + dim_ids[None, :],
                mask=mask)  # [BLOCK_H, BLOCK_D]
    v = tl.load(value_ptr + token_idx * stride_vt + head_ids[:, None] * stride_vh + dim_ids[None, :],
                mask=mask)
    k_dst = (k_cache_ptr + block_id * stride_cb + block_offset * stride_co
             + head_ids[:, None] * stride_ch + dim_ids[None, :])
    v_dst = (v_cache_ptr + block_id * stride_vcb + block_offset * stride_vco
             + head_ids[:, None] * stride_vch + dim_ids[None, :])
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    # The kernel reads slots with unit stride.
    slot_mapping = slot_mapping.contiguous()
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )

"""Attention and KV-cache kernels.

Triton kernels run for CUDA tensors; the plain-torch reference (also the CPU path)
runs otherwise. Every entry point takes `backend="triton"|"native"|"torch"` to force one.
triton itself is imported only when a Triton kernel is first used.

Cache layout, per layer: k_cache and v_cache are each
[num_blocks, block_size, num_kv_heads, head_dim]; slot = block_id * block_size + offset.
"""
from kernels.attention import decode_attention, prefill_attention
from kernels.cache import write_kv_cache

__all__ = ["write_kv_cache", "decode_attention", "prefill_attention"]

"""Paged attention for one layer over a flattened batch: decodes first, then prefills.

The runner orders each step's tokens as [decode tokens (one per sequence) |
prefill chunks (ragged)], writes every new K/V into the paged cache through the
slot mapping, then runs one decode kernel and one ragged prefill kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from common.engine.forward_context import current_attention_metadata
from kernels.attention import attention_with_kv_write, decode_attention, prefill_attention
from kernels.cache import write_kv_cache
from kernels.cpu_attention import cpu_attention_backend, layer_attention


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding
    num_decode_tokens: int  # the first num_decode_tokens tokens are decodes
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int32
    max_decode_seq_len: int
    prefill_block_tables: torch.Tensor | None  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor | None  # [num_prefills + 1] int32, from 0
    prefill_seq_lens: torch.Tensor | None  # [num_prefills] int32, context + query
    max_prefill_query_len: int
    max_prefill_seq_len: int
    # Called with the layer index once the layer's new K/V is in the cache and before
    # attention reads it: the runner's KV-connector work for that layer (None: none).
    kv_layer_hook: Callable[[int], None] | None = None
    # The whole step as one ragged batch, decodes as queries of length 1, for kernels that
    # take both in one call (None: not built; the decode/prefill fields above serve).
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor | None = None  # [num_seqs + 1] int32, from 0
    seq_lens: torch.Tensor | None = None  # [num_seqs] int32


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                    scale: float, layer_idx: torch.Tensor, sliding_window: int | None = None,
                    logit_softcap: float | None = None) -> torch.Tensor:
    """q [num_tokens, num_q_heads, head_dim], k/v [num_tokens, num_kv_heads, head_dim]
    -> [num_tokens, num_q_heads, head_dim].

    sliding_window: a query at position p sees keys (p - sliding_window, p] only; the
    cache still holds every position, so the window changes the math, not the memory.
    logit_softcap: scores become tanh(scores / cap) * cap before the softmax.
    layer_idx: [] int64 on the CPU, an input of a compiled graph rather than a constant of
    it, so that one compiled decoder layer serves every layer (CausalLM.forward).

    Inside torch.compile this is one opaque custom op, the graph's split point: the
    compiler fuses what lies between attentions and never sees the metadata, which
    the op reads from the forward context instead. On CPU with the native kernel that op
    is the library's pdserve_cpu::layer_attention (kernels/cpu_attention.py), which runs
    the fused kernel from C++ when the forward context has published the step to it.
    """
    if torch.compiler.is_compiling():
        if q.device.type == "cpu" and cpu_attention_backend() == "native":
            # The native op: the fused kernel in C++ over the step the forward context
            # published, else this module's Python op.
            return layer_attention(q, k, v, kv_cache[0], kv_cache[1], scale, layer_idx, sliding_window,
                                   logit_softcap)
        return torch.ops.pdserve.paged_attention(q, k, v, kv_cache[0], kv_cache[1], scale, layer_idx,
                                                 sliding_window, logit_softcap)
    return _paged_attention(q, k, v, kv_cache, meta, scale, layer_idx, sliding_window, logit_softcap)


# Declared pure although it writes k and v into the caches: nothing else in a compiled
# graph reads the caches, so no ordering is lost, and a declared mutation would make
# the compiler functionalise (copy) every layer's cache. Defined with torch.library's
# low-level API: a `custom_op` wrapper adds ~20 us per call, once per layer per step.
_LIBRARY = torch.library.Library("pdserve", "FRAGMENT")
_LIBRARY.define("paged_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, float scale, "
                "Tensor layer_idx, int? sliding_window, float? logit_softcap) -> Tensor")


def _paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, scale: float, layer_idx: torch.Tensor, sliding_window: int | None,
                        logit_softcap: float | None) -> torch.Tensor:
    return _paged_attention(q, k, v, (k_cache, v_cache), current_attention_metadata(), scale, layer_idx,
                            sliding_window, logit_softcap)


def _paged_attention_fake(q, k, v, k_cache, v_cache, scale, layer_idx, sliding_window, logit_softcap):
    return torch.empty_like(q)


_LIBRARY.impl("paged_attention", _paged_attention_op, "CompositeExplicitAutograd")
torch.library.register_fake("pdserve::paged_attention", _paged_attention_fake, lib=_LIBRARY)


def _paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                     scale: float, layer_idx: torch.Tensor, sliding_window: int | None,
                     logit_softcap: float | None) -> torch.Tensor:
    k_cache, v_cache = kv_cache
    if meta.query_start_loc is not None and meta.kv_layer_hook is None:
        out = attention_with_kv_write(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                                      meta.query_start_loc, meta.seq_lens, scale, sliding_window, logit_softcap)
        if out is not None:
            return out
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.kv_layer_hook is not None:
        meta.kv_layer_hook(int(layer_idx))
    num_decodes = meta.num_decode_tokens
    outs = []
    if num_decodes:
        outs.append(decode_attention(q[:num_decodes], k_cache, v_cache, meta.decode_block_tables,
                                     meta.decode_seq_lens, scale, max_seq_len=meta.max_decode_seq_len,
                                     sliding_window=sliding_window, logit_softcap=logit_softcap))
    if num_decodes < q.shape[0]:
        # Fresh prompts go through the paged kernel too: on CPU its 128-row query
        # chunks beat one long causal SDPA call by ~3x (kernels/torch_attention.py).
        outs.append(prefill_attention(q[num_decodes:], k_cache, v_cache, meta.prefill_block_tables,
                                      meta.prefill_query_start_loc, meta.prefill_seq_lens, scale,
                                      max_query_len=meta.max_prefill_query_len,
                                      max_seq_len=meta.max_prefill_seq_len,
                                      sliding_window=sliding_window, logit_softcap=logit_softcap))
    return outs[0] if len(outs) == 1 else torch.cat(outs)

"""The native decode loop (kernels/cpu/decode_layers.cpp) as torch ops `torch.ops.pdserve_decode.*`:
a decode-only step through every decoder layer of a Llama-shaped model in one call (up to
DECODE_MAX_TOKENS tokens, or any number where every projection is a registered prepacked
linear or GGUF blocks), or from the token ids to each row's next token, its argmax or a
draw from its softmax (decode_tokens), and whether it runs here.

It reaches the GEMVs (kernels/cpu_linear.py) and the fused paged attention
(kernels/cpu_attention.py) through the dispatcher, so it needs both loaded; it is built
on first use (kernels/cpu/build.py). PDSERVE_NATIVE_DECODE=0 turns it off.
"""
from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch

from kernels._backend import switched_off
from kernels.cpu.build import load_ops
from kernels.cpu_attention import native_attention_available
from kernels.cpu_linear import GEMV_MAX_ROWS, native_gemv_available

log = logging.getLogger(__name__)

DECODE_MAX_TOKENS = GEMV_MAX_ROWS
# How a linear's decode GEMV reads its weight (the library's LinearKind): dense rows, GGUF
# blocks, or column panels (through panel_gemm: kernels/cpu/panel_gemm.h for bf16,
# panel_gemm_fp32.h for fp32).
LINEAR_DENSE, LINEAR_Q4_1, LINEAR_Q8_0, LINEAR_PANELS = 0, 1, 2, 3


def native_decode_disabled() -> bool:
    return switched_off("PDSERVE_NATIVE_DECODE")


@functools.cache
def native_decode_available() -> bool:
    """Whether the loop can run here (built and loaded once per process); callers check
    native_decode_disabled() each time they would use it."""
    if not native_gemv_available() or not native_attention_available():
        return False
    error = load_ops("decode_layers", {"pdserve_decode::decode_layers": _decode_layers_fake,
                                       "pdserve_decode::decode_tokens": _decode_tokens_fake})
    if error is not None:
        log.warning("native decode loop unavailable, decode steps stay on the compiled model: %s", error)
        return False
    return True


def _decode_layers_fake(model_id, hidden, positions, k_caches, v_caches, slot_mapping, block_tables,
                        query_start_loc, seq_lens, lora_ids=None):
    return hidden.new_empty(hidden.shape)


def _decode_tokens_fake(model_id, input_ids, positions, k_caches, v_caches, slot_mapping, block_tables,
                        query_start_loc, seq_lens, num_steps=1, stop_token_ids=None, temperatures=None,
                        uniforms=None, top_k=None, top_p=None, min_p=None, logits=None, num_logprobs=None,
                        logprobs=None, logprob_token_ids=None, penalties=None, history_token_ids=None,
                        history_offsets=None, held_back_steps=None, lora_ids=None):
    return input_ids.new_empty((input_ids.shape[0], num_steps))


class TokenSampling(NamedTuple):
    """How decode_tokens takes each row's next token: a row whose temperature is > 0 draws it
    as the sampler's native passes do (kernels/cpu/sample_row.h: the logits over the
    temperature, then top_k, top_p, min_p, then the draw at the step's uniform); the others
    take their argmax."""
    temperatures: torch.Tensor  # [num_tokens] fp32
    uniforms: torch.Tensor  # [num_steps, num_tokens] float64 in [0, 1): step s draws row m at [s, m]
    top_k: torch.Tensor | None = None  # [num_tokens] int64; <= 0 or >= the vocabulary: none
    top_p: torch.Tensor | None = None  # [num_tokens] fp32 in (0, 1]; 1: none
    min_p: torch.Tensor | None = None  # [num_tokens] fp32 in [0, 1]; 0: none


class TokenLogprobs(NamedTuple):
    """Where decode_tokens writes the logprobs of the rows that report them, as the sampler
    reports them (the log-softmax of the head's logits as fp32, before temperature and
    truncation): the taken token's, then the row's top tokens', most likely first (equal
    logits by token id)."""
    num_logprobs: torch.Tensor  # [num_tokens] int64: -1 none, else the top tokens the row reports
    logprobs: torch.Tensor  # [num_steps, num_tokens, 1 + max top] fp32: the taken token's, then the top ones'
    token_ids: torch.Tensor  # [num_steps, num_tokens, max top] int64: the top tokens

    @classmethod
    def empty(cls, num_logprobs: list[int], num_steps: int) -> TokenLogprobs:
        """Room for num_steps steps of rows reporting num_logprobs[m] top tokens each (-1: none)."""
        num_top = max(0, *num_logprobs)
        return cls(torch.tensor(num_logprobs, dtype=torch.int64),
                   torch.empty(num_steps, len(num_logprobs), 1 + num_top),
                   torch.empty(num_steps, len(num_logprobs), num_top, dtype=torch.int64))


class TokenHistory(NamedTuple):
    """What each row's tokens so far do to its logits for decode_tokens, as the sampler applies
    it to them as fp32 before its argmax, draw and logprobs: vLLM's penalties (repetition over
    the prompt's and the output's tokens, frequency and presence over the output's), then its
    stop tokens held back (-inf) for its first held_back_steps steps (min_tokens); the tokens
    the row takes in the call's steps count too."""
    penalties: torch.Tensor  # [num_tokens, 3] fp32: repetition (> 0), frequency, presence; 1, 0, 0: none
    token_ids: torch.Tensor  # [T] int64: the rows' prompt, output and held-back stop tokens
    # [num_tokens, 4] int64: row m's prompt tokens token_ids[offsets[m, 0]:offsets[m, 1]] (a
    # repetition penalty's only), its output tokens [offsets[m, 1]:offsets[m, 2]], its stop
    # tokens held back [offsets[m, 2]:offsets[m, 3]]
    offsets: torch.Tensor
    held_back_steps: torch.Tensor  # [num_tokens] int64: the steps that hold them back; 0: none


def register_decode_model(
    norms: list[torch.Tensor],  # per layer: input norm, post-attention norm, each [hidden_size]
    weights: list[torch.Tensor],  # per layer: qkv, o, gate_up, down (dense [N, K], GGUF row groups or panels)
    kinds: list[int],  # per weight: LINEAR_DENSE, LINEAR_Q4_1, LINEAR_Q8_0 or LINEAR_PANELS
    biases: list[torch.Tensor | None],  # per weight: [N] or None
    sliding_windows: list[int],  # per layer, 0: none
    final_norm: torch.Tensor | None,  # [hidden_size]; None: the loop returns the residual stream
    cos: torch.Tensor,  # [max_position, rotary_dim // 2] fp32
    sin: torch.Tensor,  # [max_position, rotary_dim // 2] fp32
    num_heads: int, num_kv_heads: int, head_dim: int, rms_norm_eps: float, attention_scale: float,
    # per weight: its pdserve_gemv::prepacked_linear id, or -1; where every weight has one,
    # the model takes steps of any size (the ids' op past DECODE_MAX_TOKENS rows)
    weight_ids: list[int] | None = None,
    # a model of GGUF blocks or column panels runs each step in one parallel region (False,
    # or PDSERVE_DECODE_REGIONS=0: a fork and join per projection and attention)
    in_regions: bool = True,
    # what decode_tokens reads (both or neither): the token embedding [num_embeddings,
    # hidden_size], the model's dtype, and the output projection's decode weight (GGUF
    # blocks or column panels, of kind head_kind) with its bias; its first vocab_size outputs
    # are the vocabulary's logits
    embedding: torch.Tensor | None = None,
    head: torch.Tensor | None = None,
    head_kind: int = LINEAR_DENSE,
    head_bias: torch.Tensor | None = None,
    vocab_size: int = 0,
) -> int:
    """The library keeps these tensors (shared, not copied) under the returned id."""
    return torch.ops.pdserve_decode.register_decode_model(
        norms, weights, kinds, biases, sliding_windows, final_norm, cos, sin, num_heads, num_kv_heads, head_dim,
        float(rms_norm_eps), float(attention_scale), weight_ids,
        in_regions and not switched_off("PDSERVE_DECODE_REGIONS"), embedding, head, head_kind, head_bias, vocab_size)


def decode_model_max_region_tokens(model_id: int) -> int:
    """The most tokens of the registered model's steps that run in one parallel region each
    (0: none): a model whose every projection is GGUF blocks (any number) or bf16 column
    panels on vector units (as many as prepacked_linear takes panels for, panel_gemm_max_rows),
    of a Llama layer's shapes with one sliding window."""
    return torch.ops.pdserve_decode.decode_model_max_region_tokens(model_id)


def decode_model_max_tokens(model_id: int) -> int:
    """The most tokens a step of this registered model may have: DECODE_MAX_TOKENS, or
    sys.maxsize where every weight has a prepacked-linear id or is GGUF blocks (the
    library's own rule)."""
    return torch.ops.pdserve_decode.decode_model_max_tokens(model_id)


def decode_model_max_head_tokens(model_id: int) -> int:
    """The most tokens a decode_tokens step of this registered model may have, where it was
    registered with an embedding and a head its region runs, after a final norm: as far as
    the head's own op multiplies the rows as the region does (GGUF blocks DECODE_MAX_TOKENS,
    panels the region's limit, decode_model_max_region_tokens); 0 elsewhere."""
    return torch.ops.pdserve_decode.decode_model_max_head_tokens(model_id)


def decode_model_head_outputs(model_id: int) -> int:
    """The columns of decode_tokens' logits for this registered model: its head's outputs
    (the vocabulary and any padding; 0 without a head)."""
    return torch.ops.pdserve_decode.decode_model_head_outputs(model_id)


def release_decode_model(model_id: int) -> None:
    torch.ops.pdserve_decode.release_decode_model(model_id)


def register_decode_adapter(
    a: list[torch.Tensor | None],  # per layer, for qkv, o, gate_up, down: A [R, K] or None (not targeted)
    b: list[torch.Tensor | None],  # the same: B [N, R], the model's dtype as A
    scaling: float,
) -> int:
    """A LoRA adapter's stacked matrices (common/engine/lora/layers.py), kept under the
    returned id (B transposed, A shared) for steps whose lora_ids name it."""
    return torch.ops.pdserve_decode.register_decode_adapter(a, b, float(scaling))


def release_decode_adapter(adapter_id: int) -> None:
    torch.ops.pdserve_decode.release_decode_adapter(adapter_id)


def decode_layers(
    model_id: int,
    hidden: torch.Tensor,  # [num_tokens, hidden_size], the embedded tokens
    positions: torch.Tensor,  # [num_tokens] int64
    k_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor],
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    block_tables: torch.Tensor,  # [num_tokens, max_blocks] int32: one sequence per token
    query_start_loc: torch.Tensor,  # [num_tokens + 1] int32
    seq_lens: torch.Tensor,  # [num_tokens] int32
    lora_ids: torch.Tensor | None = None,  # [num_tokens] int64: each row's adapter id, -1: none
) -> torch.Tensor:  # [num_tokens, hidden_size]
    return torch.ops.pdserve_decode.decode_layers(model_id, hidden, positions, k_caches, v_caches, slot_mapping,
                                                  block_tables, query_start_loc, seq_lens, lora_ids)


def decode_tokens(
    model_id: int,
    input_ids: torch.Tensor,  # [num_tokens] int64, one token per decode sequence
    positions: torch.Tensor,  # [num_tokens] int64
    k_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor],
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    block_tables: torch.Tensor,  # [num_tokens, max_blocks] int32: one sequence per token
    query_start_loc: torch.Tensor,  # [num_tokens + 1] int32
    seq_lens: torch.Tensor,  # [num_tokens] int32
    num_steps: int = 1,
    stop_token_ids: torch.Tensor | None = None,  # [S] int64
    sampling: TokenSampling | None = None,  # None: every row its argmax
    logits: torch.Tensor | None = None,  # [num_tokens, the head's outputs] the model's dtype; one step
    logprobs: TokenLogprobs | None = None,  # None: no row reports logprobs
    history: TokenHistory | None = None,  # None: no row's tokens change its logits
    lora_ids: torch.Tensor | None = None,  # [num_tokens] int64: each row's adapter id, -1: none
) -> torch.Tensor:  # [num_tokens, steps run] int64: each sequence's next tokens
    """decode_layers from the token ids, then the head and each row's next token (its argmax,
    as argmax_rows takes it from the head's logits, or its draw: TokenSampling), in one
    parallel region; num_steps such steps, each row going on from the token it took, one
    position further (block_tables must hold each row's blocks through position + num_steps
    - 1), fewer once every row has taken one of stop_token_ids. logits, where given, receives
    the head's logits (as compute_logits' before its slice and fp32 copy), for the caller to
    sample rows the loop leaves to it; logprobs, where given, receives each step's logprobs of
    the rows that report them (its first steps run); history (TokenHistory) applies to the
    rows' logits first."""
    sampling = sampling or TokenSampling(None, None)
    logprobs = logprobs or TokenLogprobs(None, None, None)
    history = history or TokenHistory(None, None, None, None)
    return torch.ops.pdserve_decode.decode_tokens(model_id, input_ids, positions, k_caches, v_caches, slot_mapping,
                                                  block_tables, query_start_loc, seq_lens, num_steps, stop_token_ids,
                                                  *sampling, logits, *logprobs, *history, lora_ids)

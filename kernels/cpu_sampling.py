"""Sampling's last steps over rows of logits on the CPU (kernels/cpu/sampling.cpp), as torch ops:

- `argmax_rows` (greedy): torch.argmax(dim=-1)'s answer for fp32 or bf16 rows (the first
  largest value, a NaN above every number) in two vector passes per row, where torch's own
  compares one element at a time (~2.6 ms against ~0.13 for 64 rows of a 49,152-token
  vocabulary on a 2-core Zen 4 EPYC).
- `draw_rows` (random): the token whose interval of the row's softmax CDF holds a uniform
  number, in three vector passes per row (maximum, weights summed by chunks, the one chunk
  searched column by column in float64), where the torch form below takes a softmax, a
  float64 copy, a cumulative sum, a search and a clamp (~0.25 ms against ~0.04 for a row
  of 49,152 on the 2-core Zen 5 EPYC).
- `min_p_mask_rows_` (min_p): tokens less likely than min_p times the top one -inf, as a
  logit threshold (maximum + log(min_p)) in two vector passes.
- `top_k_mask_rows_` (top_k): the k largest logits and their ties kept, the rest -inf, the
  k-th found from counts of the buckets below (torch's topk takes ~0.12 ms a row).
- `top_p_mask_rows_` (top_p): the most likely tokens whose mass reaches p kept, the rest
  -inf, from a histogram of each logit's distance below the row's maximum; only the
  tokens of the bucket where the mass crosses p are sorted. The sampler's torch form
  takes a softmax, top-k candidates (growing while they fall short of p) and their sort.
- `logprobs_rows` (logprobs): the log-softmax at each row's taken token and at its top
  tokens (a heap over the row, equal logits by id), without writing the whole log-softmax;
  the native decode loop reports the same values from the same code (sample_row.h).

Built on first use (kernels/cpu/build.py); without a C++ compiler, on other devices and
dtypes, each runs as its torch form. PDSERVE_CPU_ARGMAX=0 turns the native ones off.
"""
from __future__ import annotations

import functools
import logging

import torch

from kernels._backend import switched_off
from kernels.cpu.build import load_ops

log = logging.getLogger(__name__)


@functools.cache
def native_argmax_available() -> bool:
    """Whether the native sampling ops run here (built and loaded once per process)."""
    if switched_off("PDSERVE_CPU_ARGMAX"):
        return False
    error = load_ops("sampling", {"pdserve_sampling::argmax_rows": _argmax_rows_fake,
                                  "pdserve_sampling::draw_rows": _draw_rows_fake,
                                  "pdserve_sampling::min_p_mask_rows_": _mask_rows_fake,
                                  "pdserve_sampling::top_k_mask_rows_": _mask_rows_fake,
                                  "pdserve_sampling::top_p_mask_rows_": _mask_rows_fake,
                                  "pdserve_sampling::logprobs_rows": _logprobs_rows_fake})
    if error is not None:
        log.info("sampling takes torch's argmax, draw and truncations: %s", error)
        return False
    return True


def _argmax_rows_fake(logits):
    return logits.new_empty((logits.shape[0],), dtype=torch.long)


def _draw_rows_fake(logits, uniforms):
    return logits.new_empty((logits.shape[0],), dtype=torch.long)


def _mask_rows_fake(logits, per_row):
    return None


def _logprobs_rows_fake(logits, token_ids, num_top):
    return logits.new_empty((logits.shape[0], 1 + num_top)), logits.new_empty((logits.shape[0], num_top),
                                                                              dtype=torch.long)


def native_rows(logits: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether the native sampling ops take these logits: rows of one of dtypes (fp32 for all
    but the argmax), each contiguous, on the CPU."""
    return (logits.device.type == "cpu" and logits.dtype in dtypes and logits.dim() == 2
            and logits.shape[1] > 0 and logits.stride(1) == 1 and native_argmax_available())


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [num_rows, vocab_size] -> [num_rows] int64, as logits.argmax(dim=-1)."""
    if native_rows(logits, (torch.float32, torch.bfloat16)):
        return torch.ops.pdserve_sampling.argmax_rows(logits)
    return logits.argmax(dim=-1)


def draw_rows(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row, drawn from softmax(logits) at that row's uniform number: the first
    token whose cumulative probability exceeds u, never one whose logit is -inf (so a row
    truncated to some tokens draws only from those). logits [num_rows, vocab_size] (any
    temperature already applied), uniforms [num_rows] float64 in [0, 1) -> [num_rows] int64."""
    if native_rows(logits) and uniforms.dtype == torch.float64 and uniforms.is_contiguous():
        return torch.ops.pdserve_sampling.draw_rows(logits, uniforms)
    probs = logits.softmax(dim=-1)  # [num_rows, vocab_size]
    # float64: in float32 the cumulative sum would swallow the tail's tiny probabilities.
    cdf = probs.to(torch.float64).cumsum_(dim=-1)  # [num_rows, vocab_size]
    token_ids = torch.searchsorted(cdf, uniforms.unsqueeze(1) * cdf[:, -1:], right=True)  # [num_rows, 1]
    # u * total may round up to total: stay at or before the last token with probability
    # > 0 (the first index where the cdf reaches its maximum).
    return torch.minimum(token_ids, cdf.argmax(dim=-1, keepdim=True)).squeeze(1)


def logprobs_rows(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logprobs a sampler reports: logits [num_rows, vocab_size] (before temperature and
    truncation), token_ids [num_rows] int64 (each row's taken token), num_top in [0,
    vocab_size] -> (logprobs [num_rows, 1 + num_top] fp32: log_softmax(row) at its token,
    then at its top num_top tokens; top_ids [num_rows, num_top] int64, most likely first).
    The native op ranks equal logits by token id; torch's topk, the form elsewhere, as it
    finds them."""
    if native_rows(logits) and token_ids.dtype == torch.int64 and token_ids.is_contiguous():
        return torch.ops.pdserve_sampling.logprobs_rows(logits, token_ids, num_top)
    row_logprobs = torch.log_softmax(logits.float(), dim=-1)  # [num_rows, vocab_size]
    top = row_logprobs.topk(num_top, dim=-1)  # [num_rows, num_top]
    return torch.cat([row_logprobs.gather(1, token_ids.view(-1, 1)), top.values], dim=1), top.indices

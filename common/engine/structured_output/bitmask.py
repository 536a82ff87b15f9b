"""Applies a packed token bitmask to logits. torch only, so it runs wherever the
sampler does (CPU or GPU) without the grammar library."""
from __future__ import annotations

import torch

_BITS = 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf the logits of tokens whose bit is clear.
    logits: [num_seqs, vocab_size] float, mutated; bitmask: [len(rows), num_words] int32,
    bitmask[i] masking logits[rows[i]]; bit b of word w is token w * 32 + b."""
    vocab_size = logits.shape[1]
    bitmask = bitmask.to(logits.device)
    shifts = torch.arange(_BITS, dtype=torch.int32, device=logits.device)  # [32]
    # [len(rows), num_words, 32] -> [len(rows), num_words * 32]
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size].bool()
    if allowed.shape[1] < vocab_size:  # a mask narrower than the logits allows none past it
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

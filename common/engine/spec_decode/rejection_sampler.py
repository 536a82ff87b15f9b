"""Verifies draft tokens against the target model's distributions: which drafts a
request keeps, and the one token it emits after them.

Pure functions over tensors, no engine state, so the rule can be tested on its own
and used by any drafting method. The rule is Leviathan et al.'s ("Fast Inference from
Transformers via Speculative Decoding", 2023): accept draft d_j with probability
min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a token drawn from
normalize(max(0, p_j - q_j)); when every draft is accepted emit a bonus token drawn
from p_k. Every emitted token is then distributed exactly as if the target had
sampled it alone, whatever the drafts were.

Point-mass drafts (n-gram lookup, greedy draft models) have q_j = one-hot(d_j): the
draft is accepted with probability p_j(d_j), and the residual is p_j with d_j
zeroed. With a target that samples one token per position (greedy or seeded), the
rule reduces to comparing the target's own tokens with the drafts:
num_accepted_point_mass.

A draft distribution that cannot be trusted at a position (q_j(d_j) zero or NaN, a
row with NaN, inf or negative entries, or a row summing to ~0) is treated as a point
mass there: exactness still holds, and a rejected draft token can never be emitted,
because the residual gives it zero weight.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

# A draft row whose total mass is at most this is treated as no distribution at all.
_MIN_DRAFT_MASS = 1e-12


def num_accepted_point_mass(target_token_ids: Sequence[int],
                            draft_token_ids: Sequence[int]) -> int:
    """Number of leading drafts the target agrees with. target_token_ids[j] is the
    token the target samples after the prefix extended by draft_token_ids[:j], for
    j = 0..k; the request then emits target_token_ids[:returned + 1] (the accepted
    drafts, then the target's token at the first mismatch, or the bonus token)."""
    if len(target_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(
            f"target_token_ids must have one more entry than draft_token_ids (a target "
            f"token per draft plus the bonus), got {len(target_token_ids)} and "
            f"{len(draft_token_ids)}")
    num_accepted = 0
    for target_token_id, draft_token_id in zip(target_token_ids, draft_token_ids):
        if target_token_id != draft_token_id:
            break
        num_accepted += 1
    return num_accepted


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                     num_draft_tokens: Sequence[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator) -> list[list[int]]:
    """Emitted token ids per request: its accepted drafts, then one more token.

    target_probs: [num_reqs, max_k + 1, vocab_size], position j of row i being the
        target distribution after the row's drafts[:j]; positions past
        num_draft_tokens[i] are padding and never read for sampling.
    draft_token_ids: [num_reqs, max_k] int64, padded past num_draft_tokens[i].
    num_draft_tokens: per request, 0..max_k.
    draft_probs: [num_reqs, max_k, vocab_size], or None for point-mass drafts.
    generator: the source of every uniform, so a seed reproduces the output.
    Raises ValueError on mismatched shapes, draft ids outside the vocabulary, or NaN
    or inf in target_probs at a verified position.
    """
    _check_shapes(target_probs, draft_token_ids, num_draft_tokens, draft_probs)
    num_reqs, num_positions, vocab_size = target_probs.shape
    max_k = num_positions - 1
    device = target_probs.device
    if num_reqs == 0:
        return []
    draft_token_ids = draft_token_ids.to(device=device, dtype=torch.long)  # [num_reqs, max_k]; gather needs int64

    num_drafts = torch.tensor(list(num_draft_tokens), dtype=torch.long, device=device)  # [num_reqs]
    positions = torch.arange(num_positions, device=device)  # [max_k + 1]
    is_real_position = positions.unsqueeze(0) <= num_drafts.unsqueeze(1)  # [num_reqs, max_k + 1]
    # Only the positions a row uses are checked: padding may hold anything.
    if bool((~torch.isfinite(target_probs).all(dim=-1) & is_real_position).any()):
        raise ValueError("target_probs has NaN or inf at a verified position")
    is_real_draft = positions[:max_k].unsqueeze(0) < num_drafts.unsqueeze(1)  # [num_reqs, max_k]
    if bool((((draft_token_ids < 0) | (draft_token_ids >= vocab_size)) & is_real_draft).any()):
        raise ValueError(f"draft_token_ids outside the vocabulary [0, {vocab_size})")
    # Padding ids may be anything (e.g. -1): a harmless in-range id keeps gather valid.
    safe_draft_ids = torch.where(is_real_draft, draft_token_ids, 0).unsqueeze(-1)  # [num_reqs, max_k, 1]

    # float64 from here on, as in the engine's sampler: the residual is drawn through
    # its cumulative sum, which in float32 would swallow the tail's tiny probabilities.
    target_of_draft = target_probs[:, :max_k].gather(
        -1, safe_draft_ids).squeeze(-1).to(torch.float64)  # [num_reqs, max_k]
    if draft_probs is None:
        is_point_mass = torch.ones(num_reqs, max_k, dtype=torch.bool, device=device)  # [num_reqs, max_k]
        draft_mass = torch.ones(num_reqs, max_k, dtype=torch.float64, device=device)  # [num_reqs, max_k]
        draft_of_draft = draft_mass  # [num_reqs, max_k]
    else:
        draft_mass = draft_probs.sum(dim=-1, dtype=torch.float64)  # [num_reqs, max_k]
        draft_of_draft = draft_probs.gather(
            -1, safe_draft_ids).squeeze(-1).to(torch.float64)  # [num_reqs, max_k]
        # A NaN entry makes the sum NaN and an inf one makes it inf: both fail isfinite.
        is_point_mass = (~torch.isfinite(draft_mass) | (draft_mass <= _MIN_DRAFT_MASS)
                         | (draft_probs < 0).any(dim=-1)
                         | ~(draft_of_draft > 0))  # [num_reqs, max_k]; NaN fails "> 0"
    # q_j(d_j) of the normalised draft distribution; 1 for a point mass.
    draft_prob_of_draft = torch.where(
        is_point_mass, 1.0, draft_of_draft / draft_mass)  # [num_reqs, max_k]

    uniforms = torch.rand(num_reqs, max_k, dtype=torch.float64, device=device,
                          generator=generator)  # [num_reqs, max_k]
    # u < p/q accepts with probability min(1, p/q) for u in [0, 1), and never when p = 0.
    is_accepted = uniforms < target_of_draft / draft_prob_of_draft  # [num_reqs, max_k]
    # A row stops at its first rejection or after its last draft; the extra last
    # column is where a row of max_k accepted drafts stops.
    stops = torch.cat([~is_accepted | ~is_real_draft,
                       torch.ones(num_reqs, 1, dtype=torch.bool, device=device)],
                      dim=1)  # [num_reqs, max_k + 1]
    num_accepted = stops.to(torch.uint8).argmax(dim=1)  # [num_reqs]; argmax = first True

    # One distribution per row at its stop position: the residual after a rejection,
    # or p_k itself for the bonus token (nothing is subtracted there). gather rather
    # than fancy indexing: several times cheaper on CPU for large batches.
    stop_target = target_probs.gather(1, num_accepted.view(-1, 1, 1).expand(-1, 1, vocab_size)).squeeze(
        1).to(torch.float64)  # [num_reqs, vocab_size]
    is_rejected = num_accepted < num_drafts  # [num_reqs]
    # The rejected draft's column; clamped for bonus rows, which subtract nothing.
    stop_position = num_accepted.clamp(max=max(max_k - 1, 0)).unsqueeze(1)  # [num_reqs, 1]
    if max_k:
        stop_draft_ids = safe_draft_ids.squeeze(-1).gather(1, stop_position)  # [num_reqs, 1]
        stop_draft = torch.zeros_like(stop_target).scatter_(1, stop_draft_ids, 1.0)  # [num_reqs, vocab_size]
        if draft_probs is not None:
            is_trusted = ~is_point_mass.gather(1, stop_position)  # [num_reqs, 1]
            stop_draft_probs = draft_probs.gather(
                1, stop_position.unsqueeze(-1).expand(-1, 1, vocab_size)).squeeze(1).to(
                torch.float64) / draft_mass.gather(1, stop_position)  # [num_reqs, vocab_size]
            stop_draft = torch.where(is_trusted, stop_draft_probs, stop_draft)
        stop_draft.mul_(is_rejected.unsqueeze(1))
        residual = (stop_target - stop_draft).clamp_(min=0.0)  # [num_reqs, vocab_size]
    else:
        stop_draft_ids = torch.zeros(num_reqs, 1, dtype=torch.long, device=device)  # [num_reqs, 1]
        residual = stop_target
    # Rounding can leave a rejection with no residual mass (p ~ q): fall back to p
    # without the rejected token, which the residual would have zeroed anyway.
    empty_rows = torch.nonzero(residual.sum(dim=-1) <= 0).squeeze(1)  # [num_empty]
    if empty_rows.numel():
        rejected_rows = empty_rows[is_rejected[empty_rows]]  # [num_empty_rejected]
        residual[empty_rows] = stop_target[empty_rows]
        residual[rejected_rows, stop_draft_ids[rejected_rows, 0]] = 0.0
        if bool((residual[empty_rows].sum(dim=-1) <= 0).any()):
            raise ValueError("target_probs has no mass left to sample from at a verified position")
    last_token_ids = _draw(residual, generator)  # [num_reqs]

    # Each row's accepted drafts with its last token written after them.
    emitted = torch.cat([draft_token_ids, draft_token_ids.new_zeros(num_reqs, 1)], dim=1).scatter_(
        1, num_accepted.unsqueeze(1), last_token_ids.unsqueeze(1))  # [num_reqs, max_k + 1]
    # Through numpy: torch's tolist is several times slower.
    return [row[:n + 1] for row, n in zip(emitted.cpu().numpy().tolist(), num_accepted.tolist())]


def _check_shapes(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                  num_draft_tokens: Sequence[int], draft_probs: torch.Tensor | None) -> None:
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [num_reqs, max_k + 1, vocab_size], "
                         f"got shape {tuple(target_probs.shape)}")
    num_reqs, num_positions, vocab_size = target_probs.shape
    max_k = num_positions - 1
    if tuple(draft_token_ids.shape) != (num_reqs, max_k):
        raise ValueError(f"draft_token_ids must be [num_reqs, max_k] = {(num_reqs, max_k)}, "
                         f"got {tuple(draft_token_ids.shape)}")
    if len(num_draft_tokens) != num_reqs or any(not 0 <= n <= max_k for n in num_draft_tokens):
        raise ValueError(f"num_draft_tokens must hold {num_reqs} counts in [0, {max_k}], "
                         f"got {list(num_draft_tokens)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (num_reqs, max_k, vocab_size):
        raise ValueError(f"draft_probs must be [num_reqs, max_k, vocab_size] = "
                         f"{(num_reqs, max_k, vocab_size)}, got {tuple(draft_probs.shape)}")


def _draw(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row, proportional to weights (>= 0, each row's sum > 0), by
    inverting the CDF at one uniform, as the engine's sampler does: a token of zero
    weight is never drawn. weights: [num_rows, vocab_size] float64 -> [num_rows]"""
    cdf = weights.cumsum(dim=-1)  # [num_rows, vocab_size]
    uniforms = torch.rand(weights.shape[0], 1, dtype=torch.float64, device=weights.device,
                          generator=generator)  # [num_rows, 1]
    token_ids = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True)  # [num_rows, 1]
    # u * total may round up to total: stay at or before the last token of weight > 0
    # (the first index where the cdf reaches its maximum).
    return torch.minimum(token_ids, cdf.argmax(dim=-1, keepdim=True)).squeeze(1)

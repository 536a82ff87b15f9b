"""One request's place in its grammar: which tokens may come next.

A grammar held back until the output writes a token sequence (`start_after_token_ids`: a
reasoning model's end-of-thinking marker) is dormant until then: it allows every token, never
completes, and starts at the token after the sequence's first occurrence.
"""
from __future__ import annotations

import torch
import xgrammar as xgr


class RequestGrammar:
    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int, start_after_token_ids: tuple[int, ...] = ()):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._start_after = start_after_token_ids
        self._recent: list[int] = []  # dormant: the output's last len(start_after) tokens
        self.is_active = not start_after_token_ids

    def accept_token(self, token_id: int) -> bool:
        """Advance past an accepted token. False if the grammar forbids it (the sampler
        masked it, so only a token sampled elsewhere can be refused)."""
        if not self.is_active:
            self._recent = (self._recent + [token_id])[-len(self._start_after):]
            self.is_active = tuple(self._recent) == self._start_after
            return True
        return self._matcher.accept_token(token_id)

    def replay(self, token_ids: list[int]) -> bool:
        """Rebuild the state from scratch over the request's output so far."""
        self._matcher.reset()
        self._recent, self.is_active = [], not self._start_after
        return all(self.accept_token(t) for t in token_ids)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return self.is_active and self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask: [num_rows, ceil(vocab_size / 32)] int32; bit t of row set = token t allowed.
        Only for an active grammar (a dormant one constrains nothing)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

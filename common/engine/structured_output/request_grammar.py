"""One request's place in its grammar: which tokens may come next."""
from __future__ import annotations

import torch
import xgrammar as xgr


class RequestGrammar:
    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size

    def accept_token(self, token_id: int) -> bool:
        """Advance past an accepted token. False if the grammar forbids it (the sampler
        masked it, so only a token sampled elsewhere can be refused)."""
        return self._matcher.accept_token(token_id)

    def replay(self, token_ids: list[int]) -> bool:
        """Rebuild the state from scratch over the request's output so far."""
        self._matcher.reset()
        return all(self._matcher.accept_token(t) for t in token_ids)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask: [num_rows, ceil(vocab_size / 32)] int32; bit t of row set = token t allowed."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

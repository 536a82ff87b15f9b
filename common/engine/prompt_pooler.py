"""Embedding requests' pooling on the worker: the pooled final hidden state of each prompt
the step finishes. Last-token pooling (LAST) reads one row; the others
(pooling_params.POOLING_TYPES) read every token's state, so a prompt computed in several
chunks keeps a running partial here between its steps, fed in position order from 0
(such prompts take no prefix-cache hits; one preempted and computed again starts over).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.engine.outputs import ScheduledRequest


@dataclass
class _Partial:
    state: torch.Tensor  # [hidden_size] float32: the sum, weighted sum, maximum or first state so far
    num_tokens: int  # positions 0 .. num_tokens - 1 are in it


class PromptPooler:
    """Running partials of the prompts being pooled, by req_id; the runner drops those of
    finished or aborted requests (remove)."""

    def __init__(self) -> None:
        self._partials: dict[str, _Partial] = {}

    @property
    def num_partials(self) -> int:
        return len(self._partials)

    def remove(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._partials.pop(req_id, None)

    def pool_step(self, ordered: list[ScheduledRequest], hidden: torch.Tensor) -> dict[str, list[float]] | None:
        """req_id -> pooled state of each do_pool request of the step, None where there is
        none. `ordered` is the step's requests in row order, hidden [num_tokens, hidden_size]
        their final hidden states."""
        pooled, first_row = {}, 0
        for req in ordered:
            rows = hidden[first_row:first_row + len(req.token_ids)]  # [num_chunk_tokens, hidden_size]
            first_row += len(req.token_ids)
            if req.pooling_type is not None:
                self._add_chunk(req, rows)
                if req.do_pool:
                    pooled[req.req_id] = self._finish(req.req_id, req.pooling_type).tolist()
            elif req.do_pool:
                pooled[req.req_id] = rows[-1].float().tolist()
        return pooled or None

    def _add_chunk(self, req: ScheduledRequest, rows: torch.Tensor) -> None:
        rows = rows.float()  # [num_chunk_tokens, hidden_size]
        start = req.start_pos
        partial = self._partials.get(req.req_id)
        if start == 0:
            partial = None  # a prompt computed again after a preemption starts over
        elif partial is None or partial.num_tokens != start:
            pooled = "nothing" if partial is None else f"{partial.num_tokens} positions"
            raise RuntimeError(f"request {req.req_id}: a chunk from position {start} of a prompt pooled by "
                               f"{req.pooling_type} arrived with {pooled} pooled before it")
        kind = req.pooling_type
        if kind == "CLS":
            chunk_state = rows[0]
        elif kind == "MAX":
            chunk_state = rows.amax(dim=0)
        elif kind == "WEIGHTED_MEAN":
            # [num_chunk_tokens]
            weights = torch.arange(start + 1, start + rows.shape[0] + 1, dtype=rows.dtype, device=rows.device)
            chunk_state = weights @ rows
        else:  # MEAN, MEAN_SQRT_LEN
            chunk_state = rows.sum(dim=0)
        if partial is None:
            partial = self._partials[req.req_id] = _Partial(chunk_state.clone(), 0)
        elif kind == "MAX":
            torch.maximum(partial.state, chunk_state, out=partial.state)
        elif kind != "CLS":
            partial.state += chunk_state
        partial.num_tokens += rows.shape[0]

    def _finish(self, req_id: str, kind: str) -> torch.Tensor:
        partial = self._partials.pop(req_id)
        if kind == "MEAN":
            return partial.state / partial.num_tokens
        if kind == "MEAN_SQRT_LEN":
            return partial.state / math.sqrt(partial.num_tokens)
        if kind == "WEIGHTED_MEAN":  # weights 1 .. n, positions arriving from 0 in order
            return partial.state / (partial.num_tokens * (partial.num_tokens + 1) / 2)
        return partial.state  # CLS, MAX

"""Joins the tensor-parallel ranks' reports of a KV transfer into one (vLLM's
KVOutputAggregator).

Each rank moves only its shard of a request's KV and reports its own part ending. The
scheduler may free or use the request's blocks only when no rank touches them any
more, so a transfer ends for the engine once every rank reported it: done when every
part is done, else as the first part that did not succeed. Bytes add up; the times
span the parts.
"""
from __future__ import annotations

from common.engine.kv_connector.metadata import KVTransferOutcome


class KVOutcomeAggregator:
    def __init__(self, num_ranks: int):
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self.num_ranks = num_ranks
        # (req_id, direction, transfer_id) -> the parts reported so far, one per rank
        self._parts: dict[tuple[str, str, str], list[KVTransferOutcome]] = {}

    def add(self, outcomes_by_rank: list[list[KVTransferOutcome]]) -> list[KVTransferOutcome]:
        """One step's reports, a list per rank: the transfers that every rank has now reported."""
        if len(outcomes_by_rank) != self.num_ranks:
            raise ValueError(f"{len(outcomes_by_rank)} ranks reported, expected {self.num_ranks}")
        ended: list[KVTransferOutcome] = []
        for rank_outcomes in outcomes_by_rank:
            for outcome in rank_outcomes:
                key = (outcome.req_id, outcome.direction, outcome.transfer_id)
                parts = self._parts.setdefault(key, [])
                parts.append(outcome)
                if len(parts) == self.num_ranks:
                    del self._parts[key]
                    ended.append(join_parts(parts))
        return ended

    @property
    def num_open(self) -> int:
        """Transfers some rank has reported and another has not yet."""
        return len(self._parts)


def join_parts(parts: list[KVTransferOutcome]) -> KVTransferOutcome:
    first = parts[0]
    failed = next((p for p in parts if not p.ok), None)
    first_bytes = [p.first_byte_at for p in parts if p.first_byte_at is not None]
    ends = [p.ended_at for p in parts if p.ended_at is not None]
    return KVTransferOutcome(
        req_id=first.req_id, transfer_id=first.transfer_id, direction=first.direction,
        state=failed.state if failed else first.state, reason=failed.reason if failed else "",
        num_bytes=sum(p.num_bytes for p in parts), started_at=min(p.started_at for p in parts),
        first_byte_at=min(first_bytes) if first_bytes else None, ended_at=max(ends) if ends else None)

"""Joining the tensor-parallel ranks' parts of a KV transfer."""
from __future__ import annotations

import pytest

from common.engine.kv_connector.metadata import KVTransferOutcome
from common.engine.kv_connector.outcome_aggregator import KVOutcomeAggregator


def part(req_id: str, state: str = "done", reason: str = "", num_bytes: int = 10, started_at: float = 1.0,
         first_byte_at: float | None = 2.0, ended_at: float = 3.0, direction: str = "recv") -> KVTransferOutcome:
    return KVTransferOutcome(req_id=req_id, transfer_id=f"t-{req_id}", direction=direction, state=state,
                             reason=reason, num_bytes=num_bytes, started_at=started_at,
                             first_byte_at=first_byte_at, ended_at=ended_at)


def test_a_transfer_ends_only_once_every_rank_reported_it():
    aggregator = KVOutcomeAggregator(2)
    assert aggregator.add([[part("a", started_at=1.0, ended_at=5.0)], []]) == []
    assert aggregator.num_open == 1
    [joined] = aggregator.add([[], [part("a", started_at=0.5, first_byte_at=None, ended_at=4.0)]])
    assert (joined.req_id, joined.state, joined.num_bytes) == ("a", "done", 20)
    assert (joined.started_at, joined.first_byte_at, joined.ended_at) == (0.5, 2.0, 5.0)
    assert aggregator.num_open == 0


def test_one_failed_part_fails_the_transfer_with_its_reason():
    aggregator = KVOutcomeAggregator(3)
    [joined] = aggregator.add([[part("a")], [part("a", state="expired", reason="deadline")], [part("a")]])
    assert (joined.state, joined.reason, joined.ok) == ("expired", "deadline", False)


def test_sends_and_receives_of_one_request_are_separate_transfers():
    aggregator = KVOutcomeAggregator(2)
    assert aggregator.add([[part("a", direction="send")], [part("a")]]) == []
    assert [o.direction for o in aggregator.add([[part("a")], [part("a", direction="send")]])] == ["recv", "send"]


def test_a_report_from_the_wrong_number_of_ranks_is_refused():
    with pytest.raises(ValueError, match="1 ranks reported, expected 2"):
        KVOutcomeAggregator(2).add([[]])

"""Scheduler with speculative drafts, hand-built RunnerOutputs (no model); block_size 4.

A runner output here is what the runner returns after verification: for each
sampling request the accepted drafts then the target's own token, and the drafts
proposed for its next step.
"""
from __future__ import annotations

import pytest

from common.engine.block_hash import ROOT_PARENT_HASH, compute_block_hashes
from common.engine.block_pool import BlockStored
from common.engine.config import SpeculativeConfig
from common.engine.outputs import RunnerOutput, SchedulerOutput
from common.engine.request import RequestStatus
from tests.unit.common.engine.test_scheduler import EOS, make_request

DRAFT = 900  # draft tokens are 900.., so a leak of one into a cached block shows


def spec_config(k: int = 3, **overrides) -> SpeculativeConfig:
    overrides.setdefault("disable_by_batch_size", None)
    overrides.setdefault("min_acceptance_rate", 0.0)
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, **overrides)


def verify(scheduler_output: SchedulerOutput, emitted: dict[str, list[int]],
           proposals: dict[str, list[int]] | None = None) -> RunnerOutput:
    sampled = [s for s in scheduler_output.scheduled if s.do_sample]
    proposals = proposals or {}
    # As the runner: drafts only where asked for, and no more than asked for.
    return RunnerOutput(req_ids=[s.req_id for s in sampled],
                        sampled_token_ids=[emitted.get(s.req_id, [7]) for s in sampled],
                        spec_token_ids=[proposals.get(s.req_id, [])[:s.num_drafts_to_propose] for s in sampled])


def step(scheduler, emitted=None, proposals=None):
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, verify(out, emitted or {}, proposals))
    return out, {o.req_id: o for o in outputs}


def start_decoding(scheduler, req, first_token: int = 7, proposal: list[int] | None = None):
    """Prefill the request whole; it samples first_token and gets `proposal` as drafts."""
    scheduler.add_request(req)
    out, _ = step(scheduler, {req.req_id: [first_token]}, {req.req_id: proposal or []})
    assert out.scheduled[0].do_sample
    return out


def test_partial_acceptance_takes_back_rejected_drafts(make_scheduler):
    scheduler = make_scheduler(speculative_config=spec_config())
    req = make_request("a", 3)
    start_decoding(scheduler, req, 7, [DRAFT, DRAFT + 1, DRAFT + 2])
    out = scheduler.schedule()
    (scheduled,) = out.scheduled
    assert scheduled.token_ids == [7, DRAFT, DRAFT + 1, DRAFT + 2] and scheduled.start_pos == 3
    assert out.scheduled_spec_decode_tokens == {"a": [DRAFT, DRAFT + 1, DRAFT + 2]}
    assert out.num_scheduled_tokens == 4 and req.num_computed_tokens == 7
    # The first draft is accepted, the second rejected: the target's own token 11 follows.
    outputs = scheduler.update_from_output(out, verify(out, {"a": [DRAFT, 11]}))
    assert outputs[0].new_token_ids == [DRAFT, 11]
    assert req.all_token_ids[3:] == [7, DRAFT, 11]
    # KV stands for the prompt, 7 and the accepted draft; 11 runs next step.
    assert req.num_computed_tokens == 5 == req.num_tokens - 1
    out, _ = step(scheduler)
    assert out.scheduled[0].token_ids == [11] and out.scheduled[0].start_pos == 5
    stats = scheduler.stats
    assert (stats["spec_num_drafts"], stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]) == (1, 3, 1)
    assert stats["spec_num_accepted_tokens_per_pos"] == [1, 0, 0]
    assert stats["spec_mean_acceptance_length"] == 2.0


def test_all_accepted_adds_the_bonus_token(make_scheduler):
    scheduler = make_scheduler(speculative_config=spec_config())
    req = make_request("a", 3)
    start_decoding(scheduler, req, 7, [8, 9, 10])
    out, outputs = step(scheduler, {"a": [8, 9, 10, 11]})
    assert outputs["a"].new_token_ids == [8, 9, 10, 11]
    assert req.num_computed_tokens == req.num_tokens - 1 == 7
    assert scheduler.stats["spec_num_accepted_tokens_per_pos"] == [1, 1, 1]


def test_drafts_are_cut_by_the_token_budget(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=3, speculative_config=spec_config())
    req = make_request("a", 3)
    start_decoding(scheduler, req, 7, [8, 9, 10])
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [8, 9]} and out.num_scheduled_tokens == 3
    scheduler.update_from_output(out, verify(out, {"a": [8, 12]}))
    assert req.num_computed_tokens == req.num_tokens - 1


def test_drafts_are_capped_by_max_tokens(make_scheduler):
    scheduler = make_scheduler(speculative_config=spec_config())
    req = make_request("a", 3, max_tokens=3)  # one output so far: two more, at most one draft
    start_decoding(scheduler, req, 7, [8, 9, 10])
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [8]}
    outputs = scheduler.update_from_output(out, verify(out, {"a": [8, 9]}))
    assert outputs[0].new_token_ids == [8, 9] and outputs[0].finish_reason == "length"
    assert req.num_output_tokens == 3


def test_drafts_are_capped_by_max_model_len(make_scheduler):
    scheduler = make_scheduler(max_model_len=6, speculative_config=spec_config())
    req = make_request("a", 3)  # 4 tokens after the first output: one more draft fits
    start_decoding(scheduler, req, 7, [8, 9, 10])
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [8]}
    outputs = scheduler.update_from_output(out, verify(out, {"a": [8, 9]}))
    assert outputs[0].finish_reason == "length" and req.num_tokens == 6


def test_eos_inside_an_accepted_run_ends_the_request_there(make_scheduler):
    scheduler = make_scheduler(speculative_config=spec_config())
    req = make_request("a", 3)
    start_decoding(scheduler, req, 7, [8, EOS, 10])
    out, outputs = step(scheduler, {"a": [8, EOS, 10, 11]})
    assert outputs["a"].new_token_ids == [8, EOS] and outputs["a"].finish_reason == "stop"
    assert req.output_token_ids == [7, 8, EOS] and req.status is RequestStatus.FINISHED_STOPPED
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_stop_token_inside_an_accepted_run_ends_the_request_there(make_scheduler):
    scheduler = make_scheduler(speculative_config=spec_config())
    req = make_request("a", 3, stop_token_ids=[9])
    start_decoding(scheduler, req, 7, [8, 9, 10])
    _, outputs = step(scheduler, {"a": [8, 9, 10, 11]})
    assert outputs["a"].new_token_ids == [8, 9] and outputs["a"].stop_reason == 9


def test_requests_whose_drafts_keep_failing_back_off_then_probe_again(make_scheduler):
    scheduler = make_scheduler(speculative_config=spec_config(min_acceptance_rate=0.5, num_backoff_steps=2))
    req = make_request("a", 3)
    start_decoding(scheduler, req, 7, [DRAFT, DRAFT + 1, DRAFT + 2])
    failing = {"a": [DRAFT] * 3}
    step(scheduler, {"a": [11]}, failing)  # nothing accepted: the EMA falls to 0.5 ...
    out, _ = step(scheduler, {"a": [12]}, failing)  # ... then 0.25 < 0.5: a pause of 2 steps
    assert out.scheduled_spec_decode_tokens == {"a": [DRAFT] * 3}

    def num_paused_steps() -> int:
        """Steps until drafts are asked for again (the drafts already proposed are dropped)."""
        num_steps = 0
        while True:
            out, _ = step(scheduler, {"a": [13]}, failing)
            if out.scheduled[0].num_drafts_to_propose:
                return num_steps
            assert out.scheduled_spec_decode_tokens == {}
            num_steps += 1

    assert num_paused_steps() == 2
    out, _ = step(scheduler, {"a": [14]}, failing)  # a probe drafts one token; it fails: twice the pause
    assert out.scheduled_spec_decode_tokens == {"a": [DRAFT]}
    assert num_paused_steps() == 4
    out, _ = step(scheduler, {"a": [DRAFT, 15]}, failing)  # a good probe ends the doubling ...
    assert out.scheduled_spec_decode_tokens == {"a": [DRAFT]}
    assert req.num_spec_backoffs == 0 and req.num_spec_backoff_steps == 0
    out, _ = step(scheduler, {"a": [16]})
    assert out.scheduled[0].num_drafts_to_propose == 3  # ... and all k drafts are asked for again


def test_a_new_request_starts_from_the_engines_recent_acceptance(make_scheduler):
    """When the proposer has been failing everyone, a new request pauses after its first
    failed verification instead of paying for three."""
    scheduler = make_scheduler(speculative_config=spec_config(min_acceptance_rate=0.5, num_backoff_steps=2))
    failing = {"b": [DRAFT] * 3}
    for i in range(8):  # earlier requests whose drafts all failed
        earlier = make_request(f"earlier-{i}", 3)
        start_decoding(scheduler, earlier, 7, [DRAFT] * 3)
        step(scheduler, {earlier.req_id: [20]})
        scheduler.abort_requests([earlier.req_id])
    assert scheduler.spec_policy.engine_acceptance_rate < 0.5
    b = make_request("b", 3)
    start_decoding(scheduler, b, 7, [DRAFT] * 3)
    step(scheduler, {"b": [31]}, failing)
    assert b.num_spec_backoff_steps > 0  # paused after one failure


class _OpenGrammar:
    """A constraint that accepts every token and never completes."""

    is_terminated = False

    def accept_token(self, token_id: int) -> bool:
        return True


def test_constrained_requests_do_not_speculate(make_scheduler):
    scheduler = make_scheduler(speculative_config=spec_config())
    req = make_request("a", 3)
    req.grammar = _OpenGrammar()
    start_decoding(scheduler, req, 7, [8, 9, 10])
    out, _ = step(scheduler)
    assert out.scheduled_spec_decode_tokens == {} and out.scheduled[0].num_drafts_to_propose == 0


def test_large_batches_do_not_speculate(make_scheduler):
    """vLLM's rule (large_batch_min_acceptance_rate None): past disable_by_batch_size running
    requests, nobody drafts."""
    scheduler = make_scheduler(speculative_config=spec_config(disable_by_batch_size=1,
                                                              large_batch_min_acceptance_rate=None))
    a, b = make_request("a", 3), make_request("b", 3)
    start_decoding(scheduler, a, 7, [8, 9])
    out, _ = step(scheduler, {"a": [8, 9, 10]}, {"a": [11]})
    assert out.scheduled_spec_decode_tokens == {"a": [8, 9]}
    scheduler.add_request(b)
    out, _ = step(scheduler, {"a": [11]}, {"a": [12], "b": [13]})  # b joins: two running next step
    out, _ = step(scheduler)
    assert out.scheduled_spec_decode_tokens == {}
    assert all(s.num_drafts_to_propose == 0 for s in out.scheduled)
    assert scheduler.stats["spec_num_steps_disabled_by_batch_size"] >= 1


def test_past_the_batch_limit_only_requests_whose_drafts_hold_speculate(make_scheduler):
    """Past disable_by_batch_size, a request drafts while its acceptance rate is at least
    large_batch_min_acceptance_rate (a newcomer: while the engine's is); one whose drafts
    fail stops there, and the rest of the batch keeps going."""
    scheduler = make_scheduler(speculative_config=spec_config(disable_by_batch_size=1,
                                                              large_batch_min_acceptance_rate=0.8))
    a, b = make_request("a", 3), make_request("b", 3)
    start_decoding(scheduler, a, 7, [8, 9])
    scheduler.add_request(b)
    # a verifies [8, 9], both hold (its rate 1.0); b is prefilled beside it.
    out, _ = step(scheduler, {"a": [8, 9, 10], "b": [20]}, {"a": [11, 12], "b": [21, 22]})
    assert out.scheduled_spec_decode_tokens == {"a": [8, 9]}
    # Two running, past the limit of 1: both still draft (b on the engine's rate, 1.0).
    assert {s.req_id: s.num_drafts_to_propose for s in out.scheduled} == {"a": 3, "b": 3}
    # a's drafts fail (rate 0: its EMA 0.5), b's hold.
    out, _ = step(scheduler, {"a": [99], "b": [21, 22, 23]}, {"a": [13, 14], "b": [24, 25]})
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12], "b": [21, 22]}
    # a's proposal is dropped and it is asked for no more; b's drafts go on.
    out, _ = step(scheduler, {"a": [30], "b": [24, 25, 26]}, {"b": [27]})
    assert out.scheduled_spec_decode_tokens == {"b": [24, 25]}
    assert {s.req_id: s.num_drafts_to_propose for s in out.scheduled} == {"a": 0, "b": 3}
    assert scheduler.stats["spec_num_steps_disabled_by_batch_size"] == 2


def test_large_batch_min_acceptance_rate_is_a_rate_or_none():
    assert SpeculativeConfig(large_batch_min_acceptance_rate=None).large_batch_min_acceptance_rate is None
    with pytest.raises(ValueError, match=r"large_batch_min_acceptance_rate must be in \[0, 1\] or null; got 1.5"):
        SpeculativeConfig(large_batch_min_acceptance_rate=1.5)


def test_preemption_with_drafts_pending_drops_them_and_frees_every_block(make_scheduler):
    scheduler = make_scheduler(num_blocks=4, speculative_config=spec_config())
    a, b = make_request("a", 3), make_request("b", 3)
    start_decoding(scheduler, a, 7, [8, 9, 10])
    start_decoding(scheduler, b, 7, [8, 9, 10])
    # Both need a second block for their drafts, then more: the newest is preempted.
    for _ in range(3):
        out, _ = step(scheduler, {"a": [8, 9, 10, 11], "b": [8, 9, 10, 11]}, {"a": [1, 2, 3], "b": [1, 2, 3]})
    assert b.status is RequestStatus.PREEMPTED and b.spec_token_ids == [] and scheduler.num_preemptions >= 1
    scheduler.kv_cache_manager.check_invariants()
    scheduler.abort_requests(["a", "b"])
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_abort_with_drafts_scheduled_frees_every_block(make_scheduler):
    scheduler = make_scheduler(speculative_config=spec_config())
    req = make_request("a", 3)
    start_decoding(scheduler, req, 7, [8, 9, 10])
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens
    scheduler.abort_requests(["a"])
    assert scheduler.update_from_output(out, verify(out, {"a": [8, 9, 10, 11]})) == []
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


@pytest.mark.parametrize("accept_pattern", [[0, 3, 1, 2, 0, 3], [3, 3, 3, 3], [0, 0, 0, 0, 0, 0, 0]])
def test_no_cached_block_or_block_stored_event_covers_a_draft_token(make_scheduler, accept_pattern):
    """Drafts are 900.. and every rejection replaces them with a verified token < 900:
    nothing the prefix cache holds or announces may contain a token >= 900 that was
    never accepted, and every cached hash must be the hash of verified tokens."""
    scheduler = make_scheduler(num_blocks=32, speculative_config=spec_config())
    kv = scheduler.kv_cache_manager
    req = make_request("a", 5)
    start_decoding(scheduler, req, 7, [DRAFT, DRAFT + 1, DRAFT + 2])
    next_token = 100
    verified = req.prompt_token_ids + [7]  # kept by the test, not read from the request
    for num_accepted in accept_pattern:
        out = scheduler.schedule()
        drafts = out.scheduled_spec_decode_tokens["a"]
        emitted = drafts[:num_accepted] + [next_token]
        next_token += 1
        proposals = {"a": [DRAFT + next_token + i for i in range(3)]}
        scheduler.update_from_output(out, verify(out, {"a": emitted}, proposals))
        verified += emitted
        assert req.all_token_ids == verified
        for event in kv.take_events():
            if isinstance(event, BlockStored):
                start = verified.index(event.token_ids[0]) if event.parent_block_hash is not None else 0
                assert event.token_ids == verified[start:start + len(event.token_ids)]
        num_full = req.num_tokens // 4
        for block_id, block_hash in zip(kv.get_block_ids("a"), req.block_hashes[:num_full]):
            block = kv.block_pool.blocks[block_id]
            assert block.block_hash in (None, block_hash)
        # Every hash the request holds is the chained hash of verified tokens only.
        assert req.block_hashes == compute_block_hashes(verified, 4, ROOT_PARENT_HASH)[:len(req.block_hashes)]
    assert kv.block_pool.cached_blocks  # the check above had blocks to look at

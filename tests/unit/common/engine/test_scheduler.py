"""Scheduler with hand-built RunnerOutputs (no model); block_size 4 throughout."""
from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest

from common.engine.config import SchedulerConfig
from common.engine.kv_connector.metadata import KVTransferOutcome
from common.engine.kv_connector.transfer_scheduler import TransferConnectorScheduler
from common.engine import scheduler as scheduler_module
from common.engine.outputs import RequestTimings, RunnerOutput, SchedulerOutput
from common.engine.request import Request, RequestStatus
from common.engine.sampling_params import SamplingParams

EOS = 2
_arrival = itertools.count()


def make_request(req_id: str, num_prompt_tokens: int = 0, prompt_token_ids: list[int] | None = None,
                 priority: int = 0, eos_token_ids: tuple[int, ...] = (EOS,), **sampling) -> Request:
    sampling.setdefault("max_tokens", 100)
    if prompt_token_ids is None:  # distinct per request, so no accidental prefix hits
        base = 1000 * (sum(map(ord, req_id)) + 1)
        prompt_token_ids = list(range(base, base + num_prompt_tokens))
    return Request(req_id, prompt_token_ids, SamplingParams(**sampling), eos_token_ids=eos_token_ids,
                   priority=priority, arrival_time=float(next(_arrival)))


def runner_output(scheduler_output: SchedulerOutput, tokens: dict[str, list[int]] | None = None,
                  default_token: int = 7) -> RunnerOutput:
    """What a model runner returns: a token for every chunk that reaches the end."""
    tokens = tokens or {}
    sampled = [s.req_id for s in scheduler_output.scheduled if s.do_sample]
    return RunnerOutput(req_ids=sampled,
                        sampled_token_ids=[tokens.get(req_id, [default_token]) for req_id in sampled])


def step(scheduler, tokens: dict[str, list[int]] | None = None):
    scheduler_output = scheduler.schedule()
    outputs = scheduler.update_from_output(scheduler_output, runner_output(scheduler_output, tokens))
    return scheduler_output, {output.req_id: output for output in outputs}


def chunks(scheduler_output: SchedulerOutput) -> dict[str, tuple[int, int]]:
    return {s.req_id: (s.start_pos, len(s.token_ids)) for s in scheduler_output.scheduled}


def test_chunked_prefill_interleaves_with_decodes(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=8)
    req_a, req_b = make_request("a", 3), make_request("b", 3)
    scheduler.add_request(req_a)
    scheduler.add_request(req_b)
    out, _ = step(scheduler)
    assert chunks(out) == {"a": (0, 3), "b": (0, 3)} and out.num_scheduled_tokens == 6
    req_c = make_request("c", 20)
    scheduler.add_request(req_c)

    expected_c_chunks = [(0, 6), (6, 6), (12, 6), (18, 2)]
    for c_chunk in expected_c_chunks:
        out, _ = step(scheduler)
        # Decodes first (one token each), the long prompt takes what is left of the budget.
        assert chunks(out) == {"a": (req_a.num_tokens - 2, 1), "b": (req_b.num_tokens - 2, 1), "c": c_chunk}
        scheduled_c = out.scheduled[2]
        assert scheduled_c.token_ids == req_c.prompt_token_ids[c_chunk[0]:sum(c_chunk)]
        assert scheduled_c.do_sample == (sum(c_chunk) == 20)
        assert len(scheduled_c.block_table) == -(-sum(c_chunk) // 4)
    assert req_c.num_output_tokens == 1 and req_a.num_output_tokens == 5
    decode = out.scheduled[0]
    assert decode.token_ids == [7] and decode.do_sample and decode.output_token_ids is req_a.output_token_ids
    assert scheduler.kv_cache_manager.get_block_ids("a") == decode.block_table


@pytest.mark.parametrize("threshold, first_step", [
    (0, {"long": (0, 32)}),  # the long prompt takes the whole budget; the short one waits a step
    (8, {"long": (0, 8), "short": (0, 3)}),
])
def test_long_prefill_token_threshold_lets_a_short_prompt_start_beside_a_long_one(make_scheduler, threshold,
                                                                                   first_step):
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=32, long_prefill_token_threshold=threshold)
    scheduler.add_request(make_request("long", 100))
    scheduler.add_request(make_request("short", 3))
    out, _ = step(scheduler)
    assert chunks(out) == first_step
    long_chunks = [chunks(out)["long"]]
    while scheduler.requests["long"].num_output_tokens == 0:
        out, _ = step(scheduler)
        long_chunks.append(chunks(out)["long"])
        if threshold:  # the short request decodes beside every chunk
            assert chunks(out)["short"][1] == 1
    sizes = [size for _, size in long_chunks]
    assert sum(sizes) == 100 and max(sizes) == (threshold or 32)


def test_long_prefill_token_threshold_needs_chunked_prefill_and_a_count():
    with pytest.raises(ValueError, match="needs chunked prefill"):
        SchedulerConfig(long_prefill_token_threshold=64, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="integer >= 0"):
        SchedulerConfig(long_prefill_token_threshold=-1)


def test_exact_block_tables(make_scheduler):
    scheduler = make_scheduler(num_blocks=8)
    scheduler.add_request(make_request("a", 5))
    scheduler.add_request(make_request("b", 4))
    out, _ = step(scheduler)
    assert [s.block_table for s in out.scheduled] == [[0, 1], [2]]
    out, _ = step(scheduler)  # b's token at position 4 needs a second block; a's fits in block 1
    assert [s.block_table for s in out.scheduled] == [[0, 1], [2, 3]]


def test_prefix_hit_skips_cached_tokens(make_scheduler):
    scheduler = make_scheduler()
    shared = list(range(100, 108))
    scheduler.add_request(make_request("a", prompt_token_ids=shared + [1, 2, 3], max_tokens=1))
    out_a, _ = step(scheduler)
    req_b = make_request("b", prompt_token_ids=shared + [4, 5])
    scheduler.add_request(req_b)
    out_b, outputs = step(scheduler)
    assert chunks(out_b) == {"b": (8, 2)}
    assert out_b.scheduled[0].block_table[:2] == out_a.scheduled[0].block_table[:2]
    assert req_b.num_cached_tokens == 8 and outputs["b"].num_cached_tokens == 8
    stats = scheduler.stats
    assert (stats["prefix_cache_queried_tokens"], stats["prefix_cache_hit_tokens"]) == (21, 8)

    # The whole prompt cached: the last block is recomputed to get logits.
    req_c = make_request("c", prompt_token_ids=shared)
    scheduler.add_request(req_c)
    out_c, _ = step(scheduler)
    assert chunks(out_c)["c"] == (4, 4) and req_c.num_cached_tokens == 4


def test_preempts_newest_and_recomputes(make_scheduler):
    scheduler = make_scheduler(num_blocks=4)
    req_a, req_b = make_request("a", 7, max_tokens=3), make_request("b", 7)
    scheduler.add_request(req_a)
    scheduler.add_request(req_b)
    out, _ = step(scheduler)
    assert [s.block_table for s in out.scheduled] == [[0, 1], [2, 3]]
    step(scheduler, {"a": [11], "b": [21]})  # position 7 still fits in each second block
    # a's token at position 8 needs a block: the newest request (b) is preempted.
    out, outputs = step(scheduler, {"a": [12]})
    assert chunks(out) == {"a": (8, 1)}
    assert req_b.status is RequestStatus.PREEMPTED and req_b.num_computed_tokens == 0
    assert req_b.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert scheduler.waiting == [req_b] and scheduler.running == []  # a finished meanwhile
    # b's blocks were freed tail first, so a took block 3 and block 2 keeps b's prefix.
    assert out.scheduled[0].block_table == [0, 1, 3]
    assert outputs["a"].finish_reason == "length"  # a's third token

    out, _ = step(scheduler)
    # b recomputes prompt and outputs; its first block is still cached.
    assert chunks(out) == {"b": (4, 5)} and out.scheduled[0].block_table[0] == 2
    assert out.scheduled[0].token_ids == req_b.prompt_token_ids[4:] + [7, 21]
    assert out.scheduled[0].do_sample and req_b.status is RequestStatus.RUNNING
    assert req_b.num_cached_tokens == 0  # set at first admission only


def test_request_that_is_newest_preempts_itself(make_scheduler):
    scheduler = make_scheduler(num_blocks=4)
    req_a, req_b = make_request("a", 6), make_request("b", 8)
    scheduler.add_request(req_a)
    scheduler.add_request(req_b)
    step(scheduler)
    scheduler.add_request(req_c := make_request("c", 1))
    out, _ = step(scheduler)  # a decodes in its block; b needs a third block and is newest
    assert chunks(out) == {"a": (6, 1)}  # and c is not admitted in a step that preempted
    assert req_b.status is RequestStatus.PREEMPTED and scheduler.running == [req_a]
    assert scheduler.waiting == [req_b, req_c]  # the preempted request goes first


def test_priority_preemption_unschedules_an_already_scheduled_victim(make_scheduler):
    scheduler = make_scheduler(num_blocks=4)
    req_low = make_request("low", 6, priority=1)
    scheduler.add_request(req_low)
    step(scheduler)
    req_high = make_request("high", 8, priority=0)
    scheduler.add_request(req_high)
    step(scheduler)
    assert scheduler.running == [req_low, req_high]
    # low (position 7) fits and is scheduled first; high (position 8) needs a block and
    # preempts low, the lowest priority, taking back its share of the budget.
    out, _ = step(scheduler)
    assert chunks(out) == {"high": (8, 1)} and out.num_scheduled_tokens == 1
    assert req_low.status is RequestStatus.PREEMPTED and scheduler.running == [req_high]


def test_priority_ordering_and_fcfs(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=1)
    for req_id, priority in [("p2", 2), ("p0", 0), ("p1", 1), ("p0-later", 0)]:
        scheduler.add_request(make_request(req_id, 3, priority=priority, max_tokens=1))
    order = []
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler)
        order += [s.req_id for s in out.scheduled]
    assert order == ["p0", "p0-later", "p1", "p2"]

    fcfs = make_scheduler(max_num_seqs=1)
    for req_id in ["x", "y", "z"]:
        fcfs.add_request(make_request(req_id, 3, max_tokens=1))
    order = []
    while fcfs.has_unfinished_requests():
        out, _ = step(fcfs)
        order += [s.req_id for s in out.scheduled]
    assert order == ["x", "y", "z"]


def test_waiting_limits_seats_and_head_of_line(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=10, enable_chunked_prefill=False)
    for req_id, num_tokens in [("a", 4), ("b", 7), ("c", 1)]:
        scheduler.add_request(make_request(req_id, num_tokens))
    out, _ = step(scheduler)
    # b (7) does not fit whole in the 6 left and blocks c behind it (FCFS head of line).
    assert chunks(out) == {"a": (0, 4)}
    out, _ = step(scheduler)
    assert chunks(out) == {"a": (4, 1), "b": (0, 7)}
    out, _ = step(scheduler)
    assert "c" not in chunks(out) and scheduler.num_waiting == 1  # both seats taken


def test_prompt_longer_than_budget_without_chunking_is_chunked(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", 3))
    scheduler.add_request(make_request("long", 19))
    out, _ = step(scheduler)
    assert chunks(out) == {"a": (0, 3), "long": (0, 5)}
    out, _ = step(scheduler)
    assert chunks(out) == {"a": (3, 1), "long": (5, 7)}
    step(scheduler)
    out, _ = step(scheduler)
    assert chunks(out)["long"] == (19, 1)


@pytest.mark.parametrize("sampling, sampled, expected_tokens, finish_reason, stop_reason", [
    ({}, [5, EOS, 6], [5, EOS], "stop", None),  # EOS: no stop_reason, as in vLLM
    ({"ignore_eos": True, "max_tokens": 3}, [EOS, EOS, EOS], [EOS, EOS, EOS], "length", None),
    ({"stop_token_ids": [9]}, [5, 9], [5, 9], "stop", 9),
    ({"min_tokens": 3, "stop_token_ids": [9]}, [EOS, 9, EOS], [EOS, 9, EOS], "stop", None),
    ({"min_tokens": 2, "stop_token_ids": [9]}, [EOS, 9], [EOS, 9], "stop", 9),
    ({"max_tokens": 2}, [5, 6, 7], [5, 6], "length", None),
    ({"max_tokens": None}, [5] * 9, [5] * 5, "length", None),  # max_model_len 8, prompt 3
])
def test_stop_conditions(make_scheduler, sampling, sampled, expected_tokens, finish_reason, stop_reason):
    scheduler = make_scheduler(max_model_len=8)
    req = make_request("a", 3, **sampling)
    scheduler.add_request(req)
    outputs = []
    for token_id in sampled:
        if not scheduler.has_unfinished_requests():
            break
        outputs.append(step(scheduler, {"a": [token_id]})[1]["a"])
    assert req.output_token_ids == expected_tokens
    assert outputs[-1].finish_reason == finish_reason and outputs[-1].stop_reason == stop_reason
    assert all(not output.finished for output in outputs[:-1])
    assert scheduler.kv_cache_manager.num_free_blocks == 16
    assert scheduler.schedule().finished_req_ids == ["a"]


def test_several_tokens_in_one_step_stop_at_the_first_stop(make_scheduler):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5, stop_token_ids=[9]))
    _, outputs = step(scheduler, {"a": [4, 9, 5]})
    assert outputs["a"].new_token_ids == [4, 9] and outputs["a"].finish_reason == "stop"


def test_abort_in_every_state_frees_everything(make_scheduler):
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=8)
    running, mid_prefill = make_request("running", 3), make_request("mid_prefill", 12)
    scheduler.add_request(running)
    step(scheduler)
    scheduler.add_request(mid_prefill)
    scheduler.add_request(waiting := make_request("waiting", 4))
    step(scheduler)
    assert mid_prefill.num_computed_tokens == 7 and waiting.status is RequestStatus.WAITING
    remote = make_request("remote", 5)
    assert scheduler.reserve_remote_kv(remote) is not None
    assert scheduler.kv_cache_manager.num_free_blocks < 8

    outputs = scheduler.abort_requests(["running", "mid_prefill", "waiting", "remote", "unknown"])
    assert [(o.req_id, o.finish_reason, o.new_token_ids) for o in outputs] == [
        ("running", "abort", []), ("mid_prefill", "abort", []), ("waiting", "abort", []),
        ("remote", "abort", [])]
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in (running, mid_prefill, waiting, remote))
    assert scheduler.kv_cache_manager.num_free_blocks == 8 and not scheduler.has_unfinished_requests()
    out = scheduler.schedule()
    assert out.is_empty and set(out.finished_req_ids) == {"running", "mid_prefill", "waiting", "remote"}
    scheduler.kv_cache_manager.check_invariants()


def test_abort_preempted_request(make_scheduler):
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("a", 6))
    scheduler.add_request(req_b := make_request("b", 8))
    step(scheduler)
    step(scheduler)
    assert req_b.status is RequestStatus.PREEMPTED
    assert scheduler.abort_requests(["b"])[0].finish_reason == "abort"
    assert scheduler.waiting == []


def test_update_ignores_tokens_of_requests_aborted_mid_step(make_scheduler):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3))
    out = scheduler.schedule()
    scheduler.abort_requests(["a"])
    assert scheduler.update_from_output(out, runner_output(out)) == []


def test_remote_kv_reservation_and_completion(make_scheduler):
    scheduler = make_scheduler(num_blocks=8)
    kv = scheduler.kv_cache_manager
    shared = list(range(100, 104))
    scheduler.add_request(make_request("local", prompt_token_ids=shared + [1, 2], max_tokens=1))
    step(scheduler)  # caches block [100..103]
    kv.take_events()

    req = make_request("r", prompt_token_ids=shared + list(range(200, 206)))
    reservation = scheduler.reserve_remote_kv(req)
    assert reservation.num_cached_tokens == 4
    assert reservation.block_ids[0] == 0 and len(reservation.block_ids) == 3
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert scheduler.schedule().is_empty and kv.take_events() == []  # no KV yet: nothing cached
    assert scheduler.stats["num_waiting_for_remote_kv"] == 1

    outputs = scheduler.finish_remote_kv("r", [42])
    assert [(o.new_token_ids, o.num_cached_tokens, o.finished) for o in outputs] == [([42], 4, False)]
    stored = kv.take_events()
    assert stored[0].block_hashes == [req.block_hashes[1]] and stored[0].token_ids == [200, 201, 202, 203]
    out, _ = step(scheduler)
    assert chunks(out) == {"r": (10, 1)} and out.scheduled[0].token_ids == [42]
    assert out.scheduled[0].block_table == reservation.block_ids
    assert scheduler.finish_remote_kv("r", [1]) == []  # not waiting any more


def test_remote_kv_edge_cases(make_scheduler):
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=2)
    # First token already final.
    assert scheduler.reserve_remote_kv(make_request("one", 5, max_tokens=1)) is not None
    outputs = scheduler.finish_remote_kv("one", [5])
    assert outputs[0].finish_reason == "length" and scheduler.kv_cache_manager.num_free_blocks == 4
    # No token from the prefill: the last prompt token is recomputed locally.
    scheduler.reserve_remote_kv(make_request("none", 5))
    assert scheduler.finish_remote_kv("none", []) == []
    out, _ = step(scheduler)
    assert chunks(out) == {"none": (4, 1)} and out.scheduled[0].do_sample
    # Failure frees the reservation.
    scheduler.reserve_remote_kv(make_request("fail", 3))
    assert scheduler.fail_remote_kv("fail")[0].finish_reason == "abort"
    assert scheduler.fail_remote_kv("fail") == []
    # Too few blocks or seats: None, and nothing is kept.
    assert scheduler.reserve_remote_kv(big := make_request("big", 13)) is None
    assert "big" not in scheduler.requests and big.status is RequestStatus.WAITING
    scheduler.reserve_remote_kv(make_request("seat", 1))
    assert scheduler.reserve_remote_kv(make_request("no_seat", 1)) is None


def test_held_blocks_until_the_send_ended(make_scheduler):
    scheduler = make_scheduler(num_blocks=8, kv_connector=TransferConnectorScheduler("producer", block_size=4))
    scheduler.add_request(exporting("p", 9))
    out, outputs = step(scheduler)
    assert outputs["p"].finish_reason == "length" and not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.get_block_ids("p") == out.scheduled[0].block_table == [0, 1, 2]
    assert [(s.req_id, s.src_block_ids) for s in out.kv_connector_metadata.sends] == [("p", [0, 1, 2])]
    assert scheduler.stats["num_held"] == 1 and scheduler.kv_cache_manager.num_free_blocks == 5
    assert scheduler.has_open_kv_transfers()
    scheduler.update_from_kv_transfers([ended("p", "send")])
    assert not scheduler.release_held_blocks("p") and not scheduler.has_open_kv_transfers()
    assert scheduler.kv_cache_manager.num_free_blocks == 8

    scheduler.add_request(exporting("q", 3))
    step(scheduler)
    assert scheduler.abort_requests(["q"]) == []  # already finished: abort only stops the send
    assert scheduler.schedule().kv_connector_metadata.abort_req_ids == ["q"]
    assert scheduler.kv_cache_manager.num_free_blocks == 7  # the transport may still read it
    scheduler.update_from_kv_transfers([ended("q", "send", "failed")])
    assert scheduler.kv_cache_manager.num_free_blocks == 8


def exporting(req_id: str, num_prompt_tokens: int) -> Request:
    request = make_request(req_id, num_prompt_tokens, max_tokens=1)
    request.kv_transfer_params = {"target": {"transfer_id": f"t-{req_id}"}, "first_block_index": 0}
    return request


def ended(req_id: str, direction: str, state: str = "done") -> KVTransferOutcome:
    return KVTransferOutcome(req_id=req_id, transfer_id=f"t-{req_id}", direction=direction, state=state)


def test_rejects_bad_requests(make_scheduler):
    scheduler = make_scheduler(num_blocks=4, max_model_len=100)
    assert scheduler.max_model_len == 16  # capped at the pool's capacity
    with pytest.raises(ValueError, match="prompt tokens"):
        scheduler.add_request(make_request("long", 17))
    scheduler.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="already exists"):
        scheduler.add_request(make_request("a", 3))


def test_stats(make_scheduler):
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 3))
    step(scheduler)
    stats = scheduler.stats
    assert (stats["num_running"], stats["num_waiting"], stats["num_queued_prefill_tokens"]) == (1, 1, 6 + 3)
    assert stats["kv_cache_usage"] == pytest.approx(1 / 8) and stats["num_total_blocks"] == 8
    assert scheduler.num_running == 1 and scheduler.num_waiting == 1
    scheduler.abort_requests(["b"])
    assert scheduler.stats["num_finished_requests"] == 1


def test_stats_leave_a_waiting_requests_cached_prefix_out_of_its_queued_tokens(make_scheduler):
    scheduler = make_scheduler()
    shared = list(range(100, 108))  # two blocks
    scheduler.add_request(make_request("a", prompt_token_ids=shared + [1, 2, 3], max_tokens=1))
    step(scheduler)
    queried_before = scheduler.stats["prefix_cache_queried_tokens"]
    scheduler.add_request(make_request("b", prompt_token_ids=shared + [4, 5]))
    scheduler.add_request(make_request("c", 6))  # nothing cached
    stats = scheduler.stats
    # b: 10 tokens, 8 cached; c: 6; what the gateway charged for them at dispatch.
    assert (stats["num_waiting"], stats["num_queued_prefill_tokens"]) == (2, 2 + 6)
    assert stats["prefix_cache_queried_tokens"] == queried_before  # looking is not a query
    out, _ = step(scheduler)
    assert chunks(out) == {"b": (8, 2), "c": (0, 6)}


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_invariants(make_scheduler, seed):
    """Small pool, shared prefixes, priorities, aborts, remote KV: every step keeps the
    pool consistent and every request eventually finishes."""
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=9, max_num_seqs=4, max_num_batched_tokens=10,
                               enable_chunked_prefill=seed % 2 == 0, max_model_len=36)
    kv = scheduler.kv_cache_manager
    prefixes = [[rng.randrange(50, 60) for _ in range(8)] for _ in range(3)]
    for step_index in range(400):
        if step_index < 150 and rng.random() < 0.3:
            prompt = (rng.choice(prefixes)[:rng.randrange(1, 9)]
                      + [rng.randrange(3, 50) for _ in range(rng.randrange(0, 12))])
            req = make_request(f"r{step_index}", prompt_token_ids=prompt, priority=rng.choice([0, 0, 1]),
                               max_tokens=rng.randrange(2, 20), min_tokens=rng.choice([0, 2]))
            if rng.random() > 0.2:
                scheduler.add_request(req)
            elif scheduler.reserve_remote_kv(req) is not None:
                if rng.random() < 0.8:
                    scheduler.finish_remote_kv(req.req_id, [rng.randrange(3, 50)])
                else:
                    scheduler.fail_remote_kv(req.req_id)
        if rng.random() < 0.05 and scheduler.requests:
            scheduler.abort_requests([rng.choice(sorted(scheduler.requests))])
        step(scheduler, {req_id: [rng.choice([EOS, 5, 6, 7, 8])] for req_id in scheduler.requests})
        kv.check_invariants()
        assert len(scheduler.running) + len(scheduler.waiting_for_remote_kv) <= 4
        if step_index >= 150 and not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks
    assert scheduler.stats["prefix_cache_hit_tokens"] > 0 and scheduler.num_preemptions > 0


def test_a_request_in_a_running_batch_is_not_scheduled_again_nor_preempted(make_scheduler):
    """Pipeline parallelism keeps batches in flight: the next one leaves their requests alone."""
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=4)
    req_a, req_b = make_request("a", 8), make_request("b", 8)
    scheduler.add_request(req_a)
    scheduler.add_request(req_b)
    s1 = scheduler.schedule()
    assert chunks(s1) == {"a": (0, 4)}  # a's first chunk is in flight...
    s2 = scheduler.schedule(in_flight_req_ids=frozenset({"a"}))
    assert chunks(s2) == {"b": (0, 4)}  # ...so its second chunk waits; b runs meanwhile
    scheduler.update_from_output(s1, runner_output(s1))
    s3 = scheduler.schedule(in_flight_req_ids=frozenset({"b"}))
    assert chunks(s3) == {"a": (4, 4)}
    scheduler.update_from_output(s2, runner_output(s2))
    s4 = scheduler.schedule(in_flight_req_ids=frozenset({"a"}))
    assert chunks(s4) == {"b": (4, 4)}  # every block is taken now
    scheduler.update_from_output(s3, runner_output(s3))  # a sampled: its next token needs a third block
    s5 = scheduler.schedule(in_flight_req_ids=frozenset({"b"}))
    # b's batch may still write its blocks: nobody is preempted, a waits.
    assert chunks(s5) == {} and scheduler.num_preemptions == 0 and req_b.status is RequestStatus.RUNNING
    scheduler.update_from_output(s4, runner_output(s4))
    s6 = scheduler.schedule()  # nothing in flight: the usual preemption of the newest
    assert scheduler.num_preemptions == 1 and req_b.status is RequestStatus.PREEMPTED
    assert chunks(s6) == {"a": (8, 1)}


def test_finished_requests_carry_where_their_time_went(make_scheduler, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    scheduler = make_scheduler(max_num_seqs=1)  # "second" waits until "first" is done

    def step_taking(seconds: float) -> dict[str, object]:
        scheduler_output = scheduler.schedule()
        now[0] += seconds  # the forward pass
        outputs = scheduler.update_from_output(scheduler_output, runner_output(scheduler_output))
        return {output.req_id: output.timings for output in outputs if output.finished}

    first = Request("first", [11, 12, 13, 14, 15], SamplingParams(max_tokens=3), arrival_time=100.0)
    second = Request("second", [21, 22, 23], SamplingParams(max_tokens=1), arrival_time=100.0)
    scheduler.add_request(first)
    scheduler.add_request(second)
    now[0] = 101.0
    assert step_taking(0.5) == {}  # first's prompt and first token
    now[0] += 0.5
    assert step_taking(0.5) == {}
    now[0] += 0.5
    assert step_taking(0.5) == {"first": RequestTimings(queued_s=1.0, prefill_s=0.5, decode_s=2.0, inference_s=2.5)}
    now[0] += 0.5
    assert step_taking(0.25) == {"second": RequestTimings(queued_s=4.0, prefill_s=0.25, decode_s=0.0,
                                                          inference_s=0.25)}

    # Aborted while waiting: all of it queued.
    scheduler.add_request(Request("queued", [31, 32], SamplingParams(max_tokens=4), arrival_time=now[0]))
    scheduler.add_request(Request("blocker", [41, 42], SamplingParams(max_tokens=4), arrival_time=now[0]))
    now[0] += 1.5
    [aborted] = scheduler.abort_requests(["blocker"])
    assert aborted.timings == RequestTimings(queued_s=1.5, prefill_s=0.0, decode_s=0.0, inference_s=0.0)

    # A KV import: queued until its KV (and first token) came; no prefill here.
    imported = Request("imported", [51, 52, 53, 54], SamplingParams(max_tokens=2), arrival_time=now[0])
    scheduler.abort_requests(["queued"])
    assert scheduler.reserve_remote_kv(imported) is not None
    now[0] += 2.0
    assert scheduler.finish_remote_kv("imported", [7])[0].timings is None
    assert step_taking(0.5) == {"imported": RequestTimings(queued_s=2.0, prefill_s=0.0, decode_s=0.5,
                                                            inference_s=0.5)}

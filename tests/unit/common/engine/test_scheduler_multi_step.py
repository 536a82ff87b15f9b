"""Decode steps back to back (num_scheduler_steps) with hand-built RunnerOutputs; block_size 4."""
from __future__ import annotations

import pytest

from common.engine.config import SchedulerConfig
from common.engine.outputs import Logprobs, RunnerOutput, SchedulerOutput
from tests.unit.common.engine.test_scheduler import EOS, make_request


def decode_steps_output(scheduler_output: SchedulerOutput, tokens: dict[str, list[int]] | None = None,
                        default_token: int = 7) -> RunnerOutput:
    """What the runner returns: num_steps tokens for every request that samples."""
    tokens = tokens or {}
    sampled = [s.req_id for s in scheduler_output.scheduled if s.do_sample]
    return RunnerOutput(req_ids=sampled, sampled_token_ids=[
        tokens.get(req_id, [default_token] * scheduler_output.num_steps) for req_id in sampled])


def step(scheduler, tokens: dict[str, list[int]] | None = None):
    scheduler_output = scheduler.schedule()
    outputs = scheduler.update_from_output(scheduler_output, decode_steps_output(scheduler_output, tokens))
    return scheduler_output, {output.req_id: output for output in outputs}


def test_decodes_run_back_to_back_holding_the_slots_of_every_step(make_scheduler):
    scheduler = make_scheduler(num_blocks=16, num_scheduler_steps=4)
    req = make_request("a", 3, temperature=0.0)
    scheduler.add_request(req)
    out, _ = step(scheduler)  # the prompt: one step
    assert out.num_steps == 1 and req.num_tokens == 4 and req.num_computed_tokens == 3
    out, outputs = step(scheduler, {"a": [11, 12, 13, 14]})
    assert out.num_steps == 4
    (scheduled,) = out.scheduled
    assert scheduled.token_ids == [7] and scheduled.start_pos == 3
    # Positions 3..6 are written: the block table reaches position 6.
    assert len(scheduled.block_table) * 4 >= 3 + 4
    assert outputs["a"].new_token_ids == [11, 12, 13, 14]
    # Every token but the last was an input of the steps: its KV is computed.
    assert req.num_computed_tokens == 7 and req.num_tokens == 8
    out, _ = step(scheduler)
    assert out.num_steps == 4 and out.scheduled[0].start_pos == 7 and out.scheduled[0].token_ids == [14]


def test_a_waiting_request_or_a_prefill_gets_single_steps_a_draw_does_not(make_scheduler):
    scheduler = make_scheduler(num_blocks=32, num_scheduler_steps=4, max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 3, temperature=0.0))
    step(scheduler)
    scheduler.add_request(make_request("b", 10, temperature=0.0))  # chunked: 7 then 3 tokens
    out, _ = step(scheduler)
    assert out.num_steps == 1 and {s.req_id: len(s.token_ids) for s in out.scheduled} == {"a": 1, "b": 7}
    out, _ = step(scheduler)  # b's last chunk still runs
    assert out.num_steps == 1
    out, _ = step(scheduler)
    assert out.num_steps == 4
    scheduler.add_request(make_request("c", 3, temperature=0.0))
    out, _ = step(scheduler)  # c waits to be admitted: no request waits for several steps
    assert out.num_steps == 1 and len(out.scheduled) == 3
    out, _ = step(scheduler)
    assert out.num_steps == 4
    scheduler.add_request(make_request("d", 3, temperature=0.8, top_p=0.9))
    step(scheduler)
    out, _ = step(scheduler)  # d draws from the logits alone: the runner's loop takes it too
    assert out.num_steps == 4 and len(out.scheduled) == 4


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_rows_that_report_logprobs_take_steps_back_to_back_with_one_logprobs_entry_a_token(make_scheduler,
                                                                                             temperature):
    scheduler = make_scheduler(num_scheduler_steps=4)
    req = make_request("a", 3, temperature=temperature, logprobs=2)
    scheduler.add_request(req)
    step(scheduler)
    scheduler_output = scheduler.schedule()
    assert scheduler_output.num_steps == 4
    logprobs = [Logprobs(-0.5 - i, [7, 8], [-0.5, -1.0]) for i in range(4)]
    (output,) = scheduler.update_from_output(scheduler_output, RunnerOutput(
        req_ids=["a"], sampled_token_ids=[[11, 12, 13, 14]], logprobs=[logprobs]))
    assert output.new_token_ids == [11, 12, 13, 14] and output.new_logprobs == logprobs


@pytest.mark.parametrize("sampling", [dict(repetition_penalty=1.2, frequency_penalty=0.5), dict(min_tokens=5)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_rows_with_penalties_or_stop_tokens_held_back_take_steps_back_to_back(make_scheduler, sampling,
                                                                               temperature):
    scheduler = make_scheduler(num_scheduler_steps=4)
    scheduler.add_request(make_request("a", 3, temperature=temperature, **sampling))
    step(scheduler)
    out, _ = step(scheduler)
    assert out.num_steps == 4


def test_steps_stop_at_max_tokens_and_max_model_len(make_scheduler):
    scheduler = make_scheduler(num_blocks=32, num_scheduler_steps=8, max_model_len=20)
    req = make_request("a", 3, temperature=0.0, max_tokens=6)
    scheduler.add_request(req)
    step(scheduler)  # one token
    out, outputs = step(scheduler)
    assert out.num_steps == 5 and outputs["a"].finish_reason == "length" and req.num_output_tokens == 6
    req = make_request("b", 14, temperature=0.0, max_tokens=100)
    scheduler.add_request(req)
    step(scheduler)  # 15 tokens of 20
    out, outputs = step(scheduler)
    assert out.num_steps == 5 and outputs["b"].finish_reason == "length" and req.num_tokens == 20
    # The steps' positions stay inside max_model_len.
    assert out.scheduled[0].start_pos + out.num_steps - 1 < 20


def test_a_stop_token_inside_the_burst_ends_the_request_there_and_frees_its_blocks(make_scheduler):
    scheduler = make_scheduler(num_blocks=16, num_scheduler_steps=4)
    req_a = make_request("a", 3, temperature=0.0)
    req_b = make_request("b", 3, temperature=0.0, stop_token_ids=[99])
    scheduler.add_request(req_a)
    scheduler.add_request(req_b)
    step(scheduler)
    out, outputs = step(scheduler, {"a": [5, EOS, 6, 6], "b": [8, 8, 99, 8]})
    assert out.num_steps == 4
    assert outputs["a"].new_token_ids == [5, EOS] and outputs["a"].finish_reason == "stop"
    assert outputs["b"].new_token_ids == [8, 8, 99] and outputs["b"].stop_reason == 99
    assert not scheduler.requests and scheduler.kv_cache_manager.num_free_blocks == 16


def test_a_short_pool_gets_a_single_step_and_preempts_nobody(make_scheduler):
    # After their prompts a and b hold 2 blocks each (7 tokens computed), 1 block is free:
    # one step each fits in their blocks, four (through position 10) need a block each.
    scheduler = make_scheduler(num_blocks=5, num_scheduler_steps=4)
    scheduler.add_request(make_request("a", 7, temperature=0.0))
    scheduler.add_request(make_request("b", 7, temperature=0.0))
    step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 1
    out, outputs = step(scheduler)
    assert out.num_steps == 1 and len(out.scheduled) == 2 and scheduler.num_preemptions == 0
    assert [len(outputs[r].new_token_ids) for r in "ab"] == [1, 1]


def test_a_step_that_returns_fewer_tokens_is_counted_as_run(make_scheduler):
    """The runner may run fewer steps than allowed (a model without the native loop): one
    token back is one step, and the lookahead slots serve later steps."""
    scheduler = make_scheduler(num_blocks=16, num_scheduler_steps=4)
    req = make_request("a", 3, temperature=0.0)
    scheduler.add_request(req)
    step(scheduler)
    out = scheduler.schedule()
    assert out.num_steps == 4
    (output,) = scheduler.update_from_output(out, RunnerOutput(req_ids=["a"], sampled_token_ids=[[11]]))
    assert output.new_token_ids == [11] and out.num_steps == 1  # what ran, for the step's observers
    assert req.num_computed_tokens == 4 and req.num_tokens == 5
    blocks = list(out.scheduled[0].block_table)
    out, _ = step(scheduler)
    assert out.scheduled[0].start_pos == 4 and out.scheduled[0].token_ids == [11]
    assert out.scheduled[0].block_table[:len(blocks)] == blocks


def test_num_scheduler_steps_must_be_positive():
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="num_scheduler_steps"):
            SchedulerConfig(num_scheduler_steps=bad)

"""SchedulerOutput / RunnerOutput through msgpack: every field comes back equal, and a
payload of another shape (a pickle above all) is refused with a clear error."""
from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.engine.kv_connector.metadata import KVConnectorMetadata, KVRecvSpec, KVSendSpec, KVTransferOutcome
from common.engine.outputs import Logprobs, RunnerOutput, ScheduledRequest, SchedulerOutput
from common.engine.outputs_codec import (
    MessageFormatError,
    SchedulerOutputDecoder,
    SchedulerOutputEncoder,
    pack,
    runner_output_from_dict,
    runner_output_to_dict,
    scheduler_output_from_dict,
    scheduler_output_to_dict,
    unpack,
)
from common.engine.pooling_params import POOLING_TYPES
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams

token_ids = st.lists(st.integers(0, 50_000), max_size=8)
req_ids = st.text(min_size=1, max_size=12)
int64 = st.integers(-2**63, 2**63 - 1)
floats = st.floats(allow_nan=False, allow_infinity=False, width=64)

sampling_params = st.builds(
    SamplingParams, temperature=st.floats(0, 2), top_p=st.floats(0.01, 1), top_k=st.sampled_from([-1, 1, 50]),
    seed=st.none() | st.integers(0, 2**63 - 1), stop=st.lists(st.text(min_size=1, max_size=5), max_size=2),
    stop_token_ids=token_ids, max_tokens=st.none() | st.integers(1, 100), logprobs=st.none() | st.integers(0, 5),
    structured_outputs=st.none() | st.sampled_from([{"regex": "[a-z]+"}, {"choice": ["yes", "no"]},
                                                    {"json": {"type": "object"}}]))

scheduled_requests = st.builds(
    ScheduledRequest, req_id=req_ids, token_ids=token_ids, start_pos=st.integers(0, 4096), block_table=token_ids,
    do_sample=st.booleans(), sampling_params=sampling_params, prompt_token_ids=token_ids,
    output_token_ids=token_ids, spec_token_ids=token_ids, num_drafts_to_propose=st.integers(0, 4),
    do_pool=st.booleans(), pooling_type=st.none() | st.sampled_from(POOLING_TYPES[1:]))

kv_metadata = st.builds(
    KVConnectorMetadata,
    sends=st.lists(st.builds(KVSendSpec, req_id=req_ids, src_block_ids=token_ids,
                             target=st.dictionaries(st.text(max_size=5), int64 | st.text(max_size=5), max_size=3)),
                   max_size=2),
    recvs=st.lists(st.builds(KVRecvSpec, req_id=req_ids, transfer_id=req_ids, dst_block_ids=token_ids,
                             timeout_s=floats), max_size=2),
    abort_req_ids=st.lists(req_ids, max_size=2), abort_reason=st.dictionaries(req_ids, st.text(max_size=8)))

bitmasks = st.none() | st.integers(1, 3).flatmap(
    lambda rows: st.lists(st.integers(-2**31, 2**31 - 1), min_size=rows * 4, max_size=rows * 4).map(
        lambda words: torch.tensor(words, dtype=torch.int32).reshape(rows, 4)))

scheduler_outputs = st.builds(
    SchedulerOutput, scheduled=st.lists(scheduled_requests, max_size=3), num_scheduled_tokens=st.integers(0, 2048),
    finished_req_ids=st.lists(req_ids, max_size=3), kv_connector_metadata=st.none() | kv_metadata,
    grammar_bitmask=bitmasks, structured_output_req_ids=st.lists(req_ids, max_size=3),
    scheduled_spec_decode_tokens=st.dictionaries(req_ids, token_ids, max_size=2))

logprobs = st.builds(Logprobs, token_logprob=floats, top_token_ids=token_ids, top_logprobs=st.lists(floats, max_size=3),
                     token_rank=st.none() | st.integers(1, 2**20))
outcomes = st.builds(KVTransferOutcome, req_id=req_ids, transfer_id=req_ids,
                     direction=st.sampled_from(["send", "recv"]), state=st.sampled_from(["done", "failed", "expired"]),
                     reason=st.text(max_size=8), num_bytes=st.integers(0, 2**40), started_at=floats,
                     first_byte_at=st.none() | floats, ended_at=st.none() | floats)
runner_outputs = st.builds(
    RunnerOutput, req_ids=st.lists(req_ids, max_size=3), sampled_token_ids=st.lists(token_ids, max_size=3),
    logprobs=st.none() | st.lists(st.none() | st.lists(logprobs, max_size=2), max_size=3),
    finished_sending=st.lists(req_ids, max_size=2), finished_recving=st.lists(req_ids, max_size=2),
    kv_transfer_outcomes=st.lists(outcomes, max_size=2), spec_token_ids=st.none() | st.lists(token_ids, max_size=3),
    prompt_logprobs=st.none() | st.dictionaries(
        req_ids, st.tuples(st.integers(0, 4096), st.lists(logprobs, max_size=3)), max_size=2),
    pooled_hidden=st.none() | st.dictionaries(req_ids, st.lists(floats, max_size=4), max_size=2))


def _without_bitmask(output: SchedulerOutput):
    return {**vars(output), "grammar_bitmask": None}


@settings(max_examples=60, deadline=None)
@given(scheduler_outputs)
def test_scheduler_output_round_trips_through_msgpack(output: SchedulerOutput):
    decoded = scheduler_output_from_dict(unpack(pack(scheduler_output_to_dict(output)), "test"))
    assert _without_bitmask(decoded) == _without_bitmask(output)
    if output.grammar_bitmask is None:
        assert decoded.grammar_bitmask is None
    else:
        assert decoded.grammar_bitmask.dtype == torch.int32
        assert torch.equal(decoded.grammar_bitmask, output.grammar_bitmask)


@settings(max_examples=60, deadline=None)
@given(runner_outputs)
def test_runner_output_round_trips_through_msgpack(output: RunnerOutput):
    assert runner_output_from_dict(unpack(pack(runner_output_to_dict(output)), "test")) == output


def _through(encoder: SchedulerOutputEncoder, decoder: SchedulerOutputDecoder, step: SchedulerOutput):
    return decoder.decode(unpack(pack(encoder.encode(step)), "test"))


def _step(*requests: Request, finished: tuple[str, ...] = ()) -> SchedulerOutput:
    return SchedulerOutput([ScheduledRequest(r.req_id, [7], 0, [0], True, r.sampling_params,
                                             r.prompt_token_ids, r.output_token_ids) for r in requests],
                           len(requests), finished_req_ids=list(finished))


def test_a_stream_of_steps_sends_params_and_prompts_once_and_outputs_as_they_grow():
    encoder, decoder = SchedulerOutputEncoder(), SchedulerOutputDecoder()
    a = Request("a", list(range(1000)), SamplingParams(temperature=0.0, max_tokens=50))
    b = Request("b", [5, 6], SamplingParams(temperature=0.7, seed=3, stop_token_ids=[9]))
    first = _through(encoder, decoder, _step(a, b))
    assert first == _step(a, b)
    a_params = first.scheduled[0].sampling_params
    for token_id in range(3):
        a.append_output_token_ids([token_id])
        b.append_output_token_ids([token_id + 10, token_id + 20])
        plain = encoder.encode(_step(a, b))
        assert [r["cached"] for r in plain["scheduled"]] == [True, True]
        assert plain["scheduled"][0]["prompt_token_ids"] is None and plain["scheduled"][0]["sampling_params"] is None
        assert plain["scheduled"][0]["output_token_ids"] == [token_id]
        decoded = decoder.decode(unpack(pack(plain), "test"))
        assert decoded == _step(a, b)
        assert decoded.scheduled[0].sampling_params is a_params
    # Finished, then a new request under the same id: it goes whole again.
    assert _through(encoder, decoder, _step(b, finished=("a",))) == _step(b, finished=("a",))
    a_again = Request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5))
    assert _through(encoder, decoder, _step(a_again, b)) == _step(a_again, b)
    # Re-admitted under the same id without a finish in between: its objects changed.
    a_third = Request("a", [4], SamplingParams(temperature=1.0, top_k=5))
    assert _through(encoder, decoder, _step(a_third)) == _step(a_third)


def test_a_cached_request_the_decoder_never_saw_is_refused():
    a = Request("a", [1, 2], SamplingParams())
    encoder = SchedulerOutputEncoder()
    encoder.encode(_step(a))
    with pytest.raises(MessageFormatError, match="never sent whole"):
        SchedulerOutputDecoder().decode(encoder.encode(_step(a)))


def test_a_pickle_is_refused_as_a_pickle():
    output = SchedulerOutput([], 0)
    with pytest.raises(MessageFormatError, match="looks like a pickle"):
        unpack(pickle.dumps(output), "worker rank 0 request")


@pytest.mark.parametrize("plain, match", [
    ({"scheduled": []}, "KeyError"),
    ({**scheduler_output_to_dict(SchedulerOutput([], 0)), "surprise": 1}, "surprise"),
    ({**scheduler_output_to_dict(SchedulerOutput([], 0)), "scheduled": [{"req_id": "a", "cached": False}]},
     "sampling_params"),
])
def test_a_map_of_another_shape_is_not_a_scheduler_output(plain, match):
    with pytest.raises(MessageFormatError, match=match):
        scheduler_output_from_dict(plain)


def test_msgpack_that_is_not_a_map_is_refused():
    with pytest.raises(MessageFormatError, match="expected a msgpack map"):
        unpack(pack([1, 2, 3]), "reply")

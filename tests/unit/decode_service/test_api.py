"""decode_service.api: both sides of the Decode API map its messages without loss."""
from __future__ import annotations

import grpc
import pytest

from common.engine.outputs import Logprobs
from common.engine.sampling_params import SamplingParams
from common.service.errors import ServiceError
from decode_service.api import DecodeJob, DecodeOutput
from protos.pdserve.v1 import common_pb2, decode_pb2


@pytest.mark.parametrize("cache_salt", [None, "tenant-a"])
def test_decode_job_round_trips(cache_salt):
    job = DecodeJob("req-1", [1, 2, 3], SamplingParams(temperature=0.5, max_tokens=None, seed=7, stop=["x"]),
                    priority=2, prefill_address="127.0.0.1:5000", prefill_instance_id="prefill-a",
                    cache_salt=cache_salt)
    assert DecodeJob.from_pb(job.to_pb()) == job


def test_bad_sampling_is_invalid_argument_naming_the_field():
    msg = decode_pb2.DecodeRequest(request_id="r", prompt_token_ids=[1],
                                   sampling=common_pb2.SamplingParams(top_p=1.5))
    with pytest.raises(ServiceError) as e:
        DecodeJob.from_pb(msg)
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.value.message


@pytest.mark.parametrize("output", [
    DecodeOutput([5], request_id="r", decode_instance_id="decode-0"),
    DecodeOutput([5, 6], [Logprobs(-0.5, [5, 9], [-0.5, -1.0]), Logprobs(-0.25, [6], [-0.25])],
                 finish_reason="stop", stop_token_id=6, num_cached_tokens=32, prefill_instance_id="prefill-a",
                 decode_instance_id="decode-0", request_id="r"),
    DecodeOutput([], finish_reason="abort", request_id="r"),
    DecodeOutput([7], finish_reason="length", request_id="r"),
])
def test_decode_output_round_trips(output):
    assert DecodeOutput.from_pb(output.to_pb()) == output


def test_stop_token_of_an_unfinished_message_is_ignored():
    msg = DecodeOutput([5], stop_token_id=5).to_pb()
    assert DecodeOutput.from_pb(msg).stop_token_id is None

"""Property tests of every protobuf -> type conversion at a trust boundary (the gateway's
Generate and Registry edges, the Decode and Prefill servers, the replies a client reads):
any message, at any field values, converts or is refused with the documented error
(ServiceError, INVALID_ARGUMENT), never anything else; what converts round-trips; any
bytes either parse or are a DecodeError (which the servers answer INVALID_ARGUMENT:
tests/unit/gateway/test_corrupt_requests.py)."""
from __future__ import annotations

import functools

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from common.service.common_api import sampling_params_from_pb, sampling_params_to_pb
from common.service.errors import ServiceError
from common.service.registration import InstanceLoad, InstanceSpec
from decode_service.api import DecodeJob, DecodeOutput
from gateway.api import delta_from_pb, deployment_info_from_pb, generate_input_from_pb
from gateway.routing.registry import InstanceRegistry
from gateway.validation import load_served_model, prepare_request
from prefill_service.api import CachedBlocks, PrefillJob, PrefillResult
from protos.pdserve.v1 import (
    common_pb2,
    decode_pb2,
    generate_pb2,
    prefill_pb2,
    registry_pb2,
)
from tests.support.properties import BOUNDED, pb_messages


@functools.cache
def served_model():
    return load_served_model(None)


def refused_as_invalid(convert, msg):
    """convert(msg), or None when it refuses with the documented error."""
    try:
        return convert(msg)
    except ServiceError as e:
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT and e.message, e
        return None


@BOUNDED
@given(pb_messages(common_pb2.SamplingParams))
def test_sampling_params_convert_or_are_invalid_argument_and_round_trip(msg):
    params = refused_as_invalid(sampling_params_from_pb, msg)
    if params is not None:
        assert sampling_params_from_pb(sampling_params_to_pb(params)) == params


@BOUNDED
@given(pb_messages(generate_pb2.GenerateRequest))
def test_generate_requests_are_prepared_or_invalid_argument(msg):
    request = refused_as_invalid(generate_input_from_pb, msg)
    if request is not None:  # the rest of the gateway's checks, before anything is placed
        model = served_model()
        refused_as_invalid(lambda r: prepare_request(r, model, 2048, 262_144), request)


@BOUNDED
@given(pb_messages(decode_pb2.DecodeRequest))
def test_decode_requests_convert_or_are_invalid_argument_and_round_trip(msg):
    job = refused_as_invalid(DecodeJob.from_pb, msg)
    if job is not None:
        assert DecodeJob.from_pb(job.to_pb()) == job


@BOUNDED
@given(pb_messages(prefill_pb2.PrefillRequest))
def test_prefill_requests_convert_or_are_invalid_argument_and_round_trip(msg):
    job = refused_as_invalid(PrefillJob.from_pb, msg)
    if job is not None:
        again = PrefillJob.from_pb(job.to_pb())
        assert (again.req_id, again.prompt_token_ids, again.params) == (job.req_id, job.prompt_token_ids, job.params)


@BOUNDED
@given(pb_messages(registry_pb2.RegisterRequest))
def test_registrations_are_accepted_or_invalid_argument(msg):
    spec = InstanceSpec.from_pb(msg)
    registry = InstanceRegistry(block_size=16, model_name="m")
    refused_as_invalid(registry.register, spec)


@BOUNDED
@given(pb_messages(registry_pb2.HeartbeatRequest))
def test_heartbeats_always_convert(msg):
    InstanceLoad.from_pb(msg.load)


# Replies read by a client of each API: a misbehaving server must not crash it.
@pytest.mark.parametrize("message_class, convert", [
    (decode_pb2.DecodeResponse, DecodeOutput.from_pb),
    (prefill_pb2.PrefillResponse, PrefillResult.from_pb),
    (prefill_pb2.GetCachedBlocksResponse, CachedBlocks.from_pb),
    (generate_pb2.GenerateResponse, delta_from_pb),
    (generate_pb2.ModelInfoResponse, deployment_info_from_pb),
])
def test_replies_always_convert(message_class, convert):
    @BOUNDED
    @given(pb_messages(message_class))
    def check(msg):
        convert(msg)
    check()


@pytest.mark.parametrize("message_class", [generate_pb2.GenerateRequest, decode_pb2.DecodeRequest,
                                           prefill_pb2.PrefillRequest, registry_pb2.RegisterRequest])
def test_any_bytes_parse_or_are_a_decode_error(message_class):
    @BOUNDED
    @given(st.binary(max_size=64))
    def check(data):
        try:
            message_class.FromString(data)
        except DecodeError:
            pass
    check()

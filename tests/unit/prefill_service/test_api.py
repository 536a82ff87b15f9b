"""prefill_service.api: both sides of the Prefill API map its messages without loss."""
from __future__ import annotations

import grpc
import pytest

from common.engine.outputs import Logprobs
from common.engine.sampling_params import SamplingParams
from common.service.errors import ServiceError
from prefill_service.api import CachedBlocks, KvTargetSpec, PrefillJob, PrefillResult
from protos.pdserve.v1 import common_pb2, prefill_pb2

TARGET = KvTargetSpec("tcp://127.0.0.1:5601", "t-1", [7, 8, 9], 2, num_layers=30, dtype="float32",
                      block_shape=[16, 3, 64], timeout_s=2.5)


@pytest.mark.parametrize("kv_target, cache_salt", [(TARGET, None), (None, "tenant-a")])
def test_prefill_job_round_trips(kv_target, cache_salt):
    job = PrefillJob("req-1", list(range(40)), SamplingParams(temperature=0.7, seed=3, logprobs=2), 1, kv_target,
                     cache_salt)
    assert PrefillJob.from_pb(job.to_pb()) == job
    assert job.to_pb().HasField("cache_salt") == (cache_salt is not None)


def test_a_target_without_timeout_leaves_it_to_the_prefill_instance():
    spec = KvTargetSpec.from_pb(prefill_pb2.KvTarget(kv_endpoint="tcp://127.0.0.1:1", transfer_id="t"))
    assert spec.timeout_s is None and spec.to_pb().timeout_ms == 0


def test_bad_sampling_is_invalid_argument():
    msg = prefill_pb2.PrefillRequest(request_id="r", prompt_token_ids=[1],
                                     sampling=common_pb2.SamplingParams(temperature=-1.0))
    with pytest.raises(ServiceError) as e:
        PrefillJob.from_pb(msg)
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and "temperature" in e.value.message


@pytest.mark.parametrize("result", [
    PrefillResult([42], [Logprobs(-0.125, [42, 7], [-0.125, -2.0])], 32, True, 3, "prefill-a"),  # float32 on the wire
    PrefillResult([42], None, 0, False, 0, "prefill-a"),
])
def test_prefill_result_round_trips(result):
    assert PrefillResult.from_pb(result.to_pb("req-1")) == result


def test_cached_blocks_round_trip():
    snapshot = CachedBlocks("prefill-a", 17, [2**63 + 5, 11], 16)
    assert CachedBlocks.from_pb(snapshot.to_pb()) == snapshot

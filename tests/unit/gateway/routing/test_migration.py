"""Migration: a request whose decode instance fails UNAVAILABLE after tokens were streamed
continues on another decode instance (gateway.routing.dispatcher), over the synthetic decode
(bench.fakes.fake_decode), which continues its script after the output a request brings."""
from __future__ import annotations

import grpc
import pytest

from bench.fakes.fake_decode import Failure
from common.service.registration import InstanceSpec
from gateway.client import Client
from gateway.core import GatewaySettings
from tests.support.background_gateway import BackgroundGateway

WORDS = " one two three four five six seven eight"
LOST = Failure(grpc.StatusCode.UNAVAILABLE, after_tokens=3, details="connection reset")


def migrations(gw: BackgroundGateway) -> float:
    return gw.call(lambda: gw.gateway.metrics.registry.get_sample_value("pdserve_request_migrations_total"))


@pytest.fixture
def gateway():
    with BackgroundGateway(GatewaySettings(heartbeat_timeout_s=30.0, migration_limit=1)) as gw:
        yield gw


@pytest.fixture
def script(gateway) -> list[int]:
    return gateway.gateway.model.tokenizer.encode(WORDS, add_special_tokens=False)


def test_a_migrated_request_brings_its_output_is_prefilled_locally_and_reads_as_one_stream(gateway, script):
    gateway.call(lambda: gateway.gateway.registry.register(InstanceSpec(
        "prefill-0", "prefill", grpc_address="127.0.0.1:1", num_total_blocks=100,
        model_name=gateway.gateway.model.name)))
    # Placement prefers the lower id among equals: decode-a, which is lost after 3 tokens.
    lost = gateway.add_fake_decode("decode-a", token_ids=script, failure=LOST, num_cached_tokens=4)
    spare = gateway.add_fake_decode("decode-b", token_ids=script)
    with Client(gateway.address, timeout=10) as client:
        deltas = list(client.generate_stream(token_ids=[5, 6, 7, 8], max_tokens=len(script), seed=3,
                                             prompt_logprobs=1, return_token_ids=True, request_id="req-m"))
    first, resumed = lost.servicer.requests[0], spare.servicer.requests[0]
    assert list(resumed.resumed_token_ids) == script[:3]
    assert (resumed.request_id, list(resumed.prompt_token_ids)) == ("req-m", [5, 6, 7, 8])
    # The prompt's KV and the output's are computed on the new instance; its prompt logprobs were sent.
    assert (first.prefill_address, resumed.prefill_address) == ("127.0.0.1:1", "")
    assert first.sampling.HasField("prompt_logprobs") and not resumed.sampling.HasField("prompt_logprobs")
    assert (resumed.sampling.max_tokens, resumed.sampling.seed) == (len(script), 3)
    assert [t for d in deltas for t in d.token_ids] == script
    assert "".join(d.text for d in deltas) == WORDS
    last = deltas[-1]
    assert (last.finish_reason, last.decode_instance_id) == ("length", "decode-b")
    # Usage is the request's: all its tokens, the prompt's cache and prefill as first served.
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_prompt_tokens) == (
        4, len(script), 4)
    assert last.prefill_instance_id == "prefill-0"
    assert migrations(gateway) == 1


def test_a_stop_string_across_the_migration_is_matched(gateway, script):
    gateway.add_fake_decode("decode-a", token_ids=script, failure=LOST)  # sends " one two three"
    spare = gateway.add_fake_decode("decode-b", token_ids=script)
    with Client(gateway.address, timeout=10) as client:
        result = client.generate(token_ids=[5, 6], max_tokens=len(script), stop=["three four"])
    assert (result.text, result.finish_reason, result.stop_string) == (" one two ", "stop", "three four")
    assert spare.servicer.requests[0].resumed_token_ids == script[:3]


def test_migrations_stop_at_the_limit_with_unavailable(gateway, script):
    fakes = [gateway.add_fake_decode(name, token_ids=script, failure=LOST)
             for name in ("decode-a", "decode-b", "decode-c")]
    received = []
    with Client(gateway.address, timeout=10) as client, pytest.raises(grpc.RpcError) as error:
        for delta in client.generate_stream(token_ids=[5, 6], max_tokens=len(script), return_token_ids=True):
            received += delta.token_ids
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "connection reset" in error.value.details()
    assert received == script[:6]  # 3 tokens on decode-a, 3 more on decode-b (migration_limit 1)
    assert [len(f.servicer.requests) for f in fakes] == [1, 1, 0]
    assert migrations(gateway) == 1


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_a_failure_that_is_not_the_instance_lost_is_not_migrated(gateway, script, code):
    gateway.add_fake_decode("decode-a", token_ids=script, failure=Failure(code, after_tokens=3))
    spare = gateway.add_fake_decode("decode-b", token_ids=script)
    with Client(gateway.address, timeout=10) as client, pytest.raises(grpc.RpcError) as error:
        list(client.generate_stream(token_ids=[5, 6], max_tokens=len(script)))
    assert error.value.code() == code
    assert not spare.servicer.requests and not migrations(gateway)


def test_a_request_with_nothing_streamed_yet_starts_over_with_a_remote_prefill(gateway, script):
    # Tokens whose text is still held back (a possible stop string) reached nobody: a plain retry.
    gateway.call(lambda: gateway.gateway.registry.register(InstanceSpec(
        "prefill-0", "prefill", grpc_address="127.0.0.1:1", num_total_blocks=100,
        model_name=gateway.gateway.model.name)))
    gateway.add_fake_decode("decode-a", token_ids=script, failure=LOST)
    spare = gateway.add_fake_decode("decode-b", token_ids=script)
    with Client(gateway.address, timeout=10) as client:
        result = client.generate(token_ids=[5, 6], max_tokens=len(script), stop=[WORDS])
    retried = spare.servicer.requests[0]
    assert (list(retried.resumed_token_ids), retried.prefill_address) == ([], "127.0.0.1:1")
    assert (result.text, result.finish_reason) == ("", "stop")
    assert not migrations(gateway)


def test_a_lora_request_migrates_only_to_an_instance_serving_its_adapter(gateway, script):
    gateway.add_fake_decode("decode-a", token_ids=script, failure=LOST, lora_names=("sql-lora",))
    plain = gateway.add_fake_decode("decode-b", token_ids=script)
    spare = gateway.add_fake_decode("decode-c", token_ids=script, lora_names=("sql-lora",))
    with Client(gateway.address, timeout=10) as client:
        result = client.generate(token_ids=[5, 6], max_tokens=len(script), model="sql-lora")
    assert (result.text, result.decode_instance_id) == (WORDS, "decode-c")
    assert not plain.servicer.requests
    (resumed,) = spare.servicer.requests
    assert (resumed.lora_name, list(resumed.resumed_token_ids)) == ("sql-lora", script[:3])


def test_a_stream_ended_without_a_status_before_the_finish_migrates(gateway, script):
    gateway.add_fake_decode("decode-a", token_ids=script, failure=Failure(None, after_tokens=3))
    spare = gateway.add_fake_decode("decode-b", token_ids=script)
    with Client(gateway.address, timeout=10) as client:
        result = client.generate(token_ids=[5, 6], max_tokens=len(script), return_token_ids=True)
    assert (list(result.token_ids), result.finish_reason, result.decode_instance_id) == (script, "length", "decode-b")
    assert list(spare.servicer.requests[0].resumed_token_ids) == script[:3]
    assert migrations(gateway) == 1


def test_an_instance_without_room_that_sent_nothing_passes_the_request_to_another(gateway, script):
    full = gateway.add_fake_decode("decode-a", token_ids=script, failure=Failure(
        grpc.StatusCode.RESOURCE_EXHAUSTED, after_tokens=0, details="no room for the KV of a 2-token prompt"))
    spare = gateway.add_fake_decode("decode-b", token_ids=script)
    with Client(gateway.address, timeout=10) as client:
        result = client.generate(token_ids=[5, 6], max_tokens=len(script), return_token_ids=True)
    assert (list(result.token_ids), result.decode_instance_id) == (script, "decode-b")
    assert len(full.servicer.requests) == 1 and not spare.servicer.requests[0].resumed_token_ids
    assert not migrations(gateway)  # nothing had moved: a placement retry, not a migration


def test_without_another_instance_the_refusal_reaches_the_client(gateway, script):
    gateway.add_fake_decode("decode-a", token_ids=script, failure=Failure(
        grpc.StatusCode.RESOURCE_EXHAUSTED, after_tokens=0, details="no room for the KV of a 2-token prompt"))
    with Client(gateway.address, timeout=10) as client, pytest.raises(grpc.RpcError) as error:
        client.generate(token_ids=[5, 6], max_tokens=len(script))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "no room" in error.value.details()

"""Failures a real decode instance cannot be made to produce on demand, injected with
the synthetic decode (bench.fakes.fake_decode): error statuses mid-stream, an instance
killed mid-stream, a stream that fails before its first token. Also what the
gateway sends to decode, duplicate ids in flight, and draining."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from bench.fakes.fake_decode import Failure
from common.cli.health import check
from common.service.registration import InstanceSpec
from gateway.admission import RETRY_AFTER_METADATA
from gateway.client import Client
from gateway.core import GatewaySettings
from tests.support.background_gateway import BackgroundGateway

TOKENS = [1000, 1001, 1002, 1003]


@pytest.fixture
def gateway():
    with BackgroundGateway(GatewaySettings(heartbeat_timeout_s=30.0)) as gw:
        yield gw


def live_decodes(gw: BackgroundGateway) -> list[str]:
    return gw.call(lambda: [i.instance_id for i in gw.gateway.registry.instances("decode")])


@pytest.mark.parametrize("code, expected", [
    (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (grpc.StatusCode.INTERNAL, grpc.StatusCode.INTERNAL),
    (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL),
])
def test_decode_error_mid_stream_reaches_the_client_with_its_status(gateway, code, expected):
    gateway.add_fake_decode("decode-0", token_ids=TOKENS, failure=Failure(code, after_tokens=3))
    received = []
    with Client(gateway.address, timeout=10) as client, pytest.raises(grpc.RpcError) as error:
        for chunk in client.generate_stream("hi", max_tokens=10, return_token_ids=True):
            received += chunk.token_ids
    assert received == TOKENS[:3]
    assert error.value.code() == expected and "decode-0" in error.value.details()
    assert live_decodes(gateway) == ["decode-0"]  # it still answers Stats: not dropped


def test_a_request_the_decode_refuses_as_invalid_gets_the_engines_words_once(gateway):
    # Not the instance's fault: no instance name in what the client reads, not tried elsewhere.
    refusal = "structured_outputs.json is not supported: Unsupported type \"nonsense\""
    fakes = [gateway.add_fake_decode(name, token_ids=TOKENS,
                                     failure=Failure(grpc.StatusCode.INVALID_ARGUMENT, details=refusal))
             for name in ("decode-a", "decode-b")]
    with Client(gateway.address, timeout=10) as client, pytest.raises(grpc.RpcError) as error:
        client.generate("hi", max_tokens=4)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == refusal
    assert sum(len(fake.servicer.requests) for fake in fakes) == 1
    assert sorted(live_decodes(gateway)) == ["decode-a", "decode-b"]


def migrations(gw: BackgroundGateway) -> float:
    return gw.call(lambda: gw.gateway.metrics.registry.get_sample_value("pdserve_request_migrations_total"))


def _spawn_doomed_decode(gw: BackgroundGateway) -> subprocess.Popen:
    """A fake decode process (TOKENS as its script, 50 ms a token) registered with gw, to SIGKILL."""
    doomed = subprocess.Popen([sys.executable, "-m", "bench.fakes.fake_decode", "--gateway",
                               gw.registry_address, "--model-name", gw.gateway.model.name,
                               "--instance-id", "decode-doomed", "--delay-s", "0.05",
                               "--token-ids", ",".join(map(str, TOKENS))],
                              stdout=subprocess.PIPE, text=True)
    assert "PDSERVE_READY" in doomed.stdout.readline()
    return doomed


def _wait_dropped(gw: BackgroundGateway, instance_id: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while instance_id in live_decodes(gw):
        assert time.monotonic() < deadline, f"{instance_id} still registered"
        time.sleep(0.05)


@pytest.mark.timing
def test_decode_killed_mid_stream_with_migration_off_gives_unavailable_fast_and_is_no_longer_chosen():
    with BackgroundGateway(GatewaySettings(heartbeat_timeout_s=30.0, migration_limit=0)) as gateway:
        spare = gateway.add_fake_decode("decode-spare", token_ids=TOKENS)
        doomed = _spawn_doomed_decode(gateway)
        try:
            # Equally loaded, so placement picks the lower id: decode-doomed.
            with Client(gateway.address, timeout=30) as client:
                stream = client.generate_stream("hi", max_tokens=1000)
                assert next(stream).decode_instance_id == "decode-doomed"
                doomed.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                with pytest.raises(grpc.RpcError) as error:
                    list(stream)
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE
                assert time.monotonic() - killed_at < 3.0
                # Dropped after a failed probe, long before its heartbeats would time out (30 s).
                _wait_dropped(gateway, "decode-doomed", 3.0)
                assert client.generate("hi", max_tokens=3).decode_instance_id == "decode-spare"
        finally:
            doomed.kill()
            doomed.wait()
        assert len(spare.servicer.requests) == 1  # the last request only: nothing migrated to it


@pytest.mark.timing
def test_decode_killed_mid_stream_migrates_the_stream_to_another_decode_which_continues_it(gateway):
    spare = gateway.add_fake_decode("decode-spare", token_ids=TOKENS)
    doomed = _spawn_doomed_decode(gateway)
    max_tokens = 400
    try:
        with Client(gateway.address, timeout=30) as client:
            stream = client.generate_stream("hi", max_tokens=max_tokens, return_token_ids=True)
            first = next(stream)
            assert first.decode_instance_id == "decode-doomed"
            doomed.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            rest = list(stream)
            assert time.monotonic() - killed_at < 3.0
            _wait_dropped(gateway, "decode-doomed", 3.0)
    finally:
        doomed.kill()
        doomed.wait()
    received = first.token_ids + [t for delta in rest for t in delta.token_ids]
    # The script continues where the lost instance stopped: nothing repeated, nothing missing.
    assert received == [TOKENS[i % len(TOKENS)] for i in range(max_tokens)]
    assert rest[-1].finish_reason == "length" and rest[-1].decode_instance_id == "decode-spare"
    assert rest[-1].usage.completion_tokens == max_tokens
    (resumed,) = spare.servicer.requests
    num_resumed = len(resumed.resumed_token_ids)
    assert 1 <= num_resumed < max_tokens and list(resumed.resumed_token_ids) == received[:num_resumed]
    assert migrations(gateway) == 1


def test_failure_before_the_first_token_is_retried_on_another_decode(gateway):
    gateway.add_fake_decode("decode-a", token_ids=TOKENS, failure=Failure(grpc.StatusCode.UNAVAILABLE))
    gateway.add_fake_decode("decode-b", token_ids=TOKENS)
    with Client(gateway.address, timeout=10) as client:
        served_by = {client.generate("hi", max_tokens=4).decode_instance_id for _ in range(4)}
    assert served_by == {"decode-b"}


def test_decode_request_carries_prompt_sampling_priority_and_chosen_prefill(gateway):
    fake = gateway.add_fake_decode("decode-0", token_ids=TOKENS)
    gateway.call(lambda: gateway.gateway.registry.register(InstanceSpec(
        "prefill-0", "prefill", grpc_address="127.0.0.1:1", num_total_blocks=100,
        model_name=gateway.gateway.model.name)))
    with Client(gateway.address, timeout=10) as client:
        result = client.generate(token_ids=[5, 6, 7], max_tokens=4, temperature=0.5, stop=["x"],
                                 priority=-3, request_id="req-1")
    sent = fake.servicer.requests[-1]
    assert (sent.request_id, list(sent.prompt_token_ids), sent.priority) == ("req-1", [5, 6, 7], -3)
    assert (sent.sampling.temperature, sent.sampling.max_tokens, list(sent.sampling.stop)) == (0.5, 4, ["x"])
    assert (sent.prefill_address, sent.prefill_instance_id) == ("127.0.0.1:1", "prefill-0")
    assert (result.request_id, result.prefill_instance_id, result.decode_instance_id) == (
        "req-1", "prefill-0", "decode-0")


def _loads(gw: BackgroundGateway) -> dict[str, tuple[int, int]]:
    """(queued prefill tokens, requests) of every instance, as placement sees them now."""
    registry = gw.gateway.registry
    return gw.call(lambda: {i.instance_id: (i.queued_prefill_tokens, i.num_requests)
                            for role in ("prefill", "decode") for i in registry.instances(role)})


@pytest.mark.parametrize("failure", [None, Failure(grpc.StatusCode.INVALID_ARGUMENT, after_tokens=0)],
                         ids=["finished", "failed-before-a-token"])
def test_a_request_leaves_the_load_estimates_once_done_not_at_the_next_heartbeat(gateway, failure):
    # prefill-0 never heartbeats, so only the gateway's own bookkeeping moves its load.
    gateway.call(lambda: gateway.gateway.registry.register(InstanceSpec(
        "prefill-0", "prefill", grpc_address="127.0.0.1:1", block_size=16, num_total_blocks=100,
        model_name=gateway.gateway.model.name)))
    gateway.add_fake_decode("decode-0", token_ids=TOKENS, delay_s=0.1, failure=failure)
    with Client(gateway.address, timeout=10) as client:
        stream = client.generate_stream(token_ids=list(range(100, 140)), max_tokens=5)
        if failure is None:
            next(stream)  # the first token: prefill-0's work for it is done, the decode's is not
            loads = _loads(gateway)
            assert loads["prefill-0"] == (0, 0)
            assert loads["decode-0"][1] == 1
            assert [c for c in stream][-1].finish_reason == "length"
        else:
            with pytest.raises(grpc.RpcError) as error:
                list(stream)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _loads(gateway) == {"prefill-0": (0, 0), "decode-0": (0, 0)}


def test_duplicate_request_id_in_flight_is_already_exists(gateway):
    gateway.add_fake_decode("decode-0", token_ids=TOKENS, delay_s=0.05)
    with Client(gateway.address, timeout=10) as client:
        # 60 tokens: 3 s, longer than the duplicate waits for the id (request_ids.RELEASE_WAIT_S).
        first = client.generate_stream("hi", max_tokens=60, request_id="same")
        next(first)
        with pytest.raises(grpc.RpcError) as error:
            client.generate("hi", max_tokens=2, request_id="same")
        assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS and "'same'" in error.value.details()
        assert dict(error.value.trailing_metadata())[RETRY_AFTER_METADATA] == "1000"
        assert [c for c in first][-1].finish_reason == "length"
        assert client.generate("hi", max_tokens=2, request_id="same").finish_reason == "length"


def test_draining_reports_not_serving_refuses_new_requests_and_finishes_old_ones():
    gw = BackgroundGateway()
    gw.start()
    gw.add_fake_decode("decode-0", token_ids=TOKENS, delay_s=0.02)
    assert check(gw.address) == "SERVING"
    with Client(gw.address, timeout=20) as client:
        stream = client.generate_stream("hi", max_tokens=100)
        next(stream)
        stopper = threading.Thread(target=gw.stop, kwargs={"drain_timeout_s": 20.0})
        stopper.start()
        deadline = time.monotonic() + 5
        while check(gw.address) != "NOT_SERVING":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as error:
            client.generate("hi", max_tokens=2)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert re.search("shutting down", error.value.details())
        assert list(stream)[-1].finish_reason == "length"  # the request in flight completed
        stopper.join(30)

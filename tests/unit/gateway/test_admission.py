"""Admission control: a bounded wait queue per pool at the gateway. Requests beyond
capacity wait in arrival order; one past the queue is refused at once (RESOURCE_EXHAUSTED /
HTTP 429) with a retry hint; waiting ends with the request's own deadline or the last
decode. The prefill pool's slot is given back at the first token."""
from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import grpc
import pytest

from common.service.errors import ServiceError
from common.service.registration import InstanceSpec
from gateway.admission import RETRY_AFTER_METADATA, AdmissionRefused, PoolAdmission
from gateway.client import Client
from gateway.core import GatewaySettings
from gateway.openai_api.server import OpenAIServer
from gateway.routing.registry import InstanceRegistry
from tests.support.background_gateway import BackgroundGateway


def decode(instance_id: str) -> InstanceSpec:
    return InstanceSpec(instance_id, "decode", f"{instance_id}:1", num_total_blocks=10)


def prefill(instance_id: str) -> InstanceSpec:
    return InstanceSpec(instance_id, "prefill", f"{instance_id}:1", num_total_blocks=10)


def run(scenario):
    return asyncio.run(scenario())


async def hold(admission: PoolAdmission, entered: list, label: str, release: asyncio.Event, timeout_s=None):
    async with admission.slot(timeout_s):
        entered.append(label)
        await release.wait()


@pytest.mark.timing
def test_requests_past_capacity_wait_in_order_and_one_past_the_queue_is_refused():
    async def scenario():
        registry = InstanceRegistry()
        registry.register(decode("d0"))
        admission = PoolAdmission(registry, "decode", max_running_per_instance=1, max_waiting=2)
        entered, releases = [], [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(hold(admission, entered, str(i), releases[i])) for i in range(3)]
        await asyncio.sleep(0)
        assert entered == ["0"] and (admission.num_running, admission.num_waiting) == (1, 2)
        started = time.monotonic()
        with pytest.raises(AdmissionRefused) as error:
            async with admission.slot(None):
                pass
        assert time.monotonic() - started < 1.0 and error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.value.retry_after_s > 0
        for i in range(3):
            releases[i].set()
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        assert entered == ["0", "1", "2"] and (admission.num_running, admission.num_waiting) == (0, 0)
    run(scenario)


def test_capacity_grows_with_decode_instances_and_waiters_enter_when_one_registers():
    async def scenario():
        registry = InstanceRegistry()
        registry.register(decode("d0"))
        admission = PoolAdmission(registry, "decode", max_running_per_instance=1, max_waiting=4)
        entered, release = [], asyncio.Event()
        tasks = [asyncio.create_task(hold(admission, entered, str(i), release)) for i in range(2)]
        await asyncio.sleep(0)
        assert entered == ["0"]
        registry.register(decode("d1"))
        await asyncio.sleep(0)
        assert entered == ["0", "1"]
        release.set()
        await asyncio.gather(*tasks)
    run(scenario)


def test_a_waiting_request_ends_at_its_deadline_and_when_the_last_decode_leaves():
    async def scenario():
        registry = InstanceRegistry()
        registry.register(decode("d0"))
        admission = PoolAdmission(registry, "decode", max_running_per_instance=1, max_waiting=4)
        entered, release = [], asyncio.Event()
        running = asyncio.create_task(hold(admission, entered, "running", release))
        await asyncio.sleep(0)
        with pytest.raises(ServiceError) as error:
            await hold(admission, entered, "late", release, timeout_s=0.05)
        assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and admission.num_waiting == 0
        waiting = asyncio.create_task(hold(admission, entered, "waiting", release))
        await asyncio.sleep(0)
        registry.deregister("d0")
        with pytest.raises(ServiceError) as error:
            await waiting
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
        release.set()
        await running
        assert entered == ["running"] and admission.num_running == 0
    run(scenario)


def test_a_waiter_cancelled_as_it_is_granted_hands_the_slot_on():
    async def scenario():
        registry = InstanceRegistry()
        registry.register(decode("d0"))
        admission = PoolAdmission(registry, "decode", max_running_per_instance=1, max_waiting=4)
        entered, release, never = [], asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(hold(admission, entered, "first", release))
        await asyncio.sleep(0)
        doomed = asyncio.create_task(hold(admission, entered, "doomed", never))
        third = asyncio.create_task(hold(admission, entered, "third", release))
        await asyncio.sleep(0)
        release.set()
        await first  # grants "doomed" its slot ...
        doomed.cancel()  # ... which is cancelled before it runs
        await asyncio.gather(doomed, return_exceptions=True)
        await asyncio.wait_for(third, 1)
        assert "third" in entered and admission.num_running == 0
    run(scenario)


def test_without_decode_instances_nothing_waits():
    async def scenario():
        admission = PoolAdmission(InstanceRegistry(), "decode", max_running_per_instance=1, max_waiting=0)
        async with admission.slot(None):
            pass  # placement, not admission, answers UNAVAILABLE
    run(scenario)


def test_the_prefill_pool_queues_its_own_requests_and_lets_them_go_when_it_empties():
    async def scenario():
        registry = InstanceRegistry()
        registry.register(prefill("p0"))
        admission = PoolAdmission(registry, "prefill", max_running_per_instance=1, max_waiting=1)
        first = await admission.acquire(None)
        second = asyncio.create_task(admission.acquire(None))
        await asyncio.sleep(0)
        assert (admission.num_running, admission.num_waiting) == (1, 1)
        with pytest.raises(AdmissionRefused, match="prefill pool is at capacity.*--max-running-per-prefill 1"):
            await admission.acquire(None)
        first.release()  # the first token: its prefill is done
        first.release()  # later releases (the stream's end) change nothing
        granted = await asyncio.wait_for(second, 1)
        assert (admission.num_running, admission.num_waiting) == (1, 0)
        third = asyncio.create_task(admission.acquire(None))
        await asyncio.sleep(0)
        registry.deregister("p0")  # no prefill instance: decode instances prefill locally
        ungated = await asyncio.wait_for(third, 1)
        granted.release()
        ungated.release()
        assert (admission.num_running, admission.num_waiting) == (0, 0)
    run(scenario)


@pytest.fixture()
def gw():
    settings = GatewaySettings(max_running_per_decode=1, max_waiting_requests=1)
    with BackgroundGateway(settings) as gateway:
        gateway.add_fake_decode("decode-0", token_ids=[1000, 1001], delay_s=0.05)
        http = gateway.call(lambda: OpenAIServer(gateway.gateway, port=0))
        gateway.http_address = gateway.call(http.start())
        try:
            yield gateway
        finally:
            gateway.call(http.stop())


@pytest.mark.timing
def test_a_full_gateway_refuses_at_once_with_a_retry_hint_and_admitted_requests_complete(gw):
    admission = gw.gateway.decode_admission
    results, errors = [], []

    def generate(client):
        try:
            results.append(client.generate("hi", max_tokens=20))
        except grpc.RpcError as e:
            errors.append(e)

    with Client(gw.address, timeout=30) as client:
        threads = [threading.Thread(target=generate, args=(client,)) for _ in range(2)]
        for thread in threads:
            thread.start()
            deadline = time.monotonic() + 10
            while gw.call(lambda: admission.num_running + admission.num_waiting) < threads.index(thread) + 1:
                assert time.monotonic() < deadline, "request not admitted"
                time.sleep(0.01)
        # One running, one waiting: the next is refused at once, on gRPC and HTTP.
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as error:
            client.generate("hi", max_tokens=2)
        assert time.monotonic() - started < 1.0
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(error.value.trailing_metadata())[RETRY_AFTER_METADATA] == "1000"
        connection = http.client.HTTPConnection(*gw.http_address.split(":"), timeout=10)
        connection.request("POST", "/v1/completions", json.dumps({"model": gw.gateway.model.name, "prompt": "hi",
                                                                  "max_tokens": 2}),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        body = json.loads(response.read())
        assert (response.status, response.getheader("Retry-After")) == (429, "1")
        assert body["error"]["type"] == "rate_limit_error"
        for thread in threads:
            thread.join(30)
    assert not errors and [r.finish_reason for r in results] == ["length", "length"]
    assert gw.call(lambda: (admission.num_running, admission.num_waiting)) == (0, 0)


def test_a_request_gives_its_prefill_slot_back_at_its_first_token():
    settings = GatewaySettings(heartbeat_timeout_s=30.0, max_running_per_prefill=1, max_waiting_requests=0)
    with BackgroundGateway(settings) as gw:
        gw.add_fake_decode("decode-0", token_ids=[1000, 1001], delay_s=0.1)
        # A prefill instance in the registry: every request is placed on it (the fake
        # decode instance does not call it), so each holds the pool's one slot.
        gw.call(lambda: gw.gateway.registry.register(InstanceSpec(
            "prefill-0", "prefill", "127.0.0.1:1", block_size=16, num_total_blocks=100,
            model_name=gw.gateway.model.name)))
        admission = gw.gateway.prefill_admission
        with Client(gw.address, timeout=30) as client:
            stream = client.generate_stream("hi", max_tokens=6)
            next(stream)  # streaming: its prefill is over
            assert gw.call(lambda: admission.num_running) == 0
            assert client.generate("hi", max_tokens=2).finish_reason == "length"
            assert sum(1 for _ in stream) > 0
    assert (admission.num_running, admission.num_waiting) == (0, 0)

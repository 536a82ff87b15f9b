"""Requests the HTTP edge refuses before the gateway sees them (malformed or too-deep
JSON, a field out of bounds, an unknown model, a body over the limit) are counted in
pdserve_requests_total under their status, like gRPC refusals; so are 429s from
admission control. Checked by scraping the gateway's real /metrics endpoint."""
from __future__ import annotations

import urllib.request
from contextlib import contextmanager

from gateway.core import GatewaySettings
from gateway.openai_api.protocol import MAX_JSON_DEPTH
from gateway.openai_api.server import OpenAIServer
from tests.support.background_gateway import BackgroundGateway
from tests.unit.gateway.openai_api.test_server import MODEL, TOKENS, post, raw_request, wait_for


@contextmanager
def metered_http_gateway(settings: GatewaySettings, max_body_bytes: int = 4 << 20, **fake_kwargs):
    """A gateway with its metrics endpoint, the OpenAI server and one fake decode instance."""
    with BackgroundGateway(settings, metrics_port=0) as gw:
        gw.add_fake_decode("decode-0", **fake_kwargs)
        server = gw.call(lambda: OpenAIServer(gw.gateway, port=0, max_body_bytes=max_body_bytes))
        gw.http_address = gw.call(server.start())
        try:
            yield gw
        finally:
            gw.call(server.stop())


def requests_by_status(gw) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{gw.server.metrics_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith('pdserve_requests_total{status="'):
            labels, value = line.rsplit(" ", 1)
            counts[labels.split('"')[1]] = float(value)
    return counts


def test_requests_refused_while_parsing_are_counted_under_their_status():
    with metered_http_gateway(GatewaySettings(heartbeat_timeout_s=30.0), max_body_bytes=4096,
                              token_ids=TOKENS) as gw:
        before = requests_by_status(gw)
        refusals = [
            (b"{not json", 400),
            (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), 400),
            ({"model": MODEL, "prompt": "hi", "temperature": 9.0}, 400),
            ({"model": MODEL, "prompt": "hi", "n": 129}, 400),
            ({"model": MODEL, "prompt": "hi", "no_such_field": 1}, 400),
            ({"model": "not-served", "prompt": "hi"}, 404),
            ({"model": MODEL, "prompt": "x" * 5000}, 413),
        ]
        for body, expected in refusals:
            assert post(gw.http_address, "/v1/completions", body)[0] == expected, body
        assert post(gw.http_address, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})[0] == 200
        after = requests_by_status(gw)
    counted = {status: after.get(status, 0) - before.get(status, 0) for status in after}
    assert counted["INVALID_ARGUMENT"] == 5
    assert counted["NOT_FOUND"] == 1
    assert counted["RESOURCE_EXHAUSTED"] == 1
    assert counted["OK"] == 1


def test_prompts_the_edge_tokenizes_itself_are_counted_once_when_refused():
    """echo and use_beam_search tokenize at the HTTP edge before any gateway request: a prompt
    refused there is counted like one the gateway refuses."""
    settings = GatewaySettings(heartbeat_timeout_s=30.0, max_prompt_chars=100)
    with metered_http_gateway(settings, token_ids=TOKENS) as gw:
        before = requests_by_status(gw)
        for extra in ({"echo": True}, {"use_beam_search": True}, {}):
            status, body = post(gw.http_address, "/v1/completions", {"model": MODEL, "prompt": "x" * 200, **extra})
            assert (status, body["error"]["param"]) == (400, "prompt"), (extra, body)
        after = requests_by_status(gw)
    assert after["INVALID_ARGUMENT"] - before.get("INVALID_ARGUMENT", 0) == 3
    assert sum(after.values()) - sum(before.values()) == 3


def test_a_429_from_admission_control_is_counted_once_as_resource_exhausted():
    settings = GatewaySettings(heartbeat_timeout_s=30.0, max_running_per_decode=1, max_waiting_requests=0)
    with metered_http_gateway(settings, token_ids=TOKENS, delay_s=0.05) as gw:
        admission = gw.gateway.decode_admission
        sock = raw_request(gw.http_address, {"model": MODEL, "prompt": "hi", "max_tokens": 400, "stream": True})
        try:
            wait_for(lambda: gw.call(lambda: admission.num_running) == 1, what="the first request to run")
            before = requests_by_status(gw)
            status, body = post(gw.http_address, "/v1/completions", {"model": MODEL, "prompt": "hi"})
            assert status == 429 and body["error"]["type"] == "rate_limit_error"
            after = requests_by_status(gw)
        finally:
            sock.close()
        wait_for(lambda: gw.call(lambda: admission.num_running) == 0, what="the first request to end")
    assert after["RESOURCE_EXHAUSTED"] - before.get("RESOURCE_EXHAUSTED", 0) == 1
    assert sum(after.values()) - sum(before.values()) == 1


def test_the_api_port_serves_the_same_metrics_as_the_metrics_port_without_a_key():
    """GET /metrics on the HTTP API port (where vLLM serves them), open as the probes are."""
    from gateway.api_keys import ApiKeys
    with BackgroundGateway(GatewaySettings(heartbeat_timeout_s=30.0), metrics_port=0) as gw:
        gw.add_fake_decode("decode-0", token_ids=TOKENS)
        server = gw.call(lambda: OpenAIServer(gw.gateway, port=0, api_keys=ApiKeys(["secret"])))
        address = gw.call(server.start())
        try:
            assert post(address, "/v1/completions", {"model": MODEL, "prompt": "hi"})[0] == 401
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
                content_type, text = response.headers["content-type"], response.read().decode()
        finally:
            gw.call(server.stop())
        with urllib.request.urlopen(f"http://{gw.server.metrics_address}/metrics", timeout=10) as response:
            families = {line.split()[2] for line in response.read().decode().splitlines()
                        if line.startswith("# TYPE")}
    assert content_type.startswith("text/plain")
    assert 'pdserve_requests_total{status="UNAUTHENTICATED"} 1.0' in text.splitlines()
    assert {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")} == families

"""Metrics and logs of a real stack: `pdserve up`'s LocalStack (1 prefill, 1 decode, the
bundled model, every prompt prefilled remotely) with JSON logs. Each service's Prometheus
endpoint is scraped over HTTP (loopback) before and after real requests, and the
counters must have moved; one request's id must show up in all three services' logs.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from common.cli.up import LocalStack
from gateway.client import Client
from tests.support.scrape import Samples, scrape, total

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
# min_tokens: a raw prompt may well end at once with EOS; TPOT needs two tokens or more.
SAMPLING = dict(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0)
SHARED_PREFIX = ("You are a careful assistant for a library. The library opens at nine, closes at six, "
                 "lends up to five books per member for three weeks, and charges nothing for late returns. ")
QUESTIONS = ["When does the library open?", "How many books can a member borrow?"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("metrics-logs")
    # --local-prefill-threshold 0: every prompt goes to the prefill instance (KV transfers).
    with LocalStack(1, 1, passthrough=["--kv-cache-memory", "128MiB", "--log-format", "json",
                                       "--log-level", "INFO", "--local-prefill-threshold", "0"],
                    log_dir=log_dir) as local_stack:
        yield local_stack


def scrape_all(stack: LocalStack) -> dict[str, Samples]:
    return {"gateway": scrape(stack.gateway.metrics_address),
            "prefill": scrape(stack.instances["prefill-0"].metrics_address),
            "decode": scrape(stack.instances["decode-0"].metrics_address)}


def test_every_service_exports_metrics_and_the_counters_move(stack):
    before = scrape_all(stack)
    for role in ("prefill", "decode"):
        labels = {"role": role, "instance_id": f"{role}-0"}
        for gauge in ("pdserve_num_requests_running", "pdserve_num_requests_waiting",
                      "pdserve_kv_cache_usage_ratio", "pdserve_queued_prefill_tokens",
                      "pdserve_kv_cache_blocks_held_ahead"):
            assert (gauge, frozenset(labels.items())) in before[role], (role, gauge)
    assert total(before["gateway"], "pdserve_instances_alive", pool="prefill") == 1
    assert total(before["gateway"], "pdserve_instances_alive", pool="decode") == 1

    with Client(stack.address, timeout=120) as client:
        for question in QUESTIONS:  # the second shares the first's prefix: prefix-cache hits
            result = client.generate(SHARED_PREFIX + question, **SAMPLING)
            assert result.finish_reason in ("length", "stop") and result.prefill_instance_id == "prefill-0"
        chunks = list(client.generate_stream(SHARED_PREFIX + QUESTIONS[0], **SAMPLING))
        assert chunks[-1].finish_reason in ("length", "stop")
    num_requests = len(QUESTIONS) + 1

    # The gateway counts when a call ends, just after its last message went out.
    deadline = time.monotonic() + 15
    while True:
        after = scrape_all(stack)
        done = total(after["gateway"], "pdserve_requests_total", status="OK") - \
            total(before["gateway"], "pdserve_requests_total", status="OK")
        if done >= num_requests or time.monotonic() > deadline:
            break
        time.sleep(0.1)

    def moved(role: str, name: str, **labels) -> float:
        return total(after[role], name, **labels) - total(before[role], name, **labels)

    # gateway
    assert moved("gateway", "pdserve_requests_total", status="OK") == num_requests
    assert moved("gateway", "pdserve_request_ttft_seconds_count") == num_requests
    assert moved("gateway", "pdserve_request_e2e_seconds_count") == num_requests
    assert moved("gateway", "pdserve_request_tpot_seconds_count") == num_requests
    assert moved("gateway", "pdserve_request_itl_seconds_count") == num_requests * (MAX_TOKENS - 1)
    assert moved("gateway", "pdserve_generation_tokens_total") == num_requests * MAX_TOKENS
    assert moved("gateway", "pdserve_prompt_tokens_total") > num_requests * 30
    assert moved("gateway", "pdserve_placement_decisions_total", pool="prefill", result="placed") == num_requests
    assert moved("gateway", "pdserve_placement_decisions_total", pool="decode", result="placed") == num_requests
    # prefill: it computed the prompts (reusing the shared prefix) and shipped their KV
    assert moved("prefill", "pdserve_prefix_cache_queries_total") > num_requests * 30
    assert moved("prefill", "pdserve_prefix_cache_hits_total") >= 16  # at least one whole block
    assert moved("prefill", "pdserve_engine_step_duration_seconds_count", phase="prefill") >= num_requests
    sent = moved("prefill", "pdserve_kv_transfer_bytes_total")
    assert sent > 0 and moved("prefill", "pdserve_kv_transfer_duration_seconds_count") == num_requests
    # decode: received exactly what prefill sent, then decoded
    assert moved("decode", "pdserve_kv_transfer_bytes_total") == sent
    assert moved("decode", "pdserve_kv_transfer_duration_seconds_count") == num_requests
    assert moved("decode", "pdserve_engine_step_duration_seconds_count", phase="decode") >= 1
    assert moved("decode", "pdserve_engine_requests_finished_total") == num_requests
    # Each engine timed every request it finished: on the decode instance its wait for the
    # prefill's KV counts as queued, its first token came with the KV, its decode took time.
    for role in ("prefill", "decode"):
        for interval in ("queue", "prefill", "decode", "inference"):
            assert moved(role, f"pdserve_engine_request_{interval}_time_seconds_count") == num_requests
    assert moved("prefill", "pdserve_engine_request_prefill_time_seconds_sum") > 0
    assert moved("decode", "pdserve_engine_request_prefill_time_seconds_sum") == 0
    assert moved("decode", "pdserve_engine_request_queue_time_seconds_sum") > 0
    assert moved("decode", "pdserve_engine_request_decode_time_seconds_sum") > 0
    for role in ("prefill", "decode"):
        assert moved(role, "pdserve_kv_transfer_failures_total") == 0


def _log_lines(path: Path) -> list[dict]:
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):  # library noise (warnings) may be plain text
            lines.append(json.loads(line))
    return lines


def test_one_request_id_is_in_the_gateway_decode_and_prefill_logs(stack):
    request_id = f"trace-{time.monotonic_ns()}"
    with Client(stack.address, timeout=120) as client:
        result = client.generate(SHARED_PREFIX + "Is there a late fee?", **SAMPLING, request_id=request_id)
    assert result.request_id == request_id
    logs = {name: Path(stack.log_dir) / f"{name}.log" for name in ("gateway", "decode-0", "prefill-0")}
    deadline = time.monotonic() + 15
    while True:  # each service logs its end line as its call ends
        mine = {name: [line for line in _log_lines(path) if line.get("request_id") == request_id]
                for name, path in logs.items()}
        ended = {name: [line for line in lines if line["msg"].endswith(" end")] for name, lines in mine.items()}
        if all(ended.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for name, role, what in (("gateway", "gateway", "request"), ("decode-0", "decode", "decode"),
                             ("prefill-0", "prefill", "prefill")):
        messages = [line["msg"] for line in mine[name]]
        assert f"{what} start" in messages and f"{what} end" in messages, (name, messages)
        (end,) = ended[name]
        assert end["status"] == "OK" and end["role"] == role and end["duration_s"] > 0, end
        assert end["level"] == "INFO" and end["ts"].endswith("Z") and end["instance_id"]
    assert ended["decode-0"][0]["prefilled_by"] == "prefill-0"
    assert ended["decode-0"][0]["output_tokens"] == ended["gateway"][0]["output_tokens"] == MAX_TOKENS
    assert ended["prefill-0"][0]["kv_blocks_sent"] > 0
    assert ended["gateway"][0]["prefill"] == "prefill-0" and ended["gateway"][0]["decode"] == "decode-0"

"""common.service.metrics and common.service.logging_setup without a model: the engine collector reads a
fake engine's numbers at scrape time, step and transfer observers, the gateway's request
clock, the HTTP endpoint (real sockets on 127.0.0.1), and the gateway with a synthetic
decode instance: its counters move, its logs carry the request id."""
from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import socket
import time
import urllib.request
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.engine.kv_connector.metadata import KVTransferOutcome
from common.engine.outputs import EngineCoreOutput, RequestTimings, ScheduledRequest, SchedulerOutput
from common.engine.sampling_params import SamplingParams
from common.service.logging_setup import (
    REQUEST_ID,
    JsonFormatter,
    TextFormatter,
    configure_logging,
    log_event,
    make_handler,
    request_context,
)
from common.service.metrics import (
    GatewayMetrics,
    MetricsServer,
    RequestTimer,
    WorkerMetrics,
    all_metric_family_names,
    step_phase,
)
from kv_transfer import TransferState
from tests.support.paths import REPO_ROOT


def samples(registry) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape, parsed as Prometheus would."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(registry, name: str, **labels) -> float:
    """The one sample called `name` whose labels include `labels`."""
    found = [v for (n, ls), v in samples(registry).items() if n == name and set(labels.items()) <= set(ls)]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def fake_engine():
    load = SimpleNamespace(num_running_requests=3, num_waiting_requests=2, num_free_blocks=25,
                           num_total_blocks=100, num_queued_prefill_tokens=480)
    stats = {"prefix_cache_queried_tokens": 640, "prefix_cache_hit_tokens": 320, "num_preemptions": 1,
             "num_finished_requests": 7, "num_blocks_held_ahead": 12}
    return load, stats


# ------------------------------------------------------------------------------- engine

def test_engine_collector_reads_the_load_and_counters_when_scraped():
    load, stats = fake_engine()
    metrics = WorkerMetrics("decode", "decode-a", lambda: load, lambda: stats)
    labels = {"role": "decode", "instance_id": "decode-a"}
    r = metrics.registry
    assert value(r, "pdserve_num_requests_running", **labels) == 3
    assert value(r, "pdserve_num_requests_waiting", **labels) == 2
    assert value(r, "pdserve_kv_cache_usage_ratio", **labels) == pytest.approx(0.75)
    assert value(r, "pdserve_kv_cache_blocks", **labels) == 100
    assert value(r, "pdserve_kv_cache_blocks_held_ahead", **labels) == 12
    assert value(r, "pdserve_queued_prefill_tokens", **labels) == 480
    assert value(r, "pdserve_prefix_cache_queries_total", **labels) == 640
    assert value(r, "pdserve_prefix_cache_hits_total", **labels) == 320
    assert value(r, "pdserve_num_preemptions_total", **labels) == 1
    assert value(r, "pdserve_engine_requests_finished_total", **labels) == 7
    # Nothing is pushed: the next scrape sees the engine's new numbers.
    load.num_running_requests, load.num_free_blocks = 0, 100
    stats = {**stats, "prefix_cache_queried_tokens": 700}
    metrics2 = WorkerMetrics("decode", "decode-a", lambda: load, lambda: stats)
    assert value(metrics.registry, "pdserve_num_requests_running", **labels) == 0
    assert value(metrics.registry, "pdserve_kv_cache_usage_ratio", **labels) == 0.0
    assert value(metrics2.registry, "pdserve_prefix_cache_queries_total", **labels) == 700


def test_lora_series_are_per_adapter_and_only_with_lora_on():
    load, stats = fake_engine()
    labels = {"role": "decode", "instance_id": "decode-a"}
    off = WorkerMetrics("decode", "decode-a", lambda: load, lambda: stats).registry
    assert not [name for name, _ in samples(off) if name.startswith("pdserve_lora")]
    stats = {**stats, "lora_requests_running": {"sql": 2, "chat": 1}, "lora_requests_waiting": {"sql": 4},
             "lora_adapters_held": 2, "lora_max_adapters": 4, "lora_adapter_loads": 5, "lora_adapter_evictions": 3}
    on = WorkerMetrics("decode", "decode-a", lambda: load, lambda: stats).registry
    assert value(on, "pdserve_lora_requests_running", lora_name="sql", **labels) == 2
    assert value(on, "pdserve_lora_requests_running", lora_name="chat", **labels) == 1
    assert value(on, "pdserve_lora_requests_waiting", lora_name="sql", **labels) == 4
    assert not [s for s in samples(on) if s[0] == "pdserve_lora_requests_waiting" and ("lora_name", "chat") in s[1]]
    assert value(on, "pdserve_lora_adapters_held", **labels) == 2
    assert value(on, "pdserve_lora_max_adapters", **labels) == 4
    assert value(on, "pdserve_lora_adapter_loads_total", **labels) == 5
    assert value(on, "pdserve_lora_adapter_evictions_total", **labels) == 3


def test_each_service_has_its_own_registry():
    load, stats = fake_engine()
    a = WorkerMetrics("prefill", "p-a", lambda: load, lambda: stats)
    b = WorkerMetrics("prefill", "p-b", lambda: load, lambda: stats)  # no "duplicated timeseries" error
    assert {ls for (n, ls) in samples(a.registry) if n == "pdserve_num_requests_running"} == \
        {(("instance_id", "p-a"), ("role", "prefill"))}
    assert value(b.registry, "pdserve_num_requests_running", instance_id="p-b") == 3


def _scheduled(prompt_len: int, start_pos: int, num_tokens: int) -> ScheduledRequest:
    return ScheduledRequest(req_id=f"r{start_pos}-{num_tokens}", token_ids=[1] * num_tokens, start_pos=start_pos,
                            block_table=[0], do_sample=True, sampling_params=SamplingParams(),
                            prompt_token_ids=[1] * prompt_len)


def test_step_phase_and_durations_by_phase():
    prefill_chunk, decode_token = _scheduled(40, 0, 32), _scheduled(40, 41, 1)
    assert step_phase([prefill_chunk]) == "prefill"
    assert step_phase([decode_token, _scheduled(10, 12, 1)]) == "decode"
    assert step_phase([decode_token, prefill_chunk]) == "mixed"
    assert step_phase([_scheduled(40, 39, 1)]) == "prefill"  # the prompt's last token
    load, stats = fake_engine()
    metrics = WorkerMetrics("prefill", "p", lambda: load, lambda: stats)
    metrics.observe_step(SchedulerOutput([prefill_chunk], 32), 0.02)
    metrics.observe_step(SchedulerOutput([decode_token], 1), 0.004)
    metrics.observe_step(SchedulerOutput([decode_token], 1), 0.006)
    metrics.observe_step(SchedulerOutput([], 0), 1.0)  # an empty step ran nothing: not counted
    r = metrics.registry
    assert value(r, "pdserve_engine_step_duration_seconds_count", phase="prefill") == 1
    assert value(r, "pdserve_engine_step_duration_seconds_count", phase="decode") == 2
    assert value(r, "pdserve_engine_step_duration_seconds_sum", phase="decode") == pytest.approx(0.01)
    assert value(r, "pdserve_engine_step_duration_seconds_count", phase="mixed") == 0
    assert value(r, "pdserve_engine_scheduled_tokens_total", phase="prefill") == 32
    assert value(r, "pdserve_engine_step_duration_seconds_bucket", phase="decode", le="0.005") == 1
    assert value(r, "pdserve_engine_scheduled_tokens_total", phase="decode") == 2
    # Decode steps run back to back (--num-scheduler-steps) run each token once a step.
    metrics.observe_step(SchedulerOutput([decode_token, _scheduled(10, 12, 1)], 2, num_steps=3), 0.01)
    assert value(r, "pdserve_engine_scheduled_tokens_total", phase="decode") == 2 + 6


def test_finished_requests_fill_the_engine_interval_histograms():
    load, stats = fake_engine()
    metrics = WorkerMetrics("decode", "d", lambda: load, lambda: stats)
    metrics.observe_finished(EngineCoreOutput("r1", [5], finish_reason="length", timings=RequestTimings(
        queued_s=0.5, prefill_s=0.0, decode_s=2.0, inference_s=2.0)))
    metrics.observe_finished(EngineCoreOutput("r2", [], finish_reason="abort", timings=RequestTimings(
        queued_s=1.5, prefill_s=0.0, decode_s=0.0, inference_s=0.0)))
    r = metrics.registry
    for interval, total_s in (("queue", 2.0), ("prefill", 0.0), ("decode", 2.0), ("inference", 2.0)):
        assert value(r, f"pdserve_engine_request_{interval}_time_seconds_count", role="decode") == 2
        assert value(r, f"pdserve_engine_request_{interval}_time_seconds_sum") == pytest.approx(total_s)
    assert value(r, "pdserve_engine_request_queue_time_seconds_bucket", le="1.0") == 1


def test_transfers_count_bytes_duration_and_failures():
    load, stats = fake_engine()
    metrics = WorkerMetrics("decode", "d", lambda: load, lambda: stats)
    done = KVTransferOutcome("r1", "t1", "recv", "done", num_bytes=4096, started_at=10.0, first_byte_at=12.0,
                             ended_at=12.5)
    sent = KVTransferOutcome("r2", "t2", "send", "done", num_bytes=1024, started_at=10.0, ended_at=10.25)
    metrics.observe_transfer(done)
    metrics.observe_transfer(sent)
    metrics.observe_transfer(KVTransferOutcome("r3", "t3", "recv", "expired", num_bytes=4096, ended_at=30.0))
    metrics.observe_transfer(KVTransferOutcome("r4", "t4", "send", "failed", num_bytes=4096))
    r = metrics.registry
    assert value(r, "pdserve_kv_transfer_bytes_total") == 5120  # completed ones only
    assert value(r, "pdserve_kv_transfer_duration_seconds_count") == 2
    # A receive is timed from its first KV message, a send from its start.
    assert value(r, "pdserve_kv_transfer_duration_seconds_sum") == pytest.approx(0.5 + 0.25)
    assert value(r, "pdserve_kv_transfer_failures_total", state="expired") == 1
    assert value(r, "pdserve_kv_transfer_failures_total", state="failed") == 1


def test_transfer_handles_carry_the_timestamps():
    from kv_transfer.base import TransferHandle
    handle = TransferHandle("t-1")
    assert handle.ended_at is None and handle.first_byte_at is None
    seen = []
    handle.future.add_done_callback(lambda _f: seen.append(handle.ended_at))
    handle._resolve(TransferState.DONE, "", None)
    assert seen == [handle.ended_at] and handle.ended_at >= handle.started_at


# ------------------------------------------------------------------------------ gateway

class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_request_timer_ttft_itl_tpot_e2e_and_status():
    metrics, clock = GatewayMetrics("prefix_aware"), FakeClock()
    timer = RequestTimer(metrics, clock)
    assert value(metrics.registry, "pdserve_num_requests_in_flight") == 1
    timer.num_prompt_tokens = 12
    clock.now += 0.5
    timer.tokens(1)        # first token: TTFT 0.5
    timer.tokens(0)        # a message without tokens changes nothing
    clock.now += 0.1
    timer.tokens(1)        # ITL 0.1
    clock.now += 0.4
    timer.tokens(2)        # two tokens in one message: 2 gaps of 0.2
    assert timer.finish("OK") == pytest.approx(1.0)
    r = metrics.registry
    assert value(r, "pdserve_request_ttft_seconds_sum") == pytest.approx(0.5)
    assert value(r, "pdserve_request_itl_seconds_count") == 3
    assert value(r, "pdserve_request_itl_seconds_sum") == pytest.approx(0.5)
    assert value(r, "pdserve_request_tpot_seconds_sum") == pytest.approx(0.5 / 3)
    assert value(r, "pdserve_request_e2e_seconds_sum") == pytest.approx(1.0)
    assert value(r, "pdserve_requests_total", status="OK") == 1
    assert (value(r, "pdserve_prompt_tokens_total"), value(r, "pdserve_generation_tokens_total")) == (12, 4)
    assert value(r, "pdserve_num_requests_in_flight") == 0
    # A failed request counts under its status; no E2E/TPOT sample for it.
    failed = RequestTimer(metrics, clock)
    failed.finish("INVALID_ARGUMENT")
    assert value(r, "pdserve_requests_total", status="INVALID_ARGUMENT") == 1
    assert value(r, "pdserve_request_e2e_seconds_count") == 1


def test_gateway_metric_series_exist_before_any_request():
    metrics = GatewayMetrics("round_robin")
    r = metrics.registry
    assert value(r, "pdserve_instances_alive", pool="prefill") == 0
    assert value(r, "pdserve_placement_decisions_total", policy="round_robin", pool="decode", result="placed") == 0
    assert value(r, "pdserve_requests_total", status="OK") == 0
    assert all(name.startswith("pdserve_") for name in all_metric_family_names())


def test_gateway_exports_each_live_instance_load_as_placement_sees_it():
    from common.service.registration import InstanceSpec
    from gateway.routing.load_estimate import LoadDelta
    from gateway.routing.registry import InstanceRegistry
    metrics = GatewayMetrics("prefix_aware")
    registry = InstanceRegistry()
    metrics.watch_instances(registry.snapshot)
    r = metrics.registry
    assert not [n for n, _ in samples(r) if n.startswith("pdserve_instance_estimated_")]
    registry.register(InstanceSpec("prefill-0", "prefill", "127.0.0.1:1", num_total_blocks=40))
    registry.register(InstanceSpec("decode-0", "decode", "127.0.0.1:2", num_total_blocks=50))
    prefill = registry.get("prefill-0")
    prefill.estimate.add(LoadDelta(num_requests=2, num_prefill_tokens=300, num_blocks=19))
    labels = dict(pool="prefill", instance_id="prefill-0")
    assert value(r, "pdserve_instance_estimated_requests", **labels) == 2
    assert value(r, "pdserve_instance_estimated_queued_prefill_tokens", **labels) == 300
    assert value(r, "pdserve_instance_estimated_free_blocks", **labels) == 40 - 19
    assert value(r, "pdserve_instance_estimated_free_blocks", pool="decode", instance_id="decode-0") == 50
    prefill.estimate.add(-LoadDelta(num_requests=2, num_prefill_tokens=300, num_blocks=19))  # seen finishing
    assert value(r, "pdserve_instance_estimated_requests", **labels) == 0
    registry.deregister("prefill-0")
    remaining = {ls for n, ls in samples(r) if n == "pdserve_instance_estimated_requests"}
    assert remaining == {(("instance_id", "decode-0"), ("pool", "decode"))}


# ------------------------------------------------------------------------- HTTP endpoint

def scrape(address: str) -> dict[str, list]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_metrics_server_serves_its_registry_and_stops():
    load, stats = fake_engine()
    metrics = WorkerMetrics("prefill", "p-http", lambda: load, lambda: stats)
    address = metrics.serve("127.0.0.1", 0)
    try:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        families = scrape(address)
        assert families["pdserve_queued_prefill_tokens"][0].value == 480
        # A taken port: a clear error, nothing left behind.
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            MetricsServer(metrics.registry).start("127.0.0.1", int(port))
        with pytest.raises(ValueError, match="metrics port"):
            MetricsServer(metrics.registry).start("127.0.0.1", 70000)
    finally:
        metrics.close()
    with socket.socket() as probe:  # nothing listens there any more (TIME_WAIT from the scrape may stay)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", int(port)))
        probe.listen()


# ------------------------------------------------------------------------------ logging

def make_record(msg: str, **fields) -> logging.LogRecord:
    record = logging.LogRecord("pdserve.test", logging.INFO, __file__, 1, msg, None, None)
    record.pdserve_fields = fields
    return record


def test_json_lines_carry_the_request_id_and_fields():
    stream = io.StringIO()
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    configure_logging("decode", "decode-x", "INFO", "json", stream=stream)
    log = logging.getLogger("pdserve.test")
    try:
        with request_context("req-42"):
            log_event(log, "decode end", status="OK", output_tokens=3)
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                log.exception("it broke")
        log.info("between requests")
    finally:  # give pytest its root logger back
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines[0]["request_id"] == "req-42" and lines[0]["msg"] == "decode end"
    assert (lines[0]["role"], lines[0]["instance_id"], lines[0]["level"]) == ("decode", "decode-x", "INFO")
    assert (lines[0]["status"], lines[0]["output_tokens"]) == ("OK", 3)
    assert lines[0]["ts"].endswith("Z") and lines[0]["logger"] == "pdserve.test"
    assert lines[1]["request_id"] == "req-42" and "RuntimeError: boom" in lines[1]["exc"]
    assert "request_id" not in lines[2]


def test_text_lines_show_the_request_id_and_fields():
    record = make_record("prefill end", status="OK", duration_s=0.123456, reason="no room")
    record.request_id = "req-7"
    line = TextFormatter("prefill").format(record)
    assert " prefill [req-7] pdserve.test: prefill end status=OK duration_s=0.1235 reason=\"no room\"" in line
    record.request_id = None
    assert "[" not in TextFormatter("prefill").format(record)
    # A field never overwrites the envelope.
    record = make_record("x", role="spoofed")
    assert json.loads(JsonFormatter("gateway", "g").format(record))["role"] == "gateway"


def test_request_id_stays_with_its_task():
    async def handle(req_id: str, seen: dict):
        with request_context(req_id):
            await asyncio.sleep(0.01)  # the other request runs meanwhile
            seen[req_id] = REQUEST_ID.get()

    async def main():
        seen: dict = {}
        await asyncio.gather(handle("a", seen), handle("b", seen))
        return seen
    assert asyncio.run(main()) == {"a": "a", "b": "b"}
    assert REQUEST_ID.get() is None


def test_bad_log_format_is_an_error():
    with pytest.raises(ValueError, match="log format"):
        configure_logging("gateway", "g", "INFO", "xml")


# ----------------------------------------------------- the gateway with a synthetic decode

def test_gateway_counts_requests_and_logs_them_with_their_id():
    from gateway.client import Client
    from gateway.core import GatewaySettings
    from tests.support.background_gateway import BackgroundGateway
    log_lines = io.StringIO()
    handler = make_handler("gateway", "gateway-test", "json", log_lines)
    gateway_logger = logging.getLogger("gateway.core")
    gateway_logger.addHandler(handler)
    level = gateway_logger.level
    gateway_logger.setLevel(logging.INFO)
    try:
        served = _serve_three_requests(BackgroundGateway, GatewaySettings, Client)
    finally:
        gateway_logger.removeHandler(handler)
        gateway_logger.setLevel(level)
    before, after, chunks = served
    assert {s.labels["pool"]: s.value for s in before["pdserve_instances_alive"]} == {"prefill": 0, "decode": 0}
    by_status = {s.labels["status"]: s.value for s in after["pdserve_requests"] if s.name.endswith("_total")}
    assert by_status["OK"] == 2 and by_status["INVALID_ARGUMENT"] == 1
    ttft_count = [s.value for s in after["pdserve_request_ttft_seconds"] if s.name.endswith("_count")]
    assert ttft_count == [2]
    assert [s.value for s in after["pdserve_generation_tokens"]] == [4 + 3] and chunks
    placed = {(s.labels["pool"], s.labels["result"]): s.value for s in after["pdserve_placement_decisions"]}
    assert placed[("decode", "placed")] == 2 and placed[("prefill", "none")] == 2
    assert {s.labels["pool"]: s.value for s in after["pdserve_instances_alive"]}["decode"] == 1
    # The gateway saw both requests finish: its estimate of decode-0 holds none of them.
    assert [(s.labels, s.value) for s in after["pdserve_instance_estimated_requests"]] == [
        ({"pool": "decode", "instance_id": "decode-0"}, 0)]
    lines = [json.loads(line) for line in log_lines.getvalue().splitlines()]
    starts = [line for line in lines if line["msg"] == "request start"]
    ends = [line for line in lines if line["msg"] == "request end"]
    assert len(starts) == 2 and len(ends) == 3  # the invalid request never started
    assert starts[0]["request_id"] == ends[0]["request_id"] == "metrics-req-1"
    assert (ends[0]["status"], ends[0]["output_tokens"], ends[0]["decode"]) == ("OK", 4, "decode-0")
    assert starts[1]["request_id"] == ends[1]["request_id"]  # an id the gateway made
    assert ends[2]["status"] == "INVALID_ARGUMENT" and "request_id" not in ends[2]


def _serve_three_requests(BackgroundGateway, GatewaySettings, Client):
    with BackgroundGateway(GatewaySettings(policy="round_robin"), metrics_port=0) as gw:
        address = gw.server.metrics_address
        before = scrape(address)
        gw.add_fake_decode("decode-0", token_ids=[1000, 1001, 1002, 1003])
        with Client(gw.address, timeout=10) as client:
            result = client.generate("Hello there", max_tokens=4, request_id="metrics-req-1")
            assert result.finish_reason == "length"
            chunks = list(client.generate_stream("Hello again", max_tokens=3))
            with pytest.raises(grpc.RpcError) as error:
                client.generate("Hello", max_tokens=4, model="not-the-served-model")
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return before, scrape(address), chunks


def test_architecture_doc_lists_every_metric():

    from common.service.metrics import _reference_metrics
    doc = (REPO_ROOT / "docs" / "architecture.md").read_text()
    documented = set(re.findall(r"^\| `(pdserve_[a-z0-9_]+)` \|", doc, re.MULTILINE))
    exported = {family.name + ("_total" if family.type == "counter" else "")
                for metrics in _reference_metrics() for family in metrics.registry.collect()}
    assert documented == exported, (sorted(exported - documented), sorted(documented - exported))


def test_bad_or_taken_metrics_port_is_a_clear_start_up_error():
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-m", "prefill_service.main", "--metrics-port", "70000"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--metrics-port must be 0 (a free port) to 65535" in result.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "gateway.main", "--port", "0", "--metrics-port", str(port)],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in result.stderr and "PDSERVE_READY" not in result.stdout


def test_logged_request_end_status(caplog):
    from common.service.errors import ServiceError
    from common.service.logging_setup import logged_request
    log = logging.getLogger("pdserve.test.hop")
    caplog.set_level(logging.INFO, logger="pdserve.test.hop")

    class AbortedContext:  # what grpc.aio's context reports once abort() was called
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

    async def hop(error: BaseException | None, context=None, complete: bool = False):
        with logged_request(log, "hop", "req-9", context, prompt_tokens=3) as end:
            end.complete = complete
            end["output_tokens"] = 2
            if error is not None:
                raise error

    asyncio.run(hop(None))
    for error, context, complete in ((ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "bad"), None, False),
                                     (asyncio.CancelledError(), None, False),
                                     (asyncio.CancelledError(), None, True),  # cancelled after its last token
                                     (RuntimeError("abort"), AbortedContext(), False),
                                     (KeyError("bug"), None, False)):
        with pytest.raises(type(error)):
            asyncio.run(hop(error, context, complete))
    ends = [r for r in caplog.records if r.getMessage() == "hop end"]
    assert [r.pdserve_fields["status"] for r in ends] == ["OK", "INVALID_ARGUMENT", "CANCELLED", "OK",
                                                          "UNAVAILABLE", "INTERNAL"]
    assert all(r.pdserve_fields["output_tokens"] == 2 and r.pdserve_fields["duration_s"] >= 0 for r in ends)
    starts = [r for r in caplog.records if r.getMessage() == "hop start"]
    assert len(starts) == 6 and starts[0].pdserve_fields == {"prompt_tokens": 3}


def test_a_client_deadline_is_counted_as_deadline_exceeded_not_cancelled():
    from gateway.client import Client
    from tests.support.background_gateway import BackgroundGateway
    with BackgroundGateway(metrics_port=0) as gw:
        gw.add_fake_decode("decode-0", token_ids=[1000, 1001])

        async def never_answers(*_args, **_kwargs):  # a stage that does not watch the deadline itself
            await asyncio.Event().wait()
            yield
        gw.gateway.dispatcher.stream = never_answers  # so gRPC's own cancel at the deadline ends it
        with Client(gw.address) as client, pytest.raises(grpc.RpcError) as error:
            client.generate("Hello", max_tokens=50, timeout=0.5)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 10
        while True:  # the gateway records the request once its handler has unwound
            samples = scrape(gw.server.metrics_address)["pdserve_requests"]
            by_status = {s.labels["status"]: s.value for s in samples if s.name.endswith("_total") and s.value}
            if by_status:
                break
            assert time.monotonic() < deadline, "the request was never counted"
            time.sleep(0.02)
        assert by_status == {"DEADLINE_EXCEEDED": 1}


def test_requests_refused_while_converting_sampling_fields_are_counted():
    from protos.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
    from tests.support.background_gateway import BackgroundGateway
    # Built by hand: the Python client checks sampling values before sending.
    request = generate_pb2.GenerateRequest(text="Hello", sampling=common_pb2.SamplingParams(temperature=-1.0))
    with BackgroundGateway(metrics_port=0) as gw:
        with grpc.insecure_channel(gw.address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            for call in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw))):
                with pytest.raises(grpc.RpcError) as error:
                    call(request, timeout=10)
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        samples = scrape(gw.server.metrics_address)["pdserve_requests"]
        by_status = {s.labels["status"]: s.value for s in samples if s.name.endswith("_total") and s.value}
        assert by_status == {"INVALID_ARGUMENT": 2}

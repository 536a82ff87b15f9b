"""Prometheus metrics of every pdserve service, and the HTTP endpoint that serves them.

Each service object owns its own CollectorRegistry (never prometheus_client's global
one: tests run several gateways and workers in one process) and serves it with
`MetricsServer` on `--metrics-port` (the gateway, prefill and decode alike).

Two kinds of numbers:

- Load that changes every step (requests running / waiting, KV usage, queued prefill
  tokens) and the engine's own cumulative counters (prefix-cache queries and hits,
  preemptions, finished requests) are read at scrape time by `EngineCollector` from the
  worker's load snapshot, the same InstanceLoad it heartbeats to the gateway. The engine
  thread replaces that snapshot dict after each step, so the scrape thread reads plain
  numbers that are at most one step old; nothing is updated per step for them.
- Events are counted where they happen: engine step durations (`observe_step`, on the
  engine thread), KV transfers ending (`observe_transfer`, on the engine thread as the connector reports them),
  requests at the gateway (`RequestTimer`, on the event loop), placement decisions,
  instances joining and leaving. prometheus_client's metric objects are thread-safe.

Every name has the `pdserve_` prefix; counters end in `_total`, durations are in
seconds and sizes in bytes. Engine metrics carry `role` and `instance_id` labels (a
handful of series per process); gateway metrics carry only bounded labels (status,
pool, policy), but for its per-instance load view (`pool`, `instance_id`: one series per
live instance). docs/architecture.md ("Metrics") lists them all.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from common.engine.kv_connector.metadata import KVTransferOutcome
from common.engine.structured_output.compile_buckets import COMPILE_SECONDS_BUCKETS

logger = logging.getLogger(__name__)

# No `*_created` series next to every counter and histogram: nothing here reads them, and
# they double the samples of each scrape. (Process-wide; pdserve owns its processes.)
disable_created_metrics()

# Buckets (seconds), like vLLM's: from cache hits on a GPU to a long prompt on a CPU.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
               480.0, 960.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0)
HEARTBEAT_GAP_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0)

POOLS = ("prefill", "decode")
PLACEMENT_RESULTS = ("placed", "none", "queue_full")  # pdserve_placement_decisions' result label
STEP_PHASES = ("prefill", "decode", "mixed")


def add_metrics_args(parser) -> None:
    """--metrics-port / --metrics-host, the same for the gateway and both workers."""
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics over HTTP (/metrics) on this port; 0 picks a free "
                             "one; unset: no metrics endpoint")
    parser.add_argument("--metrics-host", default=None,
                        help="interface for the metrics endpoint; default: --host")


class MetricsServer:
    """prometheus_client's HTTP server (a daemon thread) for one registry; `/metrics`."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.address = ""  # host:port once started
        self._httpd = None
        self._thread: threading.Thread | None = None

    def start(self, host: str, port: int) -> str:
        """Bind host:port (0: a free port) and serve; return "host:port" as bound."""
        if port < 0 or port > 65535:
            raise ValueError(f"metrics port must be 0 (a free one) to 65535; got {port}")
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise OSError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from None
        bound_port = self._httpd.server_port
        shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
        self.address = f"{shown}:{bound_port}"
        return self.address

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None


class ServiceMetrics:
    """What every service's metrics share: a registry of their own and its server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.server: MetricsServer | None = None

    def serve(self, host: str, port: int) -> str:
        self.server = MetricsServer(self.registry)
        return self.server.start(host, port)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def family_names(self) -> set[str]:
        """Names of the metric families this service exports (e.g. pdserve_requests)."""
        return {family.name for family in self.registry.collect()}

    def sample_names(self) -> set[str]:
        """Names of the series as scraped (pdserve_requests_total, ..._bucket, ...)."""
        return {sample.name for family in self.registry.collect() for sample in family.samples}


# --------------------------------------------------------------------------------- gateway

class GatewayMetrics(ServiceMetrics):
    def __init__(self, policy: str):
        super().__init__()
        r = self.registry
        self.policy = policy
        self.requests = Counter("pdserve_requests", "Generate calls that ended, by gRPC status "
                                "(OK, INVALID_ARGUMENT, CANCELLED, UNAVAILABLE, ...)", ["status"], registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of requests that were placed",
                                     registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens streamed back from decode "
                                         "instances", registry=r)
        self.ttft = Histogram("pdserve_request_ttft_seconds", "Time to first token: from the Generate call "
                              "reaching the gateway to the first generated token arriving from decode",
                              registry=r, buckets=TTFT_BUCKETS)
        self.tpot = Histogram("pdserve_request_tpot_seconds", "Time per output token after the first, per "
                              "successful request: (last token - first token) / (tokens - 1)",
                              registry=r, buckets=TPOT_BUCKETS)
        self.itl = Histogram("pdserve_request_itl_seconds", "Inter-token latency: time between consecutive "
                             "generated tokens as they reach the gateway", registry=r, buckets=TPOT_BUCKETS)
        self.e2e = Histogram("pdserve_request_e2e_seconds", "End-to-end latency of successful requests, "
                             "from the call reaching the gateway to its last token", registry=r,
                             buckets=E2E_BUCKETS)
        self.in_flight = Gauge("pdserve_num_requests_in_flight", "Generate calls the gateway is serving",
                               registry=r)
        self.embeddings = Counter("pdserve_embeddings", "Embed calls (gRPC Embed, each input of HTTP "
                                  "/v1/embeddings) that ended, by gRPC status", ["status"], registry=r)
        self.embedding_seconds = Histogram("pdserve_embedding_seconds", "Latency of successful Embed calls, "
                                           "from reaching the gateway to the vector", registry=r,
                                           buckets=E2E_BUCKETS)
        self.placements = Counter("pdserve_placement_decisions", "Placement decisions: pool prefill or "
                                  "decode; result placed, none (no live instance: the decode instance "
                                  "prefills locally / the request fails UNAVAILABLE) or queue_full (every "
                                  "prefill instance's queue at --max-prefill-queue-tokens: the decode "
                                  "instance prefills locally)",
                                  ["policy", "pool", "result"], registry=r)
        self.migrations = Counter("pdserve_request_migrations", "Requests moved to another decode instance "
                                  "after theirs was lost mid-stream, to continue after the tokens already "
                                  "streamed (each move counts; --migration-limit)", registry=r)
        self.instances_alive = Gauge("pdserve_instances_alive", "Registered instances per pool",
                                     ["pool"], registry=r)
        self.heartbeat_gap = Histogram("pdserve_heartbeat_gap_seconds", "Time between two consecutive "
                                       "heartbeats of one instance as the gateway receives them; "
                                       "--heartbeat-timeout must stay above its tail", ["pool"],
                                       registry=r, buckets=HEARTBEAT_GAP_BUCKETS)
        self.instance_load = InstanceLoadCollector()
        r.register(self.instance_load)
        for pool in POOLS:  # present, at 0, before any instance registers
            self.instances_alive.labels(pool).set(0)
            for result in PLACEMENT_RESULTS:
                self.placements.labels(policy, pool, result)
        self.requests.labels("OK")

    def request_timer(self) -> "RequestTimer":
        return RequestTimer(self)

    def embedding_finished(self, status: str, num_prompt_tokens: int, duration_s: float) -> None:
        """Count one Embed call under `status` (a grpc.StatusCode name)."""
        self.embeddings.labels(status).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        if status == "OK":
            self.embedding_seconds.observe(duration_s)

    def placed(self, pool: str, result: str) -> None:
        """result: one of PLACEMENT_RESULTS."""
        self.placements.labels(self.policy, pool, result).inc()

    def migrated(self, timer: "RequestTimer | None" = None) -> None:
        self.migrations.inc()
        if timer is not None:
            timer.num_migrations += 1

    def set_instances_alive(self, pool: str, count: int) -> None:
        self.instances_alive.labels(pool).set(count)

    def heartbeat_received(self, pool: str, gap_s: float | None) -> None:
        if gap_s is not None:
            self.heartbeat_gap.labels(pool).observe(gap_s)

    def watch_instances(self, instances: Callable[[], Iterable[Any]]) -> None:
        """Export each live instance's load as placement sees it (InstanceLoadCollector)."""
        self.instance_load.instances = instances


class InstanceLoadCollector(Collector):
    """The gateway's estimate of each live instance's load, read when scraped: what
    placement weighs (the instance's last heartbeat plus what this gateway has dispatched
    there and seen finish since; gateway.routing.load_estimate). One series per live
    instance, so one that leaves drops out instead of freezing at its last value.

    `instances()` returns objects with role, instance_id, num_requests,
    queued_prefill_tokens and free_blocks (the registry's Instance); it runs on the
    scrape thread, so it must only take a snapshot.
    """

    def __init__(self) -> None:
        self.instances: Callable[[], Iterable[Any]] = tuple

    def describe(self) -> Iterable[Metric]:
        return self._families(())

    def collect(self) -> Iterable[Metric]:
        return self._families(self.instances())

    @staticmethod
    def _families(instances: Iterable[Any]) -> list[Metric]:
        names = ["pool", "instance_id"]
        requests = GaugeMetricFamily("pdserve_instance_estimated_requests", "Requests running or waiting on "
                                     "the instance as placement sees them", labels=names)
        queued = GaugeMetricFamily("pdserve_instance_estimated_queued_prefill_tokens", "Prompt tokens still to "
                                   "compute on the instance as placement sees them", labels=names)
        free = GaugeMetricFamily("pdserve_instance_estimated_free_blocks", "Free KV blocks on the instance as "
                                 "placement sees them", labels=names)
        for instance in instances:
            labels = [instance.role, instance.instance_id]
            requests.add_metric(labels, instance.num_requests)
            queued.add_metric(labels, instance.queued_prefill_tokens)
            free.add_metric(labels, instance.free_blocks)
        return [requests, queued, free]


class RequestTimer:
    """One Generate call's clock at the gateway (vLLM's definitions): TTFT at the first
    generated token, ITL between tokens, TPOT and E2E when it ends successfully."""

    def __init__(self, metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic):
        self.metrics = metrics
        self.clock = clock
        self.started = clock()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_tokens = 0
        self.request_id = ""  # set once the request is prepared (the gateway may make the id)
        self.num_prompt_tokens = 0  # set once the request is tokenized
        self.num_migrations = 0  # moves to another decode instance (gateway.routing.dispatcher)
        metrics.in_flight.inc()

    def tokens(self, num_tokens: int) -> None:
        """A decode message with num_tokens new tokens arrived."""
        if num_tokens <= 0:
            return
        now = self.clock()
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.started)
        else:  # a message with several tokens (speculative, batched) spreads its gap over them
            gap = (now - self.last_token_at) / num_tokens
            for _ in range(num_tokens):
                self.metrics.itl.observe(gap)
        self.last_token_at = now
        self.num_tokens += num_tokens

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    def finish(self, status: str) -> float:
        """Count the request under `status` (a grpc.StatusCode name); return its duration."""
        now = self.clock()
        m = self.metrics
        m.in_flight.dec()
        m.requests.labels(status).inc()
        m.prompt_tokens.inc(self.num_prompt_tokens)
        m.generation_tokens.inc(self.num_tokens)
        if status == "OK":
            m.e2e.observe(now - self.started)
            if self.num_tokens > 1:
                m.tpot.observe((self.last_token_at - self.first_token_at) / (self.num_tokens - 1))
        return now - self.started


# -------------------------------------------------------------------------------- workers

def step_phase(scheduled: Sequence[Any]) -> str:
    """prefill (only prompt chunks), decode (one new token per request) or mixed."""
    num_prefill = sum(1 for s in scheduled
                      if len(s.token_ids) > 1 or s.start_pos < len(s.prompt_token_ids))
    if num_prefill == 0:
        return "decode"
    return "prefill" if num_prefill == len(scheduled) else "mixed"


class EngineCollector(Collector):
    """Engine load and cumulative counters, read when scraped.

    `load()` returns the worker's InstanceLoad (what it heartbeats) and `stats()` the
    engine's stats snapshot; both only read the dict the engine thread last published.
    """

    def __init__(self, role: str, instance_id: str, load: Callable[[], Any], stats: Callable[[], dict]):
        self.labels = [role, instance_id]
        self._load = load
        self._stats = stats

    def describe(self) -> Iterable[Metric]:
        return self._families(None, None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self._load(), self._stats())

    def _families(self, load, stats) -> list[Metric]:
        names = ["role", "instance_id"]

        def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            if value is not None:
                family.add_metric(self.labels, value)
            return family

        def counter(name: str, doc: str, key: str) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            if stats is not None:
                family.add_metric(self.labels, stats.get(key, 0))
            return family

        have = load is not None
        total = load.num_total_blocks if have else 0
        return [
            gauge("pdserve_num_requests_running", "Requests in the running batch (decode: also those "
                  "holding blocks while their KV arrives)", load.num_running_requests if have else None),
            gauge("pdserve_num_requests_waiting", "Requests queued for a seat or KV blocks",
                  load.num_waiting_requests if have else None),
            gauge("pdserve_kv_cache_usage_ratio", "Fraction of the KV pool's blocks in use (cached "
                  "prefix blocks that can be evicted, and blocks held ahead, count as free)",
                  (1.0 - load.num_free_blocks / total if total else 0.0) if have else None),
            gauge("pdserve_kv_cache_blocks", "KV pool size in blocks", total if have else None),
            gauge("pdserve_kv_cache_blocks_held_ahead", "Blocks requests hold past their tokens "
                  "(--num-kv-blocks-ahead), given back when an allocation needs them",
                  stats.get("num_blocks_held_ahead") if stats is not None else None),
            gauge("pdserve_queued_prefill_tokens", "Prompt tokens still to be computed: waiting requests' "
                  "tokens less their cached prefix, plus running ones' uncomputed prompt",
                  load.num_queued_prefill_tokens if have else None),
            counter("pdserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                    "(once per admission)", "prefix_cache_queried_tokens"),
            counter("pdserve_prefix_cache_hits", "Prompt tokens found in the prefix cache", "prefix_cache_hit_tokens"),
            counter("pdserve_num_preemptions", "Running requests preempted for lack of KV blocks "
                    "(recomputed later)", "num_preemptions"),
            counter("pdserve_engine_requests_finished", "Requests the engine finished (any reason)",
                    "num_finished_requests"),
            counter("pdserve_structured_output_requests", "Requests admitted with an output constraint "
                    "(structured outputs)", "structured_output_requests"),
            counter("pdserve_structured_output_bitmask_seconds", "Time spent building the token bitmasks "
                    "of constrained requests, summed over steps", "structured_output_bitmask_seconds"),
            self._compile_histogram(names, stats),
            counter("pdserve_spec_decode_num_drafts", "Speculative verifications: one per request-step "
                    "that verified drafts", "spec_num_drafts"),
            counter("pdserve_spec_decode_num_draft_tokens", "Draft tokens verified", "spec_num_draft_tokens"),
            counter("pdserve_spec_decode_num_accepted_tokens", "Draft tokens the target accepted",
                    "spec_num_accepted_tokens"),
            self._accepted_per_position(names, stats),
            *self._lora_families(names, stats),
        ]

    def _lora_families(self, names: list[str], stats: dict | None) -> list[Metric]:
        """An instance with LoRA on (its stats carry lora_*): requests per adapter and the
        adapter slots (vLLM's vllm:lora_requests_info, as one series per adapter)."""
        stats = stats or {}
        families: list[Metric] = []
        for key, doc in (("lora_requests_running", "Requests in the running batch, by LoRA adapter (decode: also "
                          "those holding blocks while their KV arrives)"),
                         ("lora_requests_waiting", "Requests queued for a seat or KV blocks, by LoRA adapter")):
            family = GaugeMetricFamily(f"pdserve_{key}", doc, labels=names + ["lora_name"])
            for lora_name, count in sorted(stats.get(key, {}).items()):
                family.add_metric(self.labels + [lora_name], count)
            families.append(family)
        has_lora = "lora_max_adapters" in stats
        for key, doc in (("lora_adapters_held", "LoRA adapters the engine holds"),
                         ("lora_max_adapters", "LoRA adapters the engine may hold at once (--max-loras)")):
            family = GaugeMetricFamily(f"pdserve_{key}", doc, labels=names)
            if has_lora:
                family.add_metric(self.labels, stats[key])
            families.append(family)
        for key, doc in (("lora_adapter_loads", "LoRA adapters read into the engine (first use, run-time "
                          "loads, again after an eviction)"),
                         ("lora_adapter_evictions", "LoRA adapters dropped to make room for another (--max-loras "
                          "full): evictions near the loads mean the traffic's adapters do not fit")):
            family = CounterMetricFamily(f"pdserve_{key}", doc, labels=names)
            if has_lora:
                family.add_metric(self.labels, stats[key])
            families.append(family)
        return families

    def _accepted_per_position(self, names: list[str], stats: dict | None) -> CounterMetricFamily:
        family = CounterMetricFamily("pdserve_spec_decode_num_accepted_tokens_per_pos", "Draft tokens "
                                     "accepted at each draft position (0: the first draft)",
                                     labels=names + ["position"])
        for position, count in enumerate((stats or {}).get("spec_num_accepted_tokens_per_pos", [])):
            family.add_metric(self.labels + [str(position)], count)
        return family

    def _compile_histogram(self, names: list[str], stats: dict | None) -> HistogramMetricFamily:
        """The engine counts compiles per bucket (plain data in its stats); made cumulative here."""
        family = HistogramMetricFamily("pdserve_structured_output_compile_seconds", "Time to compile an "
                                       "output constraint into a grammar (cache misses only)", labels=names)
        if stats is not None:
            counts = stats.get("structured_output_compile_bucket_counts") or [0] * (len(COMPILE_SECONDS_BUCKETS) + 1)
            bounds = [str(bound) for bound in COMPILE_SECONDS_BUCKETS] + ["+Inf"]
            cumulative = [sum(counts[:i + 1]) for i in range(len(counts))]
            family.add_metric(self.labels, list(zip(bounds, cumulative)),
                              stats.get("structured_output_compile_seconds", 0.0))
        return family


class WorkerMetrics(ServiceMetrics):
    """A prefill or decode instance: engine load (scraped), step times, KV transfers.

    KV transfers: the prefill instance counts what it sends, the decode instance what it
    receives (`role` tells them apart). Bytes count completed transfers; the duration of a
    send runs from its start (the step of the prompt's last chunk) to the receiver's ack,
    of a receive from its first KV message to its last block landing.
    """

    def __init__(self, role: str, instance_id: str, load: Callable[[], Any], stats: Callable[[], dict]):
        super().__init__()
        r = self.registry
        self.role, self.instance_id = role, instance_id
        labels = ["role", "instance_id"]
        r.register(EngineCollector(role, instance_id, load, stats))
        self.step_duration = Histogram(
            "pdserve_engine_step_duration_seconds", "One engine step (schedule, forward, sample, update; "
            "decode steps run back to back by --num-scheduler-steps count as one), by what it ran: prefill chunks "
            "only, decode tokens only, or both", [*labels, "phase"],
            registry=r, buckets=STEP_BUCKETS)
        self.step_tokens = Counter("pdserve_engine_scheduled_tokens", "Tokens run through the model, by "
                                   "step phase", [*labels, "phase"], registry=r)
        self.transfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes of completed transfers "
                                      "(prefill: sent; decode: received)", labels, registry=r)
        self.transfer_duration = Histogram("pdserve_kv_transfer_duration_seconds", "Duration of completed "
                                           "KV transfers", labels, registry=r, buckets=TRANSFER_BUCKETS)
        self.transfer_failures = Counter("pdserve_kv_transfer_failures", "KV transfers that did not "
                                         "complete, by end state (failed, expired)", [*labels, "state"],
                                         registry=r)
        # vLLM's per-request intervals (common.engine.outputs.RequestTimings), of every request
        # this engine finished, aborted ones too.
        self.request_intervals = {name: Histogram(
            f"pdserve_engine_request_{name}_time_seconds", help_text, labels, registry=r,
            buckets=TTFT_BUCKETS).labels(role, instance_id) for name, help_text in (
                ("queue", "From a request's arrival at the engine until its first step (a decode "
                          "instance's KV import: until its KV landed)"),
                ("prefill", "From a request's first step until its first token here (0 for a KV import)"),
                ("decode", "From a request's first token here until its end"),
                ("inference", "From a request's first step until its end (prefill + decode)"))}
        self._steps = {phase: (self.step_duration.labels(role, instance_id, phase),
                               self.step_tokens.labels(role, instance_id, phase)) for phase in STEP_PHASES}
        self._bytes = self.transfer_bytes.labels(role, instance_id)
        self._transfer_seconds = self.transfer_duration.labels(role, instance_id)
        for state in ("failed", "expired"):
            self.transfer_failures.labels(role, instance_id, state)

    def observe_step(self, scheduler_output, seconds: float) -> None:
        """EngineCore.step_observer: called on the engine thread after each non-empty step."""
        if scheduler_output.is_empty:
            return
        duration, tokens = self._steps[step_phase(scheduler_output.scheduled)]
        duration.observe(seconds)
        # Decode steps run back to back (--num-scheduler-steps) ran each token that many times.
        tokens.inc(scheduler_output.num_scheduled_tokens * scheduler_output.num_steps)

    def observe_finished(self, output) -> None:
        """AsyncEngine.finished_observers: a request ended (engine thread); `output` is its last
        common.engine.outputs.EngineCoreOutput, with its timings."""
        timings = output.timings
        for name, seconds in (("queue", timings.queued_s), ("prefill", timings.prefill_s),
                              ("decode", timings.decode_s), ("inference", timings.inference_s)):
            self.request_intervals[name].observe(seconds)

    def observe_transfer(self, outcome: KVTransferOutcome) -> None:
        """A KV transfer ended (engine thread, from the engine's kv_transfer_observers)."""
        if outcome.ok:
            self._bytes.inc(outcome.num_bytes)
            began = outcome.first_byte_at if outcome.first_byte_at is not None else outcome.started_at
            if outcome.ended_at is not None:
                self._transfer_seconds.observe(max(0.0, outcome.ended_at - began))
        else:
            self.transfer_failures.labels(self.role, self.instance_id, outcome.state).inc()


def _reference_metrics() -> tuple[GatewayMetrics, WorkerMetrics]:
    from types import SimpleNamespace
    load = SimpleNamespace(num_running_requests=0, num_waiting_requests=0, num_free_blocks=1,
                           num_total_blocks=1, num_queued_prefill_tokens=0)
    gateway = GatewayMetrics("prefix_aware")
    instance = SimpleNamespace(role="decode", instance_id="reference", num_requests=0, queued_prefill_tokens=0,
                               free_blocks=1)
    gateway.watch_instances(lambda: [instance])  # so its per-instance series show
    return gateway, WorkerMetrics("decode", "reference", lambda: load, dict)


def all_metric_family_names() -> set[str]:
    """Every family the gateway and the workers export (for docs and dashboard checks)."""
    return set().union(*(m.family_names() for m in _reference_metrics()))


def all_sample_names() -> set[str]:
    """Every series name as scraped (with _total, _bucket, _sum, _count suffixes)."""
    return set().union(*(m.sample_names() for m in _reference_metrics()))

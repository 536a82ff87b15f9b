"""Discrete-event simulation of a deployment: the real scheduler, the real placement.

`pdserve plan` checks each candidate deployment (P prefill + D decode instances, or N
colocated ones) here before it believes the queueing formulas. Nothing is approximated
that the code itself can decide:

- every instance runs the engine's own `Scheduler` and `KVCacheManager`
  (common.engine: continuous batching, chunked prefill, prefix caching, preemption,
  max_num_seqs, max_num_batched_tokens, the decode role's `reserve_remote_kv` /
  `finish_remote_kv`); only the forward pass is replaced by a clock that advances by
  the profile's step time for what the scheduler put in the step (bench.profile);
- the gateway's own objects place each request: `InstanceRegistry` with heartbeats,
  `LoadLedger` charges and releases, `KvIndex` fed by the prefill instances' real KV
  events (after `event_lag_s`), the prefix-aware prefill policy and decode by load
  (gateway.routing), and admission per pool as gateway/admission.py does it:
  max_running_per_decode requests per decode instance for their whole life, then
  max_running_per_prefill per prefill instance until their first token, the rest of each
  queued in arrival order;
- a request's path is the disaggregated one: decode reserves a seat and blocks between
  its steps, the prefill instance runs the prompt (max_tokens 1), the KV moves for the
  profile's transfer time, and the request joins decode's batch at decode's next step
  boundary with the first token: that moment is its TTFT, as the gateway measures it.
  With no prefill instance the decode instance prefills locally (colocated).

What it leaves out: RPC and network latency other than the KV transfer, the client's
and the gateway's own CPU time, and other processes sharing a core.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from bench.profile import Profile
from common.engine.config import SchedulerConfig
from common.engine.kv_cache_manager import KVCacheManager
from common.engine.outputs import EngineCoreOutput, RunnerOutput, SchedulerOutput
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler
from common.service.registration import InstanceLoad, InstanceSpec
from gateway.routing.kv_index import KvIndex
from gateway.routing.load_ledger import LoadLedger, PlacementCharge
from gateway.routing.placement import choose_remote_prefill
from gateway.routing.policies import PrefixAware
from gateway.routing.registry import InstanceRegistry
from common.service.kv_events import encode_event

SAMPLED_TOKEN_ID = 1000  # what every simulated step samples: ignore_eos makes its value irrelevant


@dataclass(frozen=True)
class InstanceShape:
    """One instance's engine settings (what `pdserve tune` chooses)."""
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int = 1024
    block_size: int = 16
    max_model_len: int = 4096


@dataclass(frozen=True)
class Deployment:
    num_prefill: int
    num_decode: int  # with num_prefill 0: colocated instances that prefill locally
    prefill_shape: InstanceShape = InstanceShape()
    decode_shape: InstanceShape = InstanceShape()

    @property
    def colocated(self) -> bool:
        return self.num_prefill == 0

    @property
    def num_instances(self) -> int:
        return self.num_prefill + self.num_decode

    def label(self) -> str:
        return f"colocated x{self.num_decode}" if self.colocated else f"{self.num_prefill}P:{self.num_decode}D"


@dataclass
class SimRequest:
    req_id: str
    arrival_s: float
    prompt_ids: list[int]
    output_len: int
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_output_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """vLLM's: (last token - first token) / (tokens - 1)."""
        n = self.num_output_tokens
        return (self.last_token_s - self.first_token_s) / (n - 1) if n > 1 else None


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, time_s: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._events, (max(time_s, self.now), next(self._seq), callback))

    def run(self, until_s: float = float("inf")) -> None:
        while self._events and self._events[0][0] <= until_s:
            self.now, _, callback = heapq.heappop(self._events)
            callback()


class SimEngine:
    """One instance: the real Scheduler and KV cache manager; a step lasts what the
    profile says the scheduled work costs. Calls from outside (reserve, finish an
    import, add a request) run between steps, as AsyncEngine.call does."""

    def __init__(self, instance_id: str, role: str, shape: InstanceShape, profile: Profile, loop: EventLoop,
                 on_outputs: Callable[["SimEngine", list[EngineCoreOutput]], None]):
        self.instance_id, self.role, self.profile, self.loop = instance_id, role, profile, loop
        self.kv = KVCacheManager(shape.num_kv_blocks, shape.block_size, enable_prefix_caching=True)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=shape.max_num_seqs,
                                                   max_num_batched_tokens=shape.max_num_batched_tokens,
                                                   max_model_len=shape.max_model_len),
                                   self.kv, shape.block_size, shape.max_model_len)
        self.on_outputs = on_outputs
        self.stepping = False
        self.pending_calls: deque[Callable[[], None]] = deque()
        self.busy_s = 0.0
        self.batch_time_integral = 0.0  # sum over steps of running requests x step seconds

    def call(self, fn: Callable[[], None]) -> None:
        self.pending_calls.append(fn)
        if not self.stepping:
            self._between_steps()

    def _between_steps(self) -> None:
        while self.pending_calls:
            self.pending_calls.popleft()()
        output = self.scheduler.schedule()
        if output.is_empty:
            self.stepping = False
            return
        self.stepping = True
        step_s = self.step_seconds(output)
        self.busy_s += step_s
        self.batch_time_integral += len(output.scheduled) * step_s
        self.loop.at(self.loop.now + step_s, lambda: self._end_step(output))

    def step_seconds(self, output: SchedulerOutput) -> float:
        chunks, batch_size, context = [], 0, 0
        for scheduled in output.scheduled:
            num_new = len(scheduled.token_ids)
            if scheduled.start_pos >= len(scheduled.prompt_token_ids):  # a decode: one generated token
                batch_size += 1
                context += scheduled.start_pos + 1
            else:
                chunks.append((num_new, scheduled.start_pos))
        return self.profile.mixed_step_s(chunks, batch_size, context)

    def _end_step(self, output: SchedulerOutput) -> None:
        sampled = [s.req_id for s in output.scheduled if s.do_sample]
        outputs = self.scheduler.update_from_output(
            output, RunnerOutput(req_ids=sampled, sampled_token_ids=[[SAMPLED_TOKEN_ID]] * len(sampled)))
        if outputs:
            self.on_outputs(self, outputs)
        self._between_steps()

    def load(self) -> InstanceLoad:
        stats = self.scheduler.stats
        return InstanceLoad(num_running_requests=stats["num_running"] + stats["num_waiting_for_remote_kv"],
                            num_waiting_requests=stats["num_waiting"], num_free_blocks=stats["num_free_blocks"],
                            num_total_blocks=stats["num_total_blocks"],
                            num_queued_prefill_tokens=stats["num_queued_prefill_tokens"],
                            kv_events_sequence=self.kv.last_event_seq)


@dataclass
class SimResult:
    deployment: Deployment
    requests: list[SimRequest]
    duration_s: float
    mean_decode_batch: float  # time-averaged running requests per decode instance while stepping
    decode_utilisation: float  # busy fraction of the decode instances
    prefill_utilisation: float  # busy fraction of the prefill instances (0 when colocated)
    prefix_hit_rate: float
    num_preemptions: int

    def percentile(self, metric: str, p: float) -> float:
        values = self.samples(metric)
        return float(np.percentile(values, p)) if values else float("inf")

    def samples(self, metric: str) -> list[float]:
        done = [r for r in self.requests if r.first_token_s is not None]
        if metric == "ttft":
            return [r.ttft_s for r in done]
        return [r.tpot_s for r in done if r.tpot_s is not None]

    @property
    def completed(self) -> int:
        return sum(r.num_output_tokens == r.output_len for r in self.requests)


@dataclass
class Simulation:
    deployment: Deployment
    profile: Profile
    requests: list[SimRequest]
    max_running_per_decode: int | None = None  # gateway admission; default: decode's max_num_seqs
    max_running_per_prefill: int = 64  # gateway admission to the prefill pool (its default); <= 0: none
    heartbeat_interval_s: float = 1.0
    event_lag_s: float = 0.005
    loop: EventLoop = field(default_factory=EventLoop)

    def run(self) -> SimResult:
        d = self.deployment
        loop = self.loop
        self.registry = InstanceRegistry(heartbeat_interval_s=self.heartbeat_interval_s,
                                         heartbeat_timeout_s=float("inf"), clock=lambda: loop.now)
        self.index = KvIndex(clock=lambda: loop.now)
        self.ledger = LoadLedger(self.index)
        self.policy = PrefixAware(self.index)
        self.engines: dict[str, SimEngine] = {}
        pools = (("prefill", d.num_prefill, d.prefill_shape), ("decode", d.num_decode, d.decode_shape))
        for role, count, shape in pools:
            for k in range(count):
                instance_id = f"{role}-{k}"
                self.engines[instance_id] = SimEngine(instance_id, role, shape, self.profile, loop, self._on_outputs)
                self.registry.register(InstanceSpec(instance_id, role, f"sim:{instance_id}",
                                                    block_size=shape.block_size, num_total_blocks=shape.num_kv_blocks))
                if role == "prefill":
                    self.index.add_instance(instance_id)
        self.cap = (self.max_running_per_decode or d.decode_shape.max_num_seqs) * d.num_decode
        self.in_flight = 0
        self.gateway_queue: deque[SimRequest] = deque()
        # The gateway's prefill pool queue: a slot from decode admission to the first token.
        self.prefill_cap = (self.max_running_per_prefill * d.num_prefill
                            if self.max_running_per_prefill > 0 and d.num_prefill else None)
        self.in_prefill: set[str] = set()
        self.prefill_queue: deque[SimRequest] = deque()
        self.by_id = {r.req_id: r for r in self.requests}
        self.charges: dict[str, PlacementCharge] = {}
        self.decode_of: dict[str, SimEngine] = {}
        self.transfer_tokens: dict[str, int] = {}  # KV tokens each remote prefill sends (decode's prefix hits excluded)
        self.num_unfinished = len(self.requests)
        for request in self.requests:
            loop.at(request.arrival_s, lambda r=request: self._arrive(r))
        self._heartbeat()
        loop.run()
        return self._result()

    # ---- the gateway --------------------------------------------------------------------

    def _heartbeat(self) -> None:
        for engine in self.engines.values():
            self.registry.heartbeat(engine.instance_id, engine.load())
        if self.num_unfinished:
            self.loop.at(self.loop.now + self.heartbeat_interval_s, self._heartbeat)

    def _arrive(self, request: SimRequest) -> None:
        if self.in_flight < self.cap:
            self._admit_decode(request)
        else:
            self.gateway_queue.append(request)

    def _admit_decode(self, request: SimRequest) -> None:
        self.in_flight += 1
        if self.prefill_cap is None or len(self.in_prefill) < self.prefill_cap:
            self._dispatch(request)
        else:
            self.prefill_queue.append(request)

    def _prefill_done(self, req_id: str) -> None:
        if req_id in self.in_prefill:
            self.in_prefill.discard(req_id)
            if self.prefill_queue:
                self._dispatch(self.prefill_queue.popleft())

    def _dispatch(self, request: SimRequest) -> None:
        if self.prefill_cap is not None:
            self.in_prefill.add(request.req_id)
        decode_instance = self.policy.choose_decode(len(request.prompt_ids), self.registry.instances("decode"))
        prefill_instance, block_hashes = choose_remote_prefill(self.policy, self.registry.instances("prefill"),
                                                               request.prompt_ids)
        self.charges[request.req_id] = self.ledger.charge(len(request.prompt_ids), prefill=prefill_instance,
                                                          prompt_block_hashes=block_hashes, decode=decode_instance)
        decode = self.engines[decode_instance.instance_id]
        self.decode_of[request.req_id] = decode
        engine_request = Request(request.req_id, request.prompt_ids,
                                 SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True),
                                 arrival_time=request.arrival_s)
        if prefill_instance is None:
            self._prefill_done(request.req_id)  # prefilled on the decode instance
            decode.call(lambda: decode.scheduler.add_request(engine_request))
            return
        prefill = self.engines[prefill_instance.instance_id]

        def reserve() -> None:
            reservation = decode.scheduler.reserve_remote_kv(engine_request)
            if reservation is None:  # no seat or blocks now: try again after decode's next step
                decode.pending_calls.append(reserve)
                return
            num_to_send = len(request.prompt_ids) - reservation.num_cached_tokens
            prefill.call(lambda: prefill.scheduler.add_request(Request(
                request.req_id, request.prompt_ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                arrival_time=request.arrival_s)))
            self.transfer_tokens[request.req_id] = num_to_send

        decode.call(reserve)

    def _on_outputs(self, engine: SimEngine, outputs: list[EngineCoreOutput]) -> None:
        now = self.loop.now
        if engine.role == "prefill":
            self._publish_kv_events(engine)
            for output in outputs:
                decode = self.decode_of[output.req_id]
                landed = now + self.profile.transfer_s(self.transfer_tokens.pop(output.req_id))
                self.loop.at(landed, lambda d=decode, rid=output.req_id, tok=output.new_token_ids: d.call(
                    lambda: self._on_outputs(d, d.scheduler.finish_remote_kv(rid, tok))))
            return
        for output in outputs:
            request = self.by_id[output.req_id]
            if request.first_token_s is None:
                request.first_token_s = now
                self.charges[output.req_id].release_prefill()
                self._prefill_done(output.req_id)
            request.last_token_s = now
            request.num_output_tokens += len(output.new_token_ids)
            if output.finished:
                self.charges.pop(output.req_id).release()
                self.num_unfinished -= 1
                self.in_flight -= 1
                if self.gateway_queue:
                    self._admit_decode(self.gateway_queue.popleft())

    def _publish_kv_events(self, engine: SimEngine) -> None:
        events = [encode_event(e) for e in engine.kv.take_events()]
        if events:
            self.loop.at(self.loop.now + self.event_lag_s,
                         lambda: self.index.apply_events(engine.instance_id, events)
                         and self.index.apply_snapshot(engine.instance_id, engine.kv.last_event_seq,
                                                       engine.kv.all_cached_block_hashes()))

    def _result(self) -> SimResult:
        duration = max((r.last_token_s or 0.0) for r in self.requests) if self.requests else 0.0
        decodes = [e for e in self.engines.values() if e.role == "decode"]
        prefills = [e for e in self.engines.values() if e.role == "prefill"]
        busy = sum(e.busy_s for e in decodes)
        queried = sum(e.kv.stats.num_query_tokens for e in (prefills or decodes))
        hits = sum(e.kv.stats.num_hit_tokens for e in (prefills or decodes))
        return SimResult(
            self.deployment, self.requests, duration,
            mean_decode_batch=sum(e.batch_time_integral for e in decodes) / busy if busy else 0.0,
            decode_utilisation=busy / (duration * len(decodes)) if duration else 0.0,
            prefill_utilisation=(sum(e.busy_s for e in prefills) / (duration * len(prefills))
                                 if prefills and duration else 0.0),
            prefix_hit_rate=hits / queried if queried else 0.0,
            num_preemptions=sum(e.scheduler.num_preemptions for e in self.engines.values()))


def simulate(deployment: Deployment, profile: Profile, requests: list[SimRequest],
             max_running_per_decode: int | None = None, max_running_per_prefill: int = 64) -> SimResult:
    fresh = [SimRequest(r.req_id, r.arrival_s, r.prompt_ids, r.output_len) for r in requests]
    return Simulation(deployment, profile, fresh, max_running_per_decode, max_running_per_prefill).run()

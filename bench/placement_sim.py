"""Deterministic simulation of prefix-cache hit rates under each placement policy.

    pdserve bench placement-sim [--requests N] [--seed S] [--cache-blocks B]

Workload: tenants that each have a fixed system prompt, followed by a unique user
message; Poisson arrivals. Tenant order "rounds": every tenant sends at the same
steady rate (one closed-loop client per tenant, say), so each round has every
tenant once, in random order. Order "random": each request's tenant drawn
independently. Under "random", LRU hit rate is at most linear in cache size
(Che's approximation), so round_robin, which halves each tenant's request rate per
instance, loses at most 2x to any policy: prefix_aware cannot reach 2x there.

Each simulated prefill instance is a FIFO server that
computes only uncached prompt tokens at a fixed rate, with an LRU cache of block
hashes (prefix blocks evicted last, as the engine frees a request's tail first).
Its cache changes go out as KV events, arriving at the gateway's real KvIndex
after `event_lag_s`; load reaches the real InstanceRegistry by heartbeats, and the
real LoadLedger charges each dispatch and releases it at the simulated first token.
The real policies choose. The oracle (bench.oracle_policy) sees the true caches,
including what requests queued ahead will have cached by the time a request starts.
Hit rate = prompt tokens served from cache / prompt tokens.
"""
from __future__ import annotations

import argparse
import heapq
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from bench.oracle_policy import Oracle
from common.engine.block_hash import compute_block_hashes
from common.service.registration import InstanceLoad, InstanceSpec
from gateway.routing.kv_index import KvIndex
from gateway.routing.load_ledger import LoadLedger, PlacementCharge
from gateway.routing.policies import LeastLoaded, PrefixAware, RoundRobin
from gateway.routing.registry import InstanceRegistry


@dataclass(frozen=True)
class SimConfig:
    num_tenants: int = 8
    system_prompt_tokens: int = 512
    user_tokens: tuple[int, int] = (32, 160)  # uniform range of the unique part
    block_size: int = 16
    num_prefill: int = 2
    # Per instance: 5 of the 8 tenants' system prompts (32 blocks each). Both caches
    # together hold every tenant, one alone does not: placement decides hit rates.
    cache_blocks: int = 160
    num_requests: int = 2000
    arrival_rate: float = 20.0  # requests/s
    prefill_tokens_per_s: float = 10_000.0  # per instance
    event_lag_s: float = 0.01
    heartbeat_interval_s: float = 0.1
    tenant_order: str = "rounds"  # or "random"
    seed: int = 0


@dataclass
class SimRequest:
    arrival: float
    tenant: int
    num_tokens: int
    block_hashes: list[int]


def make_workload(cfg: SimConfig) -> list[SimRequest]:
    rng = random.Random(cfg.seed)
    system_prompts = [[rng.randrange(32_000) for _ in range(cfg.system_prompt_tokens)]
                      for _ in range(cfg.num_tenants)]
    requests, now, tenants = [], 0.0, []
    for _ in range(cfg.num_requests):
        if not tenants:
            tenants = list(range(cfg.num_tenants))
            rng.shuffle(tenants)
        tenant = tenants.pop() if cfg.tenant_order == "rounds" else rng.randrange(cfg.num_tenants)
        now += rng.expovariate(cfg.arrival_rate)
        tokens = system_prompts[tenant] + [rng.randrange(32_000) for _ in range(rng.randint(*cfg.user_tokens))]
        requests.append(SimRequest(now, tenant, len(tokens), compute_block_hashes(tokens, cfg.block_size)))
    return requests


class LruBlockCache:
    """An instance's prefix cache of block hashes, emitting KV events like the engine."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.seq = 0

    def cached_prefix(self, block_hashes: list[int], also: set[int] = frozenset()) -> int:
        for count, block_hash in enumerate(block_hashes):
            if block_hash not in self.blocks and block_hash not in also:
                return count
        return len(block_hashes)

    def insert(self, block_hashes: list[int]) -> list[dict]:
        stored, removed = [], []
        for block_hash in reversed(block_hashes):  # the prefix ends most recently used
            if block_hash in self.blocks:
                self.blocks.move_to_end(block_hash)
            else:
                self.blocks[block_hash] = None
                stored.append(block_hash)
        while len(self.blocks) > self.capacity:
            removed.append(self.blocks.popitem(last=False)[0])
        events = []
        for kind, hashes in (("stored", stored), ("removed", removed)):
            if hashes:
                self.seq += 1
                events.append({"seq": self.seq, "type": kind, "block_hashes": hashes})
        return events


@dataclass
class SimInstance:
    instance_id: str
    cache: LruBlockCache
    free_at: float = 0.0
    queue: deque[SimRequest] = field(default_factory=deque)

    def queued_tokens(self, now: float, rate: float, block_size: int) -> int:
        """What the engine's heartbeat reports: the running prefill's rest, plus each queued
        prompt less the prefix cached now."""
        return int(max(0.0, self.free_at - now) * rate) + sum(
            r.num_tokens - self.cache.cached_prefix(r.block_hashes) * block_size for r in self.queue)

    def cached_prefix_at_start(self, block_hashes: list[int]) -> int:
        ahead = set().union(*(r.block_hashes for r in self.queue))
        return self.cache.cached_prefix(block_hashes, ahead)


@dataclass
class SimResult:
    policy: str
    hit_rate: float
    mean_ttft_s: float
    requests_per_instance: dict[str, int]


def simulate(policy_name: str, cfg: SimConfig, requests: list[SimRequest]) -> SimResult:
    now = 0.0
    registry = InstanceRegistry(heartbeat_interval_s=cfg.heartbeat_interval_s,
                                heartbeat_timeout_s=float("inf"), clock=lambda: now)
    index = KvIndex(clock=lambda: now)
    ledger = LoadLedger(index)
    sims: dict[str, SimInstance] = {}
    for k in range(cfg.num_prefill):
        instance_id = f"prefill-{k}"
        registry.register(InstanceSpec(instance_id, "prefill", f"sim:{k}", block_size=cfg.block_size,
                                       num_total_blocks=cfg.cache_blocks))
        index.add_instance(instance_id)
        sims[instance_id] = SimInstance(instance_id, LruBlockCache(cfg.cache_blocks))
    policy = {"round_robin": RoundRobin(), "least_loaded": LeastLoaded(), "prefix_aware": PrefixAware(index),
              "oracle": Oracle(lambda iid, hashes: sims[iid].cached_prefix_at_start(hashes),
                               cached_count=lambda iid: len(sims[iid].cache.blocks))}[policy_name]
    in_flight_events: list[tuple[float, int, str, list[dict]]] = []  # heap by delivery time
    # The gateway sees a prefill finish when its first token arrives: (time, n, its charge).
    finishes: list[tuple[float, int, PlacementCharge]] = []
    charges: dict[int, PlacementCharge] = {}  # by id(request)
    hit_tokens = prompt_tokens = 0
    ttfts: list[float] = []
    dispatched = dict.fromkeys(sims, 0)

    def advance(until: float) -> None:
        nonlocal hit_tokens, prompt_tokens
        for sim in sims.values():
            while sim.queue and max(sim.free_at, sim.queue[0].arrival) <= until:
                request = sim.queue.popleft()
                start = max(sim.free_at, request.arrival)
                cached_tokens = sim.cache.cached_prefix(request.block_hashes) * cfg.block_size
                events = sim.cache.insert(request.block_hashes)
                sim.free_at = start + (request.num_tokens - cached_tokens) / cfg.prefill_tokens_per_s
                hit_tokens += cached_tokens
                prompt_tokens += request.num_tokens
                ttfts.append(sim.free_at - request.arrival)
                heapq.heappush(in_flight_events, (sim.free_at + cfg.event_lag_s, len(ttfts), sim.instance_id, events))
                heapq.heappush(finishes, (sim.free_at, len(ttfts), charges.pop(id(request))))
        while finishes and finishes[0][0] <= until:
            heapq.heappop(finishes)[2].release()
        while in_flight_events and in_flight_events[0][0] <= until:
            _, _, instance_id, events = heapq.heappop(in_flight_events)
            if index.apply_events(instance_id, events):
                index.apply_snapshot(instance_id, sims[instance_id].cache.seq, sims[instance_id].cache.blocks)

    next_heartbeat = 0.0
    for request in requests:
        now = request.arrival
        advance(now)
        if now >= next_heartbeat:
            for sim in sims.values():
                registry.heartbeat(sim.instance_id, InstanceLoad(
                    num_waiting_requests=len(sim.queue), num_total_blocks=cfg.cache_blocks,
                    num_queued_prefill_tokens=sim.queued_tokens(now, cfg.prefill_tokens_per_s, cfg.block_size),
                    kv_events_sequence=sim.cache.seq))
            next_heartbeat = now + cfg.heartbeat_interval_s
        chosen = policy.choose_prefill(request.block_hashes, registry.instances("prefill"))
        charges[id(request)] = ledger.charge(request.num_tokens, prefill=chosen,
                                             prompt_block_hashes=request.block_hashes)
        sims[chosen.instance_id].queue.append(request)
        dispatched[chosen.instance_id] += 1
    advance(float("inf"))
    return SimResult(policy_name, hit_tokens / prompt_tokens, sum(ttfts) / len(ttfts), dispatched)


def run_all(cfg: SimConfig, policies=("round_robin", "least_loaded", "prefix_aware", "oracle")) -> dict[str, SimResult]:
    requests = make_workload(cfg)
    return {name: simulate(name, cfg, requests) for name in policies}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench placement-sim", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=SimConfig.num_requests)
    parser.add_argument("--seed", type=int, default=SimConfig.seed)
    parser.add_argument("--cache-blocks", type=int, default=SimConfig.cache_blocks)
    args = parser.parse_args(argv)
    for order in ("rounds", "random"):
        cfg = SimConfig(num_requests=args.requests, seed=args.seed, cache_blocks=args.cache_blocks,
                        tenant_order=order)
        results = run_all(cfg)
        print(f"\n{cfg.num_tenants} tenants x {cfg.system_prompt_tokens}-token system prompt, tenant order "
              f"{order}; {cfg.num_prefill} prefill instances x {cfg.cache_blocks} cached blocks; "
              f"{cfg.num_requests} requests")
        print(f"{'policy':<14}{'hit rate':>10}{'mean TTFT':>12}  requests per instance")
        for r in results.values():
            print(f"{r.policy:<14}{r.hit_rate:>10.3f}{r.mean_ttft_s * 1000:>10.1f}ms  {r.requests_per_instance}")
        pa, rr, oracle = (results[n].hit_rate for n in ("prefix_aware", "round_robin", "oracle"))
        print(f"prefix_aware / round_robin = {pa / rr:.2f}x (target >= 2), "
              f"prefix_aware / oracle = {pa / oracle:.1%} (target >= 90%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

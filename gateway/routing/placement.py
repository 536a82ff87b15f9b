"""Placement policies: which prefill and which decode instance serve a request.

Every policy has the same two methods; `instances` are the registry's live
instances of one role (gateway.routing.registry.Instance, sorted by id), with effective
load = last heartbeat + what the gateway dispatched since. Each returns None only
when `instances` is empty (the gateway answers UNAVAILABLE).

prefix_aware scores prefill instance i by the prompt tokens it would still have
to compute before this prompt's KV is ready, a time-to-first-token proxy:

    cost_i = (B - c_i) * block_size + load_weight * Q_i

B: full blocks in the prompt; c_i: leading blocks of the prompt that i caches
(longest cached prefix, from the KV event index plus prompts just dispatched to i;
only a prefix is reusable since hashes are chained); Q_i: prompt tokens queued on i.
Lowest cost wins; ties go to fewer requests, then to fewer cached blocks, then to
the lower id. The cached-blocks tie-break matters when the pool is idle: a prompt
nobody caches would otherwise always land on the lowest id, which then holds every
tenant and evicts them in turn while its peers stay empty. A tenant's system prompt
thus sticks to the instance that cached it until that instance's queue grows by
more than the prefill it saves, and then spills over to the next.

After choosing, the gateway calls `record_prefill_dispatch` / `record_decode_dispatch`
so that the next request sees this one's load and (pending) cached blocks at once,
and `InstanceRegistry.record_finish` with what they charged once it sees the prefill
(first token) or the decode (end of stream) finish, so that the load goes away as soon.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from gateway.routing.kv_index import KvIndex
from gateway.routing.registry import Instance, InstanceRegistry

CachedPrefix = Callable[[str, Sequence[int]], int]  # (instance id, prompt hashes) -> blocks
CachedCount = Callable[[str], int]  # instance id -> blocks it caches


def decode_blocks_needed(num_prompt_tokens: int, block_size: int) -> int:
    # The prompt plus the first generated token.
    return num_prompt_tokens // block_size + 1


def choose_decode_by_load(num_prompt_tokens: int, instances: Sequence[Instance]) -> Instance | None:
    """Fewest requests among instances whose free KV holds the prompt, then most free
    blocks; if none can hold it, the one with the most free blocks (it may queue it)."""
    if not instances:
        return None
    fits = [i for i in instances
            if i.free_blocks >= decode_blocks_needed(num_prompt_tokens, i.spec.block_size)]
    if not fits:
        return max(instances, key=lambda i: i.free_blocks)
    return min(fits, key=lambda i: (i.num_requests, -i.free_blocks))


def record_prefill_dispatch(registry: InstanceRegistry, kv_index: KvIndex, instance: Instance,
                            prompt_block_hashes: Sequence[int], num_prompt_tokens: int) -> int:
    """Count the prompt against the instance; returns the prefill tokens charged, which
    the caller hands to registry.record_finish once the prefill is done."""
    cached = kv_index.cached_prefix_blocks(instance.instance_id, prompt_block_hashes)
    prefill_tokens = num_prompt_tokens - cached * instance.spec.block_size
    registry.record_dispatch(instance.instance_id, prefill_tokens=prefill_tokens)
    kv_index.record_dispatch(instance.instance_id, prompt_block_hashes)
    return prefill_tokens


def record_decode_dispatch(registry: InstanceRegistry, instance: Instance, num_prompt_tokens: int) -> int:
    """Count the request against the instance; returns the KV blocks charged (for record_finish)."""
    blocks = decode_blocks_needed(num_prompt_tokens, instance.spec.block_size)
    registry.record_dispatch(instance.instance_id, blocks=blocks)
    return blocks


class PlacementPolicy:
    name = "base"

    def choose_prefill(self, prompt_block_hashes: Sequence[int],
                       instances: Sequence[Instance]) -> Instance | None:
        raise NotImplementedError

    def choose_decode(self, num_prompt_tokens: int, instances: Sequence[Instance]) -> Instance | None:
        return choose_decode_by_load(num_prompt_tokens, instances)


class RoundRobin(PlacementPolicy):
    """Each pool in turn, ignoring load and cache: the baseline."""

    name = "round_robin"

    def __init__(self) -> None:
        self._prefill_turn = itertools.count()
        self._decode_turn = itertools.count()

    def choose_prefill(self, prompt_block_hashes, instances):
        return instances[next(self._prefill_turn) % len(instances)] if instances else None

    def choose_decode(self, num_prompt_tokens, instances):
        return instances[next(self._decode_turn) % len(instances)] if instances else None


class LeastLoaded(PlacementPolicy):
    """Prefill: fewest queued prompt tokens; decode: see choose_decode_by_load."""

    name = "least_loaded"

    def choose_prefill(self, prompt_block_hashes, instances):
        return min(instances, key=lambda i: (i.queued_prefill_tokens, i.num_requests),
                   default=None)


class PrefixAware(PlacementPolicy):
    """Cached-prefix overlap against queued prefill tokens (formula in the module doc)."""

    name = "prefix_aware"

    def __init__(self, cached_prefix: KvIndex | CachedPrefix, load_weight: float = 1.0,
                 cached_count: CachedCount | None = None):
        if isinstance(cached_prefix, KvIndex):
            cached_count = cached_count or cached_prefix.num_cached_blocks
            cached_prefix = cached_prefix.cached_prefix_blocks
        self._cached_prefix = cached_prefix
        self._cached_count = cached_count or (lambda _instance_id: 0)
        self.load_weight = load_weight

    def prefill_cost(self, instance: Instance, prompt_block_hashes: Sequence[int]) -> float:
        cached = self._cached_prefix(instance.instance_id, prompt_block_hashes)
        uncached_tokens = (len(prompt_block_hashes) - cached) * instance.spec.block_size
        return uncached_tokens + self.load_weight * instance.queued_prefill_tokens

    def choose_prefill(self, prompt_block_hashes, instances):
        return min(instances, default=None, key=lambda i: (
            self.prefill_cost(i, prompt_block_hashes), i.num_requests,
            self._cached_count(i.instance_id)))


class Oracle(PrefixAware):
    """For benchmarks: the most truly cached prefix wins, load only breaks ties.

    `cached_prefix` (and `cached_count`) are ground truth (e.g. a simulator's caches),
    not the event index, and load is ignored otherwise. Greedy, so not a strict bound.
    Like PrefixAware, the last tie-break is fewer cached blocks: in an idle pool a new
    prefix would otherwise always land on the lowest id.
    """

    name = "oracle"

    def choose_prefill(self, prompt_block_hashes, instances):
        return min(instances, default=None, key=lambda i: (
            -self._cached_prefix(i.instance_id, prompt_block_hashes),
            i.queued_prefill_tokens, i.num_requests, self._cached_count(i.instance_id)))


POLICIES = ("round_robin", "least_loaded", "prefix_aware")


def make_policy(name: str, kv_index: KvIndex | None = None, load_weight: float = 1.0) -> PlacementPolicy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_aware":
        if kv_index is None:
            raise ValueError("prefix_aware placement needs the KV event index")
        return PrefixAware(kv_index, load_weight)
    raise ValueError(f"unknown placement policy {name!r}; choose from {', '.join(POLICIES)}")

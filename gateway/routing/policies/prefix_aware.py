"""Prefill by cached prefix against queued work; decode by load (base).

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

Q_i and c_i see a request as soon as it is dispatched, because the load ledger
charges it and records its blocks as pending in the KV index at once, and Q_i
drops as soon as the gateway sees its first token (gateway.routing.load_ledger).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.routing.kv_index import KvIndex
from gateway.routing.policies.base import PlacementPolicy, holding
from gateway.routing.registry import Instance

CachedPrefix = Callable[[str, Sequence[int]], int]  # (instance id, prompt hashes) -> blocks
# A decode instance that prefills locally: the weight of one KV token its running requests
# hold against one prompt token it would compute. Dynamo weighs them alike (its
# overlap_score_weight 1), which on a CPU engine moved conversations off the instance that
# caches them whenever the other ran one request fewer; a running request adds about one
# token of compute to each step, not its whole KV (docs/benchmarks.md, "Multi-turn chat").
DEFAULT_KV_LOAD_WEIGHT = 0.1
CachedCount = Callable[[str], int]  # instance id -> blocks it caches


class PrefixAware(PlacementPolicy):
    name = "prefix_aware"
    places_by_cached_prefix = True

    def __init__(self, cached_prefix: KvIndex | CachedPrefix, load_weight: float = 1.0,
                 cached_count: CachedCount | None = None, kv_load_weight: float = DEFAULT_KV_LOAD_WEIGHT):
        if isinstance(cached_prefix, KvIndex):
            cached_count = cached_count or cached_prefix.num_cached_blocks
            cached_prefix = cached_prefix.cached_prefix_blocks
        self._cached_prefix = cached_prefix
        self._cached_count = cached_count or (lambda _instance_id: 0)
        self.load_weight = load_weight
        self.kv_load_weight = kv_load_weight

    def prefill_cost(self, instance: Instance, prompt_block_hashes: Sequence[int]) -> float:
        num_cached_blocks = self._cached_prefix(instance.instance_id, prompt_block_hashes)
        num_uncached_tokens = (len(prompt_block_hashes) - num_cached_blocks) * instance.spec.block_size
        return num_uncached_tokens + self.load_weight * instance.queued_prefill_tokens

    def choose_prefill(self, prompt_block_hashes, instances):
        return min(instances, default=None, key=lambda i: (
            self.prefill_cost(i, prompt_block_hashes), i.num_requests,
            self._cached_count(i.instance_id)))

    def choose_decode_for_local_prefill(self, prompt_block_hashes, num_prompt_tokens, instances):
        """A decode instance that prefills the prompt itself: the prefill cost above plus the KV
        its running requests hold, in tokens, times kv_load_weight (Dynamo's KV router: the
        blocks a request would prefill against the blocks active there), so a cached prefix
        draws its requests only while the instance holding it is not already busier by more
        than the prefill it saves. Only among instances with room for the prompt's KV, where
        any has (a full one would queue or preempt for it)."""
        instances = holding(num_prompt_tokens, instances) or instances

        def cost(i: Instance) -> float:
            num_active_tokens = (i.spec.num_total_blocks - i.free_blocks) * i.spec.block_size
            return self.prefill_cost(i, prompt_block_hashes) + self.kv_load_weight * num_active_tokens
        return min(instances, default=None, key=lambda i: (cost(i), i.num_requests, self._cached_count(i.instance_id)))

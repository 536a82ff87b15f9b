"""The oracle placement policy, for benchmarks only: the gateway cannot know the truth.

The most truly cached prefix wins and load only breaks ties. `cached_prefix` (and
`cached_count`) are ground truth (e.g. the placement simulation's caches), not the
KV event index. Greedy, so not a strict bound. Like PrefixAware, the last tie-break
is fewer cached blocks: in an idle pool a new prefix would otherwise always land on
the lowest id.
"""
from __future__ import annotations

from gateway.routing.policies.prefix_aware import PrefixAware


class Oracle(PrefixAware):
    name = "oracle"

    def choose_prefill(self, prompt_block_hashes, instances):
        return min(instances, default=None, key=lambda i: (
            -self._cached_prefix(i.instance_id, prompt_block_hashes),
            i.queued_prefill_tokens, i.num_requests, self._cached_count(i.instance_id)))

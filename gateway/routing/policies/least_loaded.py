"""Prefill: fewest queued prompt tokens, then fewest requests; decode: by load (base)."""
from __future__ import annotations

from gateway.routing.policies.base import PlacementPolicy


class LeastLoaded(PlacementPolicy):
    name = "least_loaded"

    def choose_prefill(self, prompt_block_hashes, instances):
        return min(instances, key=lambda i: (i.queued_prefill_tokens, i.num_requests),
                   default=None)

"""Each pool in turn, ignoring load and cache: the baseline."""
from __future__ import annotations

import itertools

from gateway.routing.policies.base import PlacementPolicy


class RoundRobin(PlacementPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._prefill_turn = itertools.count()
        self._decode_turn = itertools.count()

    def choose_prefill(self, prompt_block_hashes, instances):
        return instances[next(self._prefill_turn) % len(instances)] if instances else None

    def choose_decode(self, num_prompt_tokens, instances):
        return instances[next(self._decode_turn) % len(instances)] if instances else None

"""The placement policy interface: which prefill and which decode instance serve a request.

`instances` are the registry's live instances of one role (sorted by id), with
effective load (gateway.routing.load_estimate). Each method returns None only when
`instances` is empty (the gateway answers UNAVAILABLE). Policies only choose; the
dispatcher charges the choice to the load ledger, so the next request sees it.
"""
from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.load_ledger import decode_blocks_needed
from gateway.routing.registry import Instance


def holding(num_prompt_tokens: int, instances: Sequence[Instance]) -> list[Instance]:
    """The instances whose free KV blocks hold the prompt and its first token."""
    return [i for i in instances if i.free_blocks >= decode_blocks_needed(num_prompt_tokens, i.spec.block_size)]


def choose_decode_by_load(num_prompt_tokens: int, instances: Sequence[Instance]) -> Instance | None:
    """Fewest requests among instances whose free KV holds the prompt, then most free
    blocks; if none can hold it, the one with the most free blocks (it may queue it)."""
    if not instances:
        return None
    fits = holding(num_prompt_tokens, instances)
    if not fits:
        return max(instances, key=lambda i: i.free_blocks)
    return min(fits, key=lambda i: (i.num_requests, -i.free_blocks))


class PlacementPolicy:
    name = "base"
    # Whether choose_decode_for_local_prefill reads the prompt's block hashes (else it gets none).
    places_by_cached_prefix = False

    def choose_prefill(self, prompt_block_hashes: Sequence[int],
                       instances: Sequence[Instance]) -> Instance | None:
        raise NotImplementedError

    def choose_decode(self, num_prompt_tokens: int, instances: Sequence[Instance]) -> Instance | None:
        return choose_decode_by_load(num_prompt_tokens, instances)

    def choose_decode_for_local_prefill(self, prompt_block_hashes: Sequence[int], num_prompt_tokens: int,
                                        instances: Sequence[Instance]) -> Instance | None:
        """The decode instance for a prompt it will prefill itself (no prefill instance used)."""
        return self.choose_decode(num_prompt_tokens, instances)

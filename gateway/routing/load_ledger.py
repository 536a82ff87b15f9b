"""What the gateway charges an instance when it places a request there, and takes
back once it sees that work finish.

`LoadLedger.charge` counts a placement against its prefill instance (the prompt
tokens it still has to compute, net of the prefix the KV index says it caches)
and its decode instance (the KV blocks the prompt and first token take), and
returns a `PlacementCharge`. A decode instance that prefills the prompt itself is
charged those prompt tokens too: a heartbeat it sends before its prefill ends
counts them, and without the charge to take off at the first token they would
stay on the gateway's estimate after the request, until the next heartbeat. The
dispatcher releases the prefill part when the request's first token arrives (the
prefill is done) and the rest when the stream ends; each release undoes exactly
what was charged, at most once. The same charge records the prompt's blocks as
pending in the KV index, which keeps them (and expires them) itself: they
describe the cache, not a load to give back.
How charges and heartbeats combine: gateway.routing.load_estimate.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.routing.kv_index import KvIndex
from gateway.routing.load_estimate import LoadDelta
from gateway.routing.registry import Instance


def decode_blocks_needed(num_prompt_tokens: int, block_size: int) -> int:
    # The prompt plus the first generated token.
    return num_prompt_tokens // block_size + 1


@dataclass
class InstanceCharge:
    instance: Instance  # the registered object: a restarted instance with the same id is not touched
    delta: LoadDelta
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.instance.estimate.add(-self.delta)


@dataclass
class PlacementCharge:
    # The prompt tokens to compute, on the prefill instance or on a decode instance that
    # prefills locally (its request is then counted once, in `decode`); None: not charged.
    prefill: InstanceCharge | None
    decode: InstanceCharge | None

    @property
    def num_prefill_tokens(self) -> int:
        return self.prefill.delta.num_prefill_tokens if self.prefill else 0

    def release_prefill(self) -> None:
        if self.prefill:
            self.prefill.release()

    def release(self) -> None:
        for charge in (self.prefill, self.decode):
            if charge:
                charge.release()


class LoadLedger:
    def __init__(self, kv_index: KvIndex) -> None:
        self.kv_index = kv_index

    def charge(self, num_prompt_tokens: int, prefill: Instance | None = None,
               prompt_block_hashes: Sequence[int] = (), decode: Instance | None = None,
               local_prefill: bool = False) -> PlacementCharge:
        """Count one request against the instances placed for it; `prompt_block_hashes`
        are the prompt's, at the deployment's block size. local_prefill: the decode instance
        computes the prompt itself (no prefill instance)."""
        if local_prefill and decode is not None:
            # Its request counts once, in the decode part.
            prompt = self._charge_prefill(decode, prompt_block_hashes, num_prompt_tokens, num_requests=0)
            return PlacementCharge(prompt, self._charge_decode(decode, num_prompt_tokens))
        return PlacementCharge(
            self._charge_prefill(prefill, prompt_block_hashes, num_prompt_tokens) if prefill else None,
            self._charge_decode(decode, num_prompt_tokens) if decode else None)

    def _charge_prefill(self, instance: Instance, prompt_block_hashes: Sequence[int],
                        num_prompt_tokens: int, num_requests: int = 1) -> InstanceCharge:
        num_cached_blocks = self.kv_index.cached_prefix_blocks(instance.instance_id, prompt_block_hashes)
        num_prefill_tokens = num_prompt_tokens - num_cached_blocks * instance.spec.block_size
        self.kv_index.record_dispatch(instance.instance_id, prompt_block_hashes)
        return self._charge(instance, LoadDelta(num_requests=num_requests, num_prefill_tokens=num_prefill_tokens))

    def _charge_decode(self, instance: Instance, num_prompt_tokens: int) -> InstanceCharge:
        num_blocks = decode_blocks_needed(num_prompt_tokens, instance.spec.block_size)
        return self._charge(instance, LoadDelta(num_requests=1, num_blocks=num_blocks))

    @staticmethod
    def _charge(instance: Instance, delta: LoadDelta) -> InstanceCharge:
        instance.estimate.add(delta)
        return InstanceCharge(instance, delta)

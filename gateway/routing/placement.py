"""Where one request runs: a decode instance, and a prefill instance or none.

Whether a request is prefilled on a prefill instance or locally by its decode
instance is decided by `choose_remote_prefill` alone: remotely, on the instance
the policy chooses among those alive whose queue has room; otherwise locally, and
the decode instance gets no prefill address, and is itself chosen by the policy's
`choose_decode_for_local_prefill`: prefix_aware weighs the prompt blocks it caches (its
KV events) against its load. The queue limit is conditional
disaggregation by load (Dynamo's max prefill queue size): once every prefill
instance already has max_prefill_queue_tokens prompt tokens to compute, the decode
instance takes the prompt instead of queueing it behind them (its streams pause
for that step); the operator picks the limit, as the wait they accept.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.engine.block_hash import compute_block_hashes, root_parent_hash
from gateway.routing.policies import PlacementPolicy
from gateway.routing.registry import Instance


@dataclass(frozen=True)
class Placement:
    decode: Instance
    prefill: Instance | None  # None: the decode instance prefills locally
    # The prompt's, at the deployment's block size; for a local prefill only where the policy reads them.
    prompt_block_hashes: Sequence[int] = ()

    @property
    def prefill_address(self) -> str:
        return self.prefill.spec.grpc_address if self.prefill else ""

    @property
    def prefill_instance_id(self) -> str:
        return self.prefill.instance_id if self.prefill else ""


def serving(instances: Sequence[Instance], lora_name: str | None) -> list[Instance]:
    """The instances that can run a request of this LoRA adapter (None: the base model, all)."""
    return list(instances) if lora_name is None else [i for i in instances if lora_name in i.spec.lora_names]


def has_prefill_room(prefill: Instance, max_prefill_queue_tokens: int) -> bool:
    """Whether a prefill instance takes another prompt under the queue limit (0: no limit)."""
    return max_prefill_queue_tokens <= 0 or prefill.queued_prefill_tokens < max_prefill_queue_tokens


def choose_remote_prefill(policy: PlacementPolicy, prefills: Sequence[Instance], prompt_token_ids: Sequence[int],
                          cache_salt: str | None = None,
                          lora_name: str | None = None, max_prefill_queue_tokens: int = 0
                          ) -> tuple[Instance | None, Sequence[int]]:
    """The prefill instance for a prompt and the prompt's block hashes at its block
    size (from its cache_salt's and LoRA adapter's root, as the engines hash them), or
    (None, ()) when no prefill instance is alive, or (max_prefill_queue_tokens > 0) when
    each has that many prompt tokens or more still to compute (this prompt not counted,
    so a long prompt still goes to an idle one): the decode instance prefills locally."""
    prefills = [i for i in prefills if has_prefill_room(i, max_prefill_queue_tokens)]
    if not prefills:
        return None, ()
    prompt_block_hashes = prompt_hashes(prompt_token_ids, prefills[0], cache_salt, lora_name)
    return policy.choose_prefill(prompt_block_hashes, prefills), prompt_block_hashes


def prompt_hashes(prompt_token_ids: Sequence[int], instance: Instance, cache_salt: str | None,
                  lora_name: str | None) -> list[int]:
    """The prompt's full blocks' chained hashes as the engines compute them (from the cache
    salt's and LoRA adapter's root); every instance has the deployment's block size (the
    registry refuses others)."""
    return compute_block_hashes(prompt_token_ids, instance.spec.block_size, root_parent_hash(cache_salt, lora_name))

"""Placing an embedding and calling Embed where it was placed.

An embedding is a prompt computed without sampling, so it goes where prompts are
computed: a prefill instance the policy chooses (prefix-aware: a cached head of the
prompt is not computed again, and the prompt's blocks stay cached for later requests),
charged to the load ledger like a prefill; with no prefill instance alive, or (under the
gateway's --max-prefill-queue-tokens, as generation's prompts) each with a full queue, a
decode instance chosen by load (it computes the prompt itself). A call that fails with
UNAVAILABLE (the instance went away) is retried on another instance, never twice on one.
"""
from __future__ import annotations

import logging

import grpc

from common.service.embedding_api import EmbedJob
from common.service.embedding_client import EmbeddingClient
from common.service.errors import ServiceError
from common.service.metrics import GatewayMetrics
from gateway.routing.instance_channels import InstanceChannels
from gateway.routing.load_ledger import LoadLedger, PlacementCharge
from gateway.routing.placement import choose_remote_prefill, has_prefill_room, serving
from gateway.routing.policies import PlacementPolicy
from gateway.routing.registry import Instance, InstanceRegistry
from gateway.types import PreparedEmbedding

logger = logging.getLogger(__name__)

# Statuses the caller gets as the instance gave them; others of an instance that is gone
# read UNAVAILABLE (retried elsewhere), anything else INTERNAL.
_PASSED_ON = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ALREADY_EXISTS}
_INSTANCE_GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}


class EmbeddingDispatcher:
    def __init__(self, registry: InstanceRegistry, ledger: LoadLedger, policy: PlacementPolicy,
                 metrics: GatewayMetrics, max_prefill_queue_tokens: int = 0):
        self.registry = registry
        self.ledger = ledger
        self.policy = policy
        self.metrics = metrics
        self.max_prefill_queue_tokens = max_prefill_queue_tokens  # > 0: a full prefill queue sends it to decode
        self._channels = InstanceChannels(registry, EmbeddingClient, roles=["prefill", "decode"])

    def uses_prefill_pool(self) -> bool:
        """Whether the next embedding goes to a prefill instance (else a decode instance), as
        place would decide it now."""
        prefills = self.registry.instances("prefill")
        if not prefills or not self.registry.instances("decode"):
            return bool(prefills)
        return any(has_prefill_room(i, self.max_prefill_queue_tokens) for i in prefills)

    async def embed(self, request: PreparedEmbedding, timeout_s: float | None = None,
                    trace_headers: dict[str, str] | None = None):
        """(EmbedResult, the instance that computed it); raises ServiceError. trace_headers: the
        Embed call's trace context (the gateway's span)."""
        job = EmbedJob(request.request_id, request.prompt_token_ids, request.pooling, request.priority,
                       request.cache_salt, request.lora_name)
        tried: set[str] = set()
        while True:
            instance, charge = self.place(request, tried)
            tried.add(instance.instance_id)
            try:
                with self._channels.calling(instance) as client:
                    result = await client.embed(job, timeout_s, trace_headers)
                result.instance_id = result.instance_id or instance.instance_id
                return result
            except grpc.aio.AioRpcError as e:
                error = self._error(instance, e)
                if error.code != grpc.StatusCode.UNAVAILABLE or not self._candidates(tried, request.lora_name)[1]:
                    raise error from None
                logger.warning("%s; retrying embedding %s elsewhere", error.message, request.request_id)
            finally:
                charge.release()

    def _candidates(self, tried: set[str], lora_name: str | None) -> tuple[str, list[Instance]]:
        for role in ("prefill", "decode"):
            live = [i for i in serving(self.registry.instances(role), lora_name) if i.instance_id not in tried]
            if live:
                return role, live
        return "", []

    def place(self, request: PreparedEmbedding, tried: set[str]) -> tuple[Instance, PlacementCharge]:
        """The instance to compute the embedding on, not one of `tried`, and its charge on the
        load ledger (release it once the call ends); ServiceError UNAVAILABLE where none is."""
        role, live = self._candidates(tried, request.lora_name)
        if role == "prefill":
            instance, block_hashes = choose_remote_prefill(self.policy, live, request.prompt_token_ids,
                                                           request.cache_salt, request.lora_name,
                                                           self.max_prefill_queue_tokens)
            decodes = [] if instance is not None else [
                i for i in serving(self.registry.instances("decode"), request.lora_name) if i.instance_id not in tried]
            if instance is None and not decodes:  # every queue is full and nowhere else to go: queue anyway
                instance, block_hashes = choose_remote_prefill(self.policy, live, request.prompt_token_ids,
                                                               request.cache_salt, request.lora_name)
            if instance is not None:
                self.metrics.placed("prefill", "placed")
                return instance, self.ledger.charge(len(request.prompt_token_ids), prefill=instance,
                                                    prompt_block_hashes=block_hashes)
            self.metrics.placed("prefill", "queue_full")
            role, live = "decode", decodes
        if role == "decode":
            instance = self.policy.choose_decode(len(request.prompt_token_ids), live)
            self.metrics.placed("decode", "placed")
            return instance, self.ledger.charge(len(request.prompt_token_ids), decode=instance)
        what = "is alive" if request.lora_name is None else f"serves LoRA adapter {request.lora_name!r}"
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"no prefill or decode instance {what} to compute the "
                                                        f"embedding; start one and retry")

    @staticmethod
    def _error(instance: Instance, e: grpc.aio.AioRpcError) -> ServiceError:
        code = e.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return ServiceError(code, e.details())  # the request's own fault: the engine's words
        if code in _INSTANCE_GONE:
            code = grpc.StatusCode.UNAVAILABLE
        elif code not in _PASSED_ON:
            code = grpc.StatusCode.INTERNAL
        return ServiceError(code, f"{instance.role} instance {instance.instance_id} failed: {e.details()}")

    async def close(self) -> None:
        await self._channels.close()

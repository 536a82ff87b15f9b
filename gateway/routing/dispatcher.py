"""Placing a prepared request and streaming its tokens back as text.

One request: choose a decode instance and a prefill instance or local prefill
(gateway.routing.placement), charge both to the load ledger at once (the prefill
part is released at the first token, the rest when the stream ends), call Decode
on the decode instance with the prefill address, and turn its token stream into
text deltas (incremental detokenization with stop strings). When a
stop string matches, the Decode call is cancelled, which aborts the request on
the decode instance and its prefill. Leaving the iterator early (the client went
away, its deadline passed) cancels the Decode call the same way.

A decode call that fails with UNAVAILABLE (or CANCELLED/ABORTED) makes the
gateway probe the instance at once (Stats) and drop it from the registry when the
probe fails too, so later requests avoid it without waiting for its heartbeats to
time out; an instance that is in fact alive re-registers on its next heartbeat.
A request that failed so before the client received anything is retried on another
decode instance (never twice on one), as is one an instance refused with
RESOURCE_EXHAUSTED before sending anything (no room for its KV: the gateway's load
estimate was stale); a stream that ends without a status before the request finished
counts as the instance lost. One that had streamed tokens is migrated, up
to migration_limit times (Dynamo's): another decode instance prefills the prompt and
the output so far (DecodeRequest.resumed_token_ids) and continues after it, into the
same text assembler, so the client's stream goes on as if nothing happened; past the
limit, or with no other instance, it ends with UNAVAILABLE. The same holds for the
calls still running on an instance the registry drops as dead (missed heartbeats, a
failed probe): gateway.routing.inflight_calls ends them at once, so no request
outlives its instance.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from common.service.errors import ServiceError
from common.service.logging_setup import log_event
from common.service.metrics import GatewayMetrics, RequestTimer
from decode_service.api import DecodeJob
from decode_service.client import DecodeClient
from gateway.routing.instance_channels import InstanceChannels
from gateway.routing.inflight_calls import InFlightCalls
from gateway.routing.kv_index import KvIndex
from gateway.routing.load_ledger import LoadLedger, PlacementCharge
from gateway.routing.placement import Placement, choose_remote_prefill, prompt_hashes, serving
from gateway.routing.policies import PlacementPolicy
from gateway.routing.registry import Instance, InstanceRegistry
from gateway.text_assembler import TextAssembler
from gateway.types import GenerationDelta, PreparedRequest

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0
# Moves to another decode instance one request may make after tokens were streamed (--migration-limit).
DEFAULT_MIGRATION_LIMIT = 3
# Decode statuses the client gets as they are (they describe its request or the
# system's state). CANCELLED that the gateway did not ask for (the instance shut
# down) and ABORTED (its KV transfer failed) are transient: UNAVAILABLE, so that
# clients retry. Anything else is a fault of the instance: INTERNAL.
_PASSED_ON = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
              grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION}
_INSTANCE_GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}


class InstanceLost(ServiceError):
    """The registry dropped the decode instance as dead while the call ran there."""

    def __init__(self, instance_id: str, reason: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE,
                         f"decode instance {instance_id} was dropped ({reason}: it stopped answering) "
                         f"while serving this request; retry")


class StreamCutShort(ServiceError):
    """The decode instance ended its stream without a status before the request finished:
    whatever cut it (a proxy, a restart between messages), the request is treated as lost there."""

    def __init__(self, instance_id: str, request_id: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE, f"decode instance {instance_id} ended the stream of "
                                                      f"request {request_id} before it finished")


class Dispatcher:
    def __init__(self, registry: InstanceRegistry, kv_index: KvIndex, policy: PlacementPolicy,
                 tokenizer, eos_token_ids: tuple[int, ...], metrics: GatewayMetrics | None = None,
                 max_prefill_queue_tokens: int = 0, migration_limit: int = DEFAULT_MIGRATION_LIMIT):
        self.registry = registry
        # Times one request may move to another decode instance after tokens were streamed.
        self.migration_limit = migration_limit
        # > 0: conditional disaggregation by load (gateway.routing.placement)
        self.max_prefill_queue_tokens = max_prefill_queue_tokens
        self.metrics = metrics or GatewayMetrics(policy.name)
        self.ledger = LoadLedger(kv_index)
        self.policy = policy
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._channels = InstanceChannels(registry, DecodeClient, roles=["decode"])
        self._calls = InFlightCalls(registry)
        self._probes: set[asyncio.Task] = set()

    async def stream(self, request: PreparedRequest, timeout_s: float | None = None,
                     timer: RequestTimer | None = None, on_prefill_done: Callable[[], None] | None = None
                     ) -> AsyncIterator[GenerationDelta]:
        """Deltas of one request, the last with finish_reason set; raises ServiceError.
        `timer` is told of every token as it arrives (TTFT and ITL at the gateway);
        `on_prefill_done` is called at the first token (the gateway's prefill admission
        gives the request's slot back then)."""
        tried: set[str] = set()
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        text = TextAssembler(self.tokenizer, request, self.eos_token_ids)
        num_migrations, streamed_any = 0, False
        while True:
            resuming = bool(text.output_token_ids)
            placement = self._place(request, exclude=tried, remote_prefill=not resuming)
            decode = placement.decode
            tried.add(decode.instance_id)
            if placement.prefill is None and on_prefill_done is not None:
                on_prefill_done()  # prefilled on the decode instance: no prefill instance is used
            resumed_token_ids = text.migrate() if resuming else []
            charge = self.ledger.charge(len(request.prompt_token_ids) + len(resumed_token_ids),
                                        prefill=placement.prefill,
                                        prompt_block_hashes=placement.prompt_block_hashes, decode=decode,
                                        local_prefill=placement.prefill is None)
            left_s = None if deadline is None else max(0.0, deadline - loop.time())
            num_messages_before = text.num_messages
            try:
                async for delta in self._stream_on(placement, charge, request, text, resumed_token_ids, left_s,
                                                   timer, on_prefill_done):
                    streamed_any = True
                    yield delta
                return
            except (grpc.aio.AioRpcError, InstanceLost, StreamCutShort) as e:
                error = e if isinstance(e, ServiceError) else self._decode_error(decode, e)
                others = self._live_decodes(tried, request.lora_name)
                if (error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and others
                        and text.num_messages == num_messages_before):
                    # Refused before it sent anything (no room for the prompt's KV, its LoRA slots
                    # busy): the gateway's estimate was stale; another instance may have room.
                    logger.warning("%s; trying request %s on another decode instance", error.message,
                                   request.request_id)
                    continue
                if error.code != grpc.StatusCode.UNAVAILABLE or not others:
                    raise error from None
                if not streamed_any:
                    # The client saw nothing: start over, placed afresh (a remote prefill again).
                    text = TextAssembler(self.tokenizer, request, self.eos_token_ids)
                    logger.warning("%s; retrying request %s elsewhere", error.message, request.request_id)
                    continue
                if num_migrations >= self.migration_limit:
                    raise error from None
                num_migrations += 1
                self.metrics.migrated(timer)
                log_event(logger, "request migrating", reason=error.message, num_migrations=num_migrations,
                          output_tokens=len(text.output_token_ids))
            finally:
                charge.release()  # whatever is left, a prefill that never got to a first token too

    def _live_decodes(self, exclude: set[str], lora_name: str | None) -> list[Instance]:
        return [i for i in serving(self.registry.instances("decode"), lora_name) if i.instance_id not in exclude]

    def _place(self, request: PreparedRequest, exclude: set[str], remote_prefill: bool = True) -> Placement:
        """A prefill instance (placement.choose_remote_prefill), then the decode instance: by load
        where a prefill instance feeds it, else by the policy's choice for a prompt it prefills
        itself (prefix_aware: its cached prefix against its load). remote_prefill False: the
        decode instance prefills (a migrated request's output so far)."""
        decodes = self._live_decodes(exclude, request.lora_name)
        if not decodes:
            self.metrics.placed("decode", "none")
            what = "is alive" if request.lora_name is None else f"serves LoRA adapter {request.lora_name!r}"
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"no decode instance {what}; start one (pdserve decode --gateway ADDR) and retry")
        prefill, prompt_block_hashes = None, ()
        if remote_prefill:
            prefills = serving(self.registry.instances("prefill"), request.lora_name)
            prefill, prompt_block_hashes = choose_remote_prefill(
                self.policy, prefills, request.prompt_token_ids, request.cache_salt, request.lora_name,
                self.max_prefill_queue_tokens)
            self.metrics.placed("prefill", "placed" if prefill is not None else "queue_full" if prefills else "none")
        num_prompt_tokens = len(request.prompt_token_ids)
        if prefill is not None:
            decode = self.policy.choose_decode(num_prompt_tokens, decodes)
        else:
            # Hashed only for a policy that reads them (~0.2 ms for 2,048 tokens on the event loop).
            local_hashes = (prompt_hashes(request.prompt_token_ids, decodes[0], request.cache_salt, request.lora_name)
                            if self.policy.places_by_cached_prefix else ())
            decode = self.policy.choose_decode_for_local_prefill(local_hashes, num_prompt_tokens, decodes)
            # The ledger records them as pending there: the next request of the same prefix
            # follows it before its KV events arrive.
            prompt_block_hashes = local_hashes
        self.metrics.placed("decode", "placed")
        return Placement(decode, prefill, prompt_block_hashes)

    async def _stream_on(self, placement: Placement, charge: PlacementCharge, request: PreparedRequest,
                         text: TextAssembler, resumed_token_ids: list[int], timeout_s: float | None,
                         timer: RequestTimer | None, on_prefill_done: Callable[[], None] | None
                         ) -> AsyncIterator[GenerationDelta]:
        decode = placement.decode
        logger.debug("placed on decode %s, prefill %s", decode.instance_id,
                     placement.prefill_instance_id or "local")
        text.decode_instance_id = decode.instance_id
        # Resumed: the prompt's logprobs went out with the first instance's first message.
        sampling = (dataclasses.replace(request.sampling, prompt_logprobs=None) if resumed_token_ids
                    else request.sampling)
        with self._channels.calling(decode) as client:
            job = DecodeJob(request.request_id, request.prompt_token_ids, sampling, request.priority,
                            placement.prefill_address, placement.prefill_instance_id, request.cache_salt,
                            request.lora_name, resumed_token_ids, trace_headers=request.trace_headers)
            stream = client.decode(job, timeout_s)
            with self._calls.tracking(decode, stream) as call:
                try:
                    async for output in stream:
                        charge.release_prefill()  # a token means the prefill is done
                        if on_prefill_done is not None:
                            on_prefill_done()
                        if timer is not None:
                            timer.tokens(len(output.token_ids))
                        delta = text.apply(output)
                        if delta.finish_reason is not None:
                            yield delta
                            return
                        if delta.text or delta.token_ids:
                            yield delta
                    raise StreamCutShort(decode.instance_id, request.request_id)
                except asyncio.CancelledError:
                    # Cancelled by InFlightCalls (its instance was dropped), not by our caller.
                    if call.lost_reason is not None and not asyncio.current_task().cancelling():
                        raise InstanceLost(decode.instance_id, call.lost_reason) from None
                    raise
                finally:
                    stream.cancel()  # no-op when finished; otherwise aborts decode and prefill

    def _decode_error(self, decode: Instance, e: grpc.aio.AioRpcError) -> ServiceError:
        code = e.code()
        if code in _INSTANCE_GONE:
            task = asyncio.get_running_loop().create_task(self._probe(decode))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)
            code = grpc.StatusCode.UNAVAILABLE
        elif code == grpc.StatusCode.INVALID_ARGUMENT:
            # The request's own fault (a schema the grammar compiler rejects, say), which any
            # instance would refuse alike: the engine's words, without the instance that said them.
            return ServiceError(code, e.details())
        elif code not in _PASSED_ON:
            code = grpc.StatusCode.INTERNAL
        return ServiceError(code, f"decode instance {decode.instance_id} failed: {e.details()}")

    async def _probe(self, instance: Instance) -> None:
        if self.registry.get(instance.instance_id) is not instance:
            return  # already replaced or gone
        try:
            await self._channels.client(instance).load(timeout_s=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if self.registry.get(instance.instance_id) is instance:
                logger.warning("decode instance %s does not answer (%s); no longer placing on it",
                               instance.instance_id, e.code().name)
                self.registry.drop_unresponsive(instance.instance_id)

    async def close(self) -> None:
        for task in list(self._probes):
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
        await self._channels.close()

"""The gateway without gRPC serving: validation, in-flight ids, placement, draining.

`Gateway.stream` is what GenerateStream runs and `Gateway.generate` what Generate
runs; both take a GenerateInput and raise ServiceError with the status to answer.
`Gateway.embed` is what Embed runs (an EmbedInput).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from common.service.errors import ServiceError
from common.service.logging_setup import log_event, request_context
from common.service.metrics import GatewayMetrics
from common.service.tracing import NO_TRACING, Tracing
from gateway.admission import PoolAdmission, Slot
from gateway.lora_adapters import LoRAAdapters
from gateway.readiness import Readiness
from gateway.request_ids import RequestIdInFlight, RequestIds
from gateway.routing.dispatcher import DEFAULT_MIGRATION_LIMIT, Dispatcher
from gateway.routing.embedding_dispatcher import EmbeddingDispatcher
from gateway.routing.kv_event_subscriber import KvEventSubscriber, grpc_resync
from gateway.routing.kv_index import KvIndex
from gateway.routing.policies import DEFAULT_KV_LOAD_WEIGHT, make_policy
from gateway.routing.registry import InstanceRegistry
from gateway.types import (DeploymentInfo, EmbeddingResult, EmbedInput, GenerateInput, GenerationDelta,
                           PreparedEmbedding, PreparedRequest, Usage)
from gateway.validation import ServedModel, prepare_embedding, prepare_request, prompt_chars, tokenize_prompt

logger = logging.getLogger(__name__)

# Prompts longer than this are tokenized on a worker thread (the Rust tokenizer
# releases the GIL) so that one big prompt does not stall every stream's tokens.
TOKENIZE_IN_THREAD_CHARS = 16_384
# Likewise for long chat conversations: the template renders every message, and the
# rendered text is longer than the messages' content (1024 messages: ~40 ms).
TOKENIZE_IN_THREAD_MESSAGES = 64
DEADLINE_SLACK_S = 0.01
# An instance still releasing a request id (see gateway.request_ids) is asked again after
# these waits, doubling, within the id's release window.
ID_RETRY_FIRST_BACKOFF_S = 0.005
ID_RETRY_MAX_BACKOFF_S = 0.1


async def _tokenizing(request: GenerateInput | EmbedInput, tokenize, *args):
    """tokenize(*args), off the event loop where request's prompt is long (many characters or
    chat messages) enough that tokenizing it would stall every stream the loop serves."""
    if prompt_chars(request) > TOKENIZE_IN_THREAD_CHARS or len(request.messages or ()) > TOKENIZE_IN_THREAD_MESSAGES:
        return await asyncio.to_thread(tokenize, *args)
    return tokenize(*args)


def _left(deadline: float | None) -> float | None:
    """Seconds until `deadline` (loop time); None: no deadline."""
    return None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())


class _Ending:
    """How a call ended, as the gRPC status name it is counted under: OK when the block ends
    normally, a ServiceError's code, DEADLINE_EXCEEDED when it was cancelled at its deadline
    (gRPC cancels the handler when the client's deadline passes; the slack: the two clocks are
    read at slightly different moments), CANCELLED when the caller went away before it, else
    INTERNAL. The deadline is loop time, from timeout_s at entry."""

    def __init__(self, timeout_s: float | None):
        self.status = "CANCELLED"  # unless it ends otherwise
        self.deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s

    def __enter__(self) -> "_Ending":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.status = "OK"
        elif issubclass(exc_type, ServiceError):
            self.status = exc.code.name
        elif issubclass(exc_type, (asyncio.CancelledError, GeneratorExit)):
            if self.deadline is not None and asyncio.get_running_loop().time() >= self.deadline - DEADLINE_SLACK_S:
                self.status = "DEADLINE_EXCEEDED"
        else:
            self.status = "INTERNAL"


@dataclass
class GatewaySettings:
    policy: str = "prefix_aware"
    block_size: int = 16  # must match the instances' (they are rejected otherwise)
    max_model_len: int | None = None  # caps what the instances register
    max_prompt_chars: int = 262_144
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    load_weight: float = 1.0  # prefix_aware: queued tokens vs cached tokens
    kv_load_weight: float = DEFAULT_KV_LOAD_WEIGHT  # prefix_aware, local prefills: running requests' KV tokens
    max_running_per_decode: int = 64  # admission: requests running per decode instance; <= 0: no limit
    max_running_per_prefill: int = 64  # admission: requests in their prefill per prefill instance; <= 0: no limit
    max_waiting_requests: int = 256  # admission, per pool: requests waiting for a slot before RESOURCE_EXHAUSTED
    # > 0: a prompt goes to a prefill instance only while one has fewer prompt tokens than this
    # still to compute, else its decode instance prefills it (gateway.routing.placement); 0: always remote
    max_prefill_queue_tokens: int = 0
    # Times a request whose decode instance is lost after it streamed tokens moves to another
    # one (gateway.routing.dispatcher); 0: it fails UNAVAILABLE instead
    migration_limit: int = DEFAULT_MIGRATION_LIMIT


class Gateway:
    def __init__(self, model: ServedModel, settings: GatewaySettings, tracing: Tracing = NO_TRACING):
        self.model = model
        self.settings = settings
        self.tracing = tracing  # a span per request (common.service.tracing)
        # Instances must serve the gateway's own model: its tokenizer makes their prompts.
        self.registry = InstanceRegistry(heartbeat_interval_s=settings.heartbeat_interval_s,
                                         heartbeat_timeout_s=settings.heartbeat_timeout_s,
                                         block_size=settings.block_size, model_name=model.name,
                                         max_model_len=settings.max_model_len or model.max_position_embeddings)
        self.kv_index = KvIndex()
        self.policy = make_policy(settings.policy, self.kv_index, settings.load_weight, settings.kv_load_weight)
        self.metrics = GatewayMetrics(self.policy.name)
        self.registry.subscribe(on_added=self._count_instances, on_removed=self._count_instances,
                                on_heartbeat=self._observe_heartbeat)
        self.metrics.watch_instances(self.registry.snapshot)
        self.dispatcher = Dispatcher(self.registry, self.kv_index, self.policy, model.tokenizer,
                                     model.tokenizer.eos_token_ids, self.metrics,
                                     settings.max_prefill_queue_tokens, settings.migration_limit)
        self.embeddings = EmbeddingDispatcher(self.registry, self.dispatcher.ledger, self.policy, self.metrics,
                                              settings.max_prefill_queue_tokens)
        self.decode_admission = PoolAdmission(self.registry, "decode", settings.max_running_per_decode,
                                              settings.max_waiting_requests)
        self.prefill_admission = PoolAdmission(self.registry, "prefill", settings.max_running_per_prefill,
                                               settings.max_waiting_requests)
        self._kv_events: KvEventSubscriber | None = None
        self._expiry: asyncio.Task | None = None
        self.request_ids = RequestIds()  # in flight here; the rule for reusing one
        self.readiness = Readiness(self.registry)
        self.lora_adapters = LoRAAdapters(self.registry, lambda: self.model.aliases | self._served_names())

    @property
    def draining(self) -> bool:
        return self.readiness.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.readiness.draining = value  # readiness follows at once

    async def start(self) -> None:
        self._kv_events = KvEventSubscriber(self.kv_index, grpc_resync(self.registry))
        self._kv_events.attach(self.registry)
        self._expiry = asyncio.create_task(self.registry.run_expiry())

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; wait up to timeout_s for those in flight to finish."""
        self.draining = True
        if self.request_ids:
            logger.info("draining: waiting for %d requests", len(self.request_ids))
            try:
                await asyncio.wait_for(self.request_ids.wait_idle(), timeout_s)
            except asyncio.TimeoutError:
                logger.warning("drain timed out with %d requests in flight", len(self.request_ids))

    async def close(self) -> None:
        self.tracing.shutdown()
        if self._expiry is not None:
            self._expiry.cancel()
        if self._kv_events is not None:
            await self._kv_events.close()
        await self.dispatcher.close()
        await self.embeddings.close()
        await self.lora_adapters.close()

    @property
    def max_model_len(self) -> int:
        """The smallest limit a decode instance registered, else the model's own."""
        registered = [i.spec.max_model_len for i in self.registry.instances("decode") if i.spec.max_model_len]
        limit = min(registered, default=self.model.max_position_embeddings)
        return min(limit, self.settings.max_model_len or limit)

    def deployment_info(self) -> DeploymentInfo:
        return DeploymentInfo(
            model_name=self.registry.model_name or self.model.name, max_model_len=self.max_model_len,
            vocab_size=self.model.tokenizer.vocab_size, block_size=self.registry.block_size,
            eos_token_ids=tuple(self.model.tokenizer.eos_token_ids),
            has_chat_template=self.model.has_chat_template,
            num_prefill_instances=len(self.registry.instances("prefill")),
            num_decode_instances=len(self.registry.instances("decode")),
            placement_policy=self.policy.name)

    async def prepare(self, request: GenerateInput) -> PreparedRequest:
        return await _tokenizing(request, prepare_request, request, self.model, self.max_model_len,
                                 self.settings.max_prompt_chars, self._served_names(),
                                 frozenset(self.registry.lora_names()))

    def _served_names(self) -> frozenset[str]:
        """Names a request's `model` may use beside the gateway's own: what the instances registered."""
        return frozenset([self.registry.model_name] if self.registry.model_name else [])

    async def tokenize(self, request: GenerateInput) -> list[int]:
        """request's prompt as token ids, as prepare() tokenizes it (the HTTP /tokenize)."""
        return await _tokenizing(request, tokenize_prompt, request, self.model, self.settings.max_prompt_chars)

    async def stream(self, request: GenerateInput, timeout_s: float | None = None
                     ) -> AsyncIterator[GenerationDelta]:
        # Every log line of this call carries the request id; the client's until the
        # request is prepared (which makes one when the client sent none).
        with request_context(request.request_id):
            timer = self.metrics.request_timer()
            span = self.tracing.start("generate", request.trace_headers)
            last = None
            ending = _Ending(timeout_s)
            try:
                with ending:
                    async for delta in self._stream(request, timeout_s, timer, Tracing.child_headers(span)):
                        last = delta
                        yield delta
            finally:
                status = ending.status
                duration_s = timer.finish(status)
                fields = dict(finish_reason=last.finish_reason if last else None,
                              prompt_tokens=timer.num_prompt_tokens, output_tokens=timer.num_tokens,
                              cached_tokens=last.usage.cached_prompt_tokens if last else 0,
                              prefill=last.prefill_instance_id if last else "",
                              decode=last.decode_instance_id if last else "", migrations=timer.num_migrations,
                              ttft_s=round(timer.ttft_s, 4) if timer.ttft_s is not None else None,
                              duration_s=round(duration_s, 4))
                with request_context(timer.request_id or request.request_id):
                    log_event(logger, "request end", status=status, **fields)
                self.tracing.finish(span, status, request_id=timer.request_id or request.request_id,
                                    model=request.model or self.model.name, max_tokens=request.sampling.max_tokens,
                                    temperature=request.sampling.temperature, top_p=request.sampling.top_p, **fields)

    async def _stream(self, request: GenerateInput, timeout_s: float | None, timer, trace_headers: dict[str, str]
                      ) -> AsyncIterator[GenerationDelta]:
        if self.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down; retry on another")
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        prepared = await self.prepare(request)
        prepared.trace_headers = trace_headers  # the Decode span's parent: this request's span here
        await self.request_ids.acquire(prepared.request_id, _left(deadline))
        try:
            with request_context(prepared.request_id):
                timer.request_id = prepared.request_id
                timer.num_prompt_tokens = len(prepared.prompt_token_ids)
                log_event(logger, "request start", prompt_tokens=timer.num_prompt_tokens,
                          max_tokens=prepared.sampling.max_tokens)
                async with (self.decode_admission.slot(_left(deadline)),
                            self.prefill_admission.slot(_left(deadline)) as prefill_slot):
                    async for delta in self._dispatch(prepared, deadline, timer, prefill_slot):
                        yield delta
        finally:
            self.request_ids.release(prepared.request_id)

    async def _dispatch(self, prepared: PreparedRequest, deadline: float | None, timer, prefill_slot: Slot
                        ) -> AsyncIterator[GenerationDelta]:
        """dispatcher.stream, placed again while an instance still holds the id of a
        request that ended here a moment ago (its cancel has not reached it yet)."""
        backoff_s = ID_RETRY_FIRST_BACKOFF_S
        while True:
            streamed_any = False
            try:
                async for delta in self.dispatcher.stream(prepared, _left(deadline), timer,
                                                          prefill_slot.release):
                    streamed_any = True
                    yield delta
                return
            except ServiceError as e:
                if e.code != grpc.StatusCode.ALREADY_EXISTS or streamed_any:
                    raise
                window_s = self.request_ids.recently_released(prepared.request_id)
                left_s = _left(deadline)
                if window_s is None or (left_s is not None and left_s <= backoff_s):
                    raise RequestIdInFlight(prepared.request_id, "on a decode or prefill instance") from None
                # Polled: the instance tells nobody when it lets go of the id.
                await asyncio.sleep(min(backoff_s, window_s))
                backoff_s = min(2 * backoff_s, ID_RETRY_MAX_BACKOFF_S)

    def _count_instances(self, instance, _reason: str) -> None:
        self.metrics.set_instances_alive(instance.role, sum(
            1 for i in self.registry.instances(instance.role)))

    def _observe_heartbeat(self, instance, _reason: str) -> None:
        self.metrics.heartbeat_received(instance.role, instance.last_heartbeat_gap_s)

    async def embed(self, request: EmbedInput, timeout_s: float | None = None) -> EmbeddingResult:
        """The prompt's embedding (gateway.routing.embedding_dispatcher places it)."""
        with request_context(request.request_id):
            loop = asyncio.get_running_loop()
            started = loop.time()
            num_prompt_tokens, result = 0, None
            ending = _Ending(timeout_s)
            span = self.tracing.start("embed", request.trace_headers)
            try:
                with ending:
                    if self.draining:
                        raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                                           "the gateway is shutting down; retry on another")
                    prepared = await _tokenizing(request, prepare_embedding, request, self.model, self.max_model_len,
                                                 self.settings.max_prompt_chars, self._served_names(),
                                                 frozenset(self.registry.lora_names()))
                    num_prompt_tokens = len(prepared.prompt_token_ids)
                    result = await self._embed(prepared, ending.deadline, Tracing.child_headers(span))
                return result
            finally:
                status = ending.status
                duration_s = loop.time() - started
                self.metrics.embedding_finished(status, num_prompt_tokens, duration_s)
                fields = dict(prompt_tokens=num_prompt_tokens,
                              cached_tokens=result.usage.cached_prompt_tokens if result else 0,
                              instance=result.instance_id if result else "", duration_s=round(duration_s, 4))
                log_event(logger, "embedding end", status=status, **fields)
                self.tracing.finish(span, status, request_id=result.request_id if result else request.request_id,
                                    model=request.model or self.model.name, **fields)

    async def _embed(self, prepared: PreparedEmbedding, deadline: float | None,
                     trace_headers: dict[str, str]) -> EmbeddingResult:
        await self.request_ids.acquire(prepared.request_id, _left(deadline))
        try:
            with request_context(prepared.request_id):
                # A prefill slot where a prefill instance computes it, else a decode slot.
                admission = (self.prefill_admission if self.embeddings.uses_prefill_pool()
                             else self.decode_admission)
                async with admission.slot(_left(deadline)):
                    result = await self.embeddings.embed(prepared, _left(deadline), trace_headers)
        finally:
            self.request_ids.release(prepared.request_id)
        return EmbeddingResult(prepared.request_id, result.embedding,
                               Usage(len(prepared.prompt_token_ids), 0, result.num_cached_tokens),
                               result.instance_id)

    async def generate(self, request: GenerateInput, timeout_s: float | None = None) -> GenerationDelta:
        """The whole completion: the stream's deltas joined."""
        result: GenerationDelta | None = None
        async for delta in self.stream(request, timeout_s):
            result = delta if result is None else result.merge(delta)
        return result

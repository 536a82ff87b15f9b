"""One Decode request, end to end, in engine terms (the Prefill call goes through prefill_service.client).

    open the output stream; admit (engine thread): local prefill, or reserve blocks +
    register the transfer; remote: call Prefill with the kv_target and wait for both
    the call and the receiver; finish_remote_kv with the first token; stream tokens.

Conditional disaggregation: prefill here when no prefill instance is named, when
the uncached part of the prompt is shorter than local_prefill_threshold tokens,
or (local_fallback) when the prefill instance is unreachable, also when it died with
part of the KV sent (the partial KV is dropped and the prompt recomputed here).
Leaving the iteration early (client cancelled) cancels the Prefill call and aborts
the request; the engine frees its blocks once no KV write can follow.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc import aio

from common.engine.async_engine import AsyncEngine, EngineDeadError
from common.engine.engine_core import EngineCore
from common.engine.kv_connector.metadata import KVTransferOutcome
from common.engine.kv_transfer_waiters import KVTransferWaiters
from common.engine.outputs import EngineCoreOutput, Logprobs
from common.service.common_api import prompt_logprob_pairs
from common.service.engine_requests import admit_when_id_free, new_request, open_stream_when_id_free, refused
from common.service.errors import ServiceError
from common.service.lora_modules import LoRAModules
from decode_service.admission import (
    Admission,
    Placement,
    admit,
    cancel_import,
    fail_import,
    finish_import,
    import_to_local,
)
from decode_service.api import DecodeJob
from kv_transfer import PoolGeometry
from prefill_service.api import KvTargetSpec, PrefillJob
from prefill_service.client import PrefillClients, failure_status

logger = logging.getLogger(__name__)


@dataclass
class DecodeChunk:
    output: EngineCoreOutput
    logprobs: list[Logprobs] | None
    num_cached_tokens: int
    prefill_instance_id: str  # empty when prefilled here
    # (prompt token i + 1, its Logprobs) in the first chunk, when sampling.prompt_logprobs was set
    prompt_logprobs: list[tuple[int, Logprobs]] = field(default_factory=list)


@dataclass
class RemotePrefill:
    instance_id: str
    num_cached_tokens: int
    first_logprobs: list[Logprobs] | None
    prompt_logprobs: list[tuple[int, Logprobs]] = field(default_factory=list)


class Decoder:
    def __init__(self, engine: AsyncEngine, eos_token_ids: tuple[int, ...], clients: PrefillClients,
                 transfer_waiters: KVTransferWaiters, *, kv_endpoints: list[str], geometry: PoolGeometry,
                 kv_layout_hash: str,
                 local_prefill_threshold: int, transfer_timeout_s: float, prefill_queue_timeout_s: float,
                 local_fallback: bool, lora_modules: LoRAModules):
        self.engine = engine
        self.lora_modules = lora_modules  # the adapters a request may name
        self.eos_token_ids = eos_token_ids
        self.transfer_waiters = transfer_waiters  # must observe the engine's KV transfers
        self.geometry = geometry
        self.kv_layout_hash = kv_layout_hash
        self.clients = clients
        # One receiving endpoint per tensor-parallel rank (each receives its shard); the
        # Prefill call names them all only when there is more than one.
        self.kv_endpoint = kv_endpoints[0]
        self.rank_kv_endpoints = list(kv_endpoints) if len(kv_endpoints) > 1 else []
        self.local_prefill_threshold = local_prefill_threshold
        # A remote prefill may queue for a slot, then must send within transfer_timeout_s:
        # the reservation (and the Prefill call) lasts for both.
        self.transfer_timeout_s = transfer_timeout_s
        self.prefill_queue_timeout_s = prefill_queue_timeout_s
        self.remote_window_s = prefill_queue_timeout_s + transfer_timeout_s
        self.local_fallback = local_fallback

    async def decode(self, job: DecodeJob) -> AsyncIterator[DecodeChunk]:
        if job.resumed_token_ids and job.prefill_address:
            # Its KV is the prompt's and the resumed output's, and the next token follows them: only
            # this instance's own prefill computes that.
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               "a request with resumed_token_ids is prefilled on the decode instance: "
                               "prefill_address must be empty")
        request = self._request(job)
        try:
            stream = await open_stream_when_id_free(self.engine, job.req_id)
        except ValueError as e:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, str(e)) from None
        with stream:
            # Registered before admission: the receive may end in the step that registers it.
            landed = self.transfer_waiters.expect(job.req_id, "recv")
            try:
                remote = await self._admit(job, request, landed)
            finally:
                self.transfer_waiters.discard(job.req_id, "recv")
            first = True
            try:
                async for output in stream:
                    logprobs = output.new_logprobs
                    # Prefilled here, the engine's first output has the prompt's logprobs.
                    prompt_logprobs = prompt_logprob_pairs(job.prompt_token_ids, output.prompt_logprobs)
                    if first and remote is not None:  # the prefill instance computed the prompt
                        if logprobs is None:
                            logprobs = remote.first_logprobs  # and sampled the first token
                        prompt_logprobs = prompt_logprobs or remote.prompt_logprobs
                    first = False
                    # Prompt tokens only: a resumed request's output, computed here like its prompt,
                    # may be cached too, but it is no prompt (usage adds the two up).
                    num_cached = min(max(output.num_cached_tokens, remote.num_cached_tokens if remote else 0),
                                     len(job.prompt_token_ids))
                    yield DecodeChunk(output, logprobs, num_cached, remote.instance_id if remote else "",
                                      prompt_logprobs)
            except EngineDeadError as e:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(e)) from None

    async def _admit(self, job: DecodeJob, request, landed: asyncio.Future) -> RemotePrefill | None:
        """Admit the request; when it is prefilled remotely, see its KV in. None: prefilled here."""
        transfer_id = f"{job.req_id[:200]}/{uuid.uuid4().hex[:12]}"  # unique per attempt
        try:
            await self.engine.compile_structured_output(request.sampling_params)
            admission = await admit_when_id_free(lambda: self.engine.call(lambda core: admit(
                core, request, bool(job.prefill_address), self.local_prefill_threshold, transfer_id,
                self.remote_window_s)))
        except ValueError as e:
            raise refused(e) from None
        if admission.placement is Placement.FULL:
            stats = self.engine.stats
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"no room for the KV of a {len(job.prompt_token_ids)}-token prompt: "
                               f"{stats['num_free_blocks']} of {stats['num_total_blocks']} blocks free, "
                               f"{stats['num_running'] + stats['num_waiting_for_remote_kv']} requests running")
        if admission.placement is Placement.REMOTE:
            return await self._prefill_remotely(job, request, admission, landed)
        return None

    async def abort(self, req_ids: list[str]) -> int:
        known: list[str] = []

        def abort(core: EngineCore):
            known.extend(r for r in req_ids if r in core.scheduler.requests)
            return core.abort_requests(req_ids)
        await self.engine.call(abort, deliver=True)
        return len(known)

    def _request(self, job: DecodeJob):
        return new_request(job.req_id, job.prompt_token_ids, job.params, job.priority, self.eos_token_ids,
                           job.cache_salt, self.lora_modules.resolve(job.lora_name), job.resumed_token_ids)

    async def _prefill_remotely(self, job: DecodeJob, request, admission: Admission,
                                landed: asyncio.Future) -> RemotePrefill | None:
        """None: nothing remote to report (fell back to a local prefill, or the request
        was aborted meanwhile and its stream ends with "abort"). `landed` resolves to the
        receive's KVTransferOutcome once the engine saw it end."""
        prefill_name = job.prefill_instance_id or job.prefill_address
        kv_target = KvTargetSpec(
            kv_endpoint=self.kv_endpoint, transfer_id=admission.transfer_id, dst_block_ids=admission.dst_block_ids,
            first_block_index=admission.first_block_index, num_layers=self.geometry.num_layers,
            dtype=self.geometry.dtype, block_shape=list(self.geometry.block_shape),
            timeout_s=self.remote_window_s, kv_layout_hash=self.kv_layout_hash,
            rank_kv_endpoints=self.rank_kv_endpoints,
            transfer_timeout_s=self.transfer_timeout_s if self.prefill_queue_timeout_s > 0 else None)
        call = self.clients.prefill(job.prefill_address, PrefillJob(
            job.req_id, job.prompt_token_ids, job.params, job.priority, kv_target, job.cache_salt, job.lora_name),
            self.remote_window_s, job.trace_headers)
        rpc = asyncio.ensure_future(call)
        try:
            await asyncio.wait({rpc, landed}, return_when=asyncio.FIRST_COMPLETED)
            if landed.done() and not landed.result().ok:  # our receiver gave up first
                call.cancel()
                return await self._import_failed(job, prefill_name, landed.result(), None)
            try:
                result = await rpc
            except aio.AioRpcError as error:
                await self.engine.call(lambda core: cancel_import(core, job.req_id, "the Prefill call failed"))
                return await self._import_failed(job, prefill_name, await asyncio.shield(landed), error)
            # Prefill answers only after our receiver acked DONE, so this is immediate.
            outcome = await asyncio.wait_for(asyncio.shield(landed), self.transfer_timeout_s)
            if not outcome.ok:
                return await self._import_failed(job, prefill_name, outcome, None)
        finally:
            if not rpc.done():  # we are leaving early (cancelled): the prefill must stop too
                call.cancel()
                rpc.cancel()
        await self.engine.call(lambda core: finish_import(core, job.req_id, result.token_ids), deliver=True)
        return RemotePrefill(result.instance_id or prefill_name, result.num_cached_tokens, result.logprobs,
                             result.prompt_logprobs)

    async def _import_failed(self, job: DecodeJob, prefill_name: str, outcome: KVTransferOutcome,
                             error: aio.AioRpcError | None) -> None:
        """The transfer has ended without the KV: fall back, or fail the request."""
        # The instance died or cannot be reached. The transfer has ended, so no KV write can
        # follow; KV that arrived only in part sits in blocks that never joined the prefix
        # cache (they join once all of it landed) and are freed here, so recomputing the
        # whole prompt locally is as safe after a partial transfer as after none.
        unreachable = error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
        if unreachable and self.local_fallback:
            logger.warning("prefill instance %s unreachable (%s)%s: prefilling %s locally", prefill_name,
                           error.details(), " after part of its KV arrived" if outcome.received_any else "",
                           job.req_id)
            local = self._request(job)
            await self.engine.call(lambda core: import_to_local(core, job.req_id, local))
            return None
        if not await self.engine.call(lambda core: fail_import(core, job.req_id)):
            return None  # aborted meanwhile: the stream ends with finish_reason "abort"
        if error is not None:
            raise ServiceError(*failure_status(error, prefill_name))
        if outcome.state == "expired":
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"KV transfer from prefill instance {prefill_name} did not complete within "
                               f"{self.remote_window_s:g}s (up to {self.prefill_queue_timeout_s:g}s waiting for a "
                               f"prefill slot, then {self.transfer_timeout_s:g}s for the transfer)")
        raise ServiceError(grpc.StatusCode.ABORTED,
                           f"KV transfer from prefill instance {prefill_name} failed: {outcome.reason}")

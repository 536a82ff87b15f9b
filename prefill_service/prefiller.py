"""The async front of a prefill instance: one Prefill from admission to the end of
its KV transfer, in engine terms (the servicer converts protobuf at the edge)."""
from __future__ import annotations

import asyncio
import time

import grpc

from common.engine.async_engine import AsyncEngine
from common.engine.engine_core import EngineCore
from common.engine.kv_transfer_waiters import KVTransferWaiters
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams
from common.service.common_api import prompt_logprob_pairs
from common.service.engine_requests import (add_request, admit_when_id_free, finished_output, new_request,
                                            open_stream_when_id_free, refused)
from common.service.errors import ServiceError
from common.service.lora_modules import LoRAModules
from prefill_service.api import PrefillJob, PrefillResult
from prefill_service.kv_export import ExportTarget

# After the transfer's own deadline, how long to wait for the sender to let go of
# our blocks before giving up on the RPC (the blocks are still released later).
TRANSFER_SETTLE_S = 10.0


def first_token_params(params: SamplingParams) -> SamplingParams:
    """Sample exactly the first token the colocated engine would: stop after one token;
    min_tokens matters only as "may the first token be EOS/stop" (the sampler masks
    stop tokens while fewer than min_tokens exist)."""
    return params.clone(n=1, max_tokens=1, min_tokens=min(params.min_tokens, 1))


class Prefiller:
    def __init__(self, engine: AsyncEngine, eos_token_ids: tuple[int, ...], transfer_waiters: KVTransferWaiters,
                 lora_modules: LoRAModules):
        self.engine = engine
        self.eos_token_ids = eos_token_ids
        self.transfer_waiters = transfer_waiters  # must observe the engine's KV transfers
        self.lora_modules = lora_modules

    async def prefill(self, job: PrefillJob, export: ExportTarget | None) -> PrefillResult:
        """`export`: job.kv_target, checked against the prompt and our pool (kv_export)."""
        request = new_request(job.req_id, job.prompt_token_ids, first_token_params(job.params), job.priority,
                              self.eos_token_ids, job.cache_salt, self.lora_modules.resolve(job.lora_name))
        if export is not None:
            request.kv_transfer_params = export.kv_transfer_params()
        try:
            stream = await open_stream_when_id_free(self.engine, job.req_id)
        except ValueError as e:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, str(e)) from None
        # Registered before admission: a send may end in the step that finishes the request.
        sent = self.transfer_waiters.expect(job.req_id, "send") if export is not None else None
        try:
            return await self._prefill(job, export, request, stream, sent)
        finally:
            self.transfer_waiters.discard(job.req_id, "send")

    async def _prefill(self, job: PrefillJob, export: ExportTarget | None, request: Request, stream,
                       sent: asyncio.Future | None) -> PrefillResult:
        # Leaving early (cancelled, timed out) closes the stream, which aborts the request;
        # the abort also drops the export or stops the started transfer.
        with stream:
            try:
                await self.engine.compile_structured_output(request.sampling_params)
                await admit_when_id_free(lambda: self.engine.call(lambda core: add_request(core, request)))
            except ValueError as e:
                raise refused(e) from None
            timeout = None if export is None else export.target.deadline - _now()
            try:
                output = await asyncio.wait_for(finished_output(stream), timeout)
            except asyncio.TimeoutError:
                raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"KV target {export.target.transfer_id} expired before the prompt of "
                                   f"{len(job.prompt_token_ids)} tokens was prefilled") from None
        if output.finish_reason == "abort":
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"prefill of {job.req_id} was aborted "
                               "(the instance is shutting down)")
        result = PrefillResult(output.new_token_ids, output.new_logprobs, output.num_cached_tokens,
                               transferred=export is not None,
                               prompt_logprobs=prompt_logprob_pairs(job.prompt_token_ids, output.prompt_logprobs),
                               timings=output.timings)
        if export is not None:
            await self._await_transfer(job.req_id, export, sent)
            result.num_transferred_blocks = len(export.target.dst_block_ids)
        return result

    async def _await_transfer(self, req_id: str, export: ExportTarget, sent: asyncio.Future) -> None:
        target = export.target
        try:
            # shield: our own timeout must not cancel the future the engine thread resolves.
            outcome = await asyncio.wait_for(asyncio.shield(sent),
                                             max(0.0, target.deadline - _now()) + TRANSFER_SETTLE_S)
        except asyncio.CancelledError:  # the caller went away: stop sending; blocks go back when it ends
            self.engine.abort([req_id])
            raise
        except asyncio.TimeoutError:
            self.engine.abort([req_id])
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"KV transfer {target.transfer_id} to {target.endpoint} did not end in time") from None
        # The engine freed the blocks before reporting the end; one more trip through its
        # thread refreshes its stats, so our load is current when the caller moves on.
        await self.engine.call(lambda core: None)
        if not outcome.ok:
            code = (grpc.StatusCode.DEADLINE_EXCEEDED if outcome.state == "expired"
                    else grpc.StatusCode.ABORTED)
            raise ServiceError(code, f"KV transfer {target.transfer_id} to {target.endpoint} "
                               f"{outcome.state}: {outcome.reason or 'no reason given'}")


def _now() -> float:
    return time.time()

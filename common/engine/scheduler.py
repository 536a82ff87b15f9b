"""Token-counting scheduler: every request's num_computed_tokens catches up to its
num_tokens under one per-step token budget. Prompts, chunked prefills, prefix hits,
decodes and imported (remote) KV are all the same rule. Plain Python, no torch.
"""
from __future__ import annotations

import bisect
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

from common.engine.config import SchedulerConfig, SpeculativeConfig
from common.engine.kv_cache_manager import KVCacheManager
from common.engine.kv_connector.base import KVConnectorScheduler
from common.engine.kv_connector.metadata import KVTransferOutcome
from common.engine.outputs import EngineCoreOutput, Logprobs, RunnerOutput, ScheduledRequest, SchedulerOutput
from common.engine.request import Request, RequestStatus
from common.engine.spec_decode.policy import SpeculationPolicy


@dataclass
class RemoteKVReservation:
    """Where a remote prefill must write a prompt's KV on this (decode) instance."""

    block_ids: list[int]  # every block of the prompt, in token order
    # Leading prompt tokens already in the local prefix cache (a multiple of block_size):
    # the remote side only writes blocks from block_ids[num_cached_tokens // block_size].
    num_cached_tokens: int


@dataclass
class RemoteImport:
    """A request whose prompt KV comes from outside: it runs once its receive ended well
    and the remote side's first sampled token(s) are known."""

    first_token_ids: list[int] | None = None
    recv_ended: bool = False
    recv_ok: bool = False
    aborting: bool = False  # abort asked while the receive was open: freed once it ended


class SchedulerInterface(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def schedule(self) -> SchedulerOutput: ...

    @abstractmethod
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: RunnerOutput) -> list[EngineCoreOutput]: ...

    @abstractmethod
    def abort_requests(self, req_ids: Iterable[str]) -> list[EngineCoreOutput]: ...

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...


class Scheduler(SchedulerInterface):
    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 block_size: int, max_model_len: int, kv_connector: KVConnectorScheduler | None = None,
                 speculative_config: SpeculativeConfig | None = None):
        if block_size != kv_cache_manager.block_size:
            raise ValueError(f"block_size {block_size} != KV cache manager's {kv_cache_manager.block_size}")
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.num_scheduler_steps = scheduler_config.num_scheduler_steps
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.kv_cache_manager = kv_cache_manager
        self.block_size = block_size
        # A sequence may not outgrow the whole pool: a lone request that could not get
        # another block would preempt itself forever. Capping the length stops it first.
        self.max_model_len = min(max_model_len, kv_cache_manager.num_blocks * block_size)
        self.kv_connector = kv_connector
        # Speculative decoding: drafts are extra tokens of a request's step; None: off.
        self.spec_policy = (SpeculationPolicy(speculative_config, self.max_model_len)
                            if speculative_config is not None else None)
        # Proposers that run layers over their drafts need slots for them past the step's.
        self.num_lookahead_tokens = (speculative_config.num_speculative_tokens
                                     if speculative_config is not None and speculative_config.proposer_writes_kv
                                     else 0)
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: list[Request] = []  # WAITING and PREEMPTED, next to admit first
        self.running: list[Request] = []  # oldest admission first; the tail is preempted first
        self.waiting_for_remote_kv: dict[str, Request] = {}
        self.remote_imports: dict[str, RemoteImport] = {}  # same keys as waiting_for_remote_kv
        # Finished requests whose blocks a KV transfer may still read: freed when it ended.
        self.held_requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_finished_requests = 0
        self._finished_req_ids: list[str] = []
        # FCFS until two requests' priorities differ, then (priority, arrival) for good.
        self._first_priority: int | None = None
        self._priority_mode = False

    # ---- admission -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._validate_new_request(request)
        if self._first_priority is None:
            self._first_priority = request.priority
        elif request.priority != self._first_priority and not self._priority_mode:
            self._priority_mode = True
            self.waiting.sort(key=_priority_key)
        request.status = RequestStatus.WAITING
        self.requests[request.req_id] = request
        self._enqueue_waiting(request)

    def _validate_new_request(self, request: Request) -> None:
        if request.req_id in self.requests or request.req_id in self.held_requests:
            raise ValueError(f"request {request.req_id!r} already exists")
        if request.num_tokens > self.max_model_len:
            raise ValueError(f"request {request.req_id!r} has {request.num_tokens} prompt tokens, more "
                             f"than the {self.max_model_len} this engine can hold")

    def _enqueue_waiting(self, request: Request, front: bool = False) -> None:
        if self._priority_mode:
            bisect.insort(self.waiting, request, key=_priority_key)
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    # ---- one step ----------------------------------------------------------------

    def schedule(self, in_flight_req_ids: frozenset[str] = frozenset(),
                 max_num_reqs: int | None = None) -> SchedulerOutput:
        """The next step's batch. in_flight_req_ids: requests of batches still running
        (pipeline parallelism): they are not scheduled again before their output is in,
        and while any batch runs nobody is preempted (its blocks may still be written);
        a request that gets no blocks waits for the next step instead. max_num_reqs caps
        the batch's requests (a pipeline's micro-batch)."""
        num_steps = self._num_decode_steps(in_flight_req_ids, max_num_reqs)
        max_num_reqs = self.max_num_seqs if max_num_reqs is None else max_num_reqs
        kv = self.kv_cache_manager
        token_budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        spec_token_ids: dict[str, list[int]] = {}
        preempted = False
        spec_policy = self.spec_policy
        step_allows_drafts = spec_policy is not None and spec_policy.step_allows_drafts(len(self.running))

        for request in list(self.running):
            if token_budget == 0 or len(num_scheduled) >= max_num_reqs:
                break
            if request.status is not RequestStatus.RUNNING or request.req_id in in_flight_req_ids:
                continue  # preempted earlier in this loop, or its last step is still running
            num_new_tokens = self._capped_chunk(request.num_tokens - request.num_computed_tokens)
            drafts, request.spec_token_ids = request.spec_token_ids, []
            reaches_last_token = request.num_computed_tokens + num_new_tokens == request.num_tokens
            if drafts and reaches_last_token and (step_allows_drafts or spec_policy.holds_in_large_batches(request)):
                drafts = drafts[:spec_policy.max_num_drafts(request)]
                # The budget cuts drafts first; drafts follow only a chunk that reaches the last token.
                drafts = drafts[:max(0, token_budget - num_new_tokens)]
                num_new_tokens += len(drafts)
            else:
                drafts = []
            num_new_tokens = min(num_new_tokens, token_budget)
            if num_new_tokens <= 0:
                continue
            allocated = True
            # Several decode steps take their slots only where the pool has them free; else one step.
            if num_steps > 1 and kv.allocate_slots(request, num_new_tokens,
                                                   num_lookahead_tokens=num_steps - 1) is None:
                num_steps = 1
            while num_steps == 1 and kv.allocate_slots(request, num_new_tokens,
                                                       num_lookahead_tokens=self.num_lookahead_tokens) is None:
                if in_flight_req_ids:  # no preemption under a running batch: it may still write them
                    allocated, preempted = False, True  # nor admissions, which would overtake this request
                    break
                victim = self._select_victim()
                token_budget += num_scheduled.pop(victim.req_id, 0)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if allocated and request.status is RequestStatus.RUNNING:
                num_scheduled[request.req_id] = num_new_tokens
                token_budget -= num_new_tokens
                if drafts:
                    spec_token_ids[request.req_id] = drafts

        # Like vLLM: a step that had to preempt admits nobody new, or the request just
        # preempted would be overtaken by newer ones.
        while (not preempted and self.waiting and token_budget > 0
               and self._num_seats_taken() < self.max_num_seqs and len(num_scheduled) < max_num_reqs):
            request = self.waiting[0]
            hit_block_ids, num_hit_tokens = kv.get_computed_blocks(request)
            num_new_tokens = self._capped_chunk(request.num_tokens - num_hit_tokens)
            if num_new_tokens > token_budget:
                # Without chunked prefill a prompt runs whole or waits (head of line),
                # except one longer than the whole budget: it could never run whole, so
                # it is chunked rather than blocking the queue forever.
                if not self.enable_chunked_prefill and num_new_tokens <= self.max_num_batched_tokens:
                    break
                num_new_tokens = token_budget
            if kv.allocate_slots(request, num_new_tokens, hit_block_ids,
                                 num_lookahead_tokens=self.num_lookahead_tokens) is None:
                break
            if self.kv_connector is not None:
                self.kv_connector.update_state_after_alloc(request, kv.get_block_ids(request.req_id), 0)
            self.waiting.pop(0)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            if request.scheduled_time is None:  # a preempted request keeps its first
                request.scheduled_time = time.monotonic()
            self.running.append(request)
            num_scheduled[request.req_id] = num_new_tokens
            token_budget -= num_new_tokens

        scheduled = []
        for req_id, num_new_tokens in num_scheduled.items():
            request = self.requests[req_id]
            start = request.num_computed_tokens
            drafts = spec_token_ids.get(req_id, [])
            num_new_known_tokens = num_new_tokens - len(drafts)
            reaches_last_token = start + num_new_known_tokens == request.num_tokens
            do_pool = reaches_last_token and request.pooling_params is not None
            do_sample = reaches_last_token and not do_pool
            scheduled.append(ScheduledRequest(
                req_id=req_id,
                token_ids=request.all_token_ids[start:start + num_new_known_tokens] + drafts,
                start_pos=start,
                block_table=kv.get_block_ids(req_id),
                do_sample=do_sample,
                sampling_params=request.sampling_params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                spec_token_ids=drafts,
                num_drafts_to_propose=(spec_policy.num_drafts_to_propose(request, step_allows_drafts)
                                       if spec_policy is not None and do_sample else 0),
                do_pool=do_pool, lora_name=request.lora_name,
                pooling_type=(request.pooling_params.pooling_type
                              if request.pooling_params is not None and request.pooling_params.pools_every_token
                              else None)))
            # Optimistic, like vLLM: the runner computes these tokens before the next step;
            # rejected drafts are taken back once verified (update_from_output).
            request.num_computed_tokens += num_new_tokens
        finished_req_ids, self._finished_req_ids = self._finished_req_ids, []
        scheduler_output = SchedulerOutput(scheduled=scheduled, num_scheduled_tokens=sum(num_scheduled.values()),
                                           finished_req_ids=finished_req_ids,
                                           scheduled_spec_decode_tokens=spec_token_ids,
                                           num_steps=num_steps if scheduled else 1)
        if self.kv_connector is not None:
            scheduler_output.kv_connector_metadata = self.kv_connector.build_connector_meta(scheduler_output)
        return scheduler_output

    def _capped_chunk(self, num_new_tokens: int) -> int:
        """A prompt chunk under long_prefill_token_threshold (0: no cap)."""
        threshold = self.long_prefill_token_threshold
        return threshold if 0 < threshold < num_new_tokens else num_new_tokens

    def _num_decode_steps(self, in_flight_req_ids: frozenset[str], max_num_reqs: int | None) -> int:
        """How many decode steps the next step may run back to back (num_scheduler_steps):
        1 unless every running request decodes one token, unconstrained (the native loop
        samples the rest: penalties, logprobs and stop tokens held back by min_tokens
        included), and nobody waits to be admitted (a new prompt would wait for all of them)
        nor is any batch in flight; at most the steps the request closest to its max_tokens or to
        max_model_len has left, so none runs past the positions it may hold."""
        num_steps = self.num_scheduler_steps
        if (num_steps == 1 or not self.running or self.waiting or in_flight_req_ids or max_num_reqs is not None
                or self.spec_policy is not None):
            return 1
        for request in self.running:
            params = request.sampling_params
            if (request.num_tokens - request.num_computed_tokens != 1 or request.grammar is not None
                    or request.pooling_params is not None):
                return 1
            # A request finishes once it holds max_model_len tokens.
            num_steps = min(num_steps, self.max_model_len - request.num_tokens)
            if params.max_tokens is not None:
                num_steps = min(num_steps, params.max_tokens - request.num_output_tokens)
        return max(1, num_steps)

    def schedule_kv_connector_only(self) -> SchedulerOutput:
        """A step that runs no tokens and only hands the connector's pending work to the
        worker half (a receive must be registered before its sender is told where to go)."""
        scheduler_output = SchedulerOutput(scheduled=[], num_scheduled_tokens=0)
        if self.kv_connector is not None:
            scheduler_output.kv_connector_metadata = self.kv_connector.build_connector_meta(scheduler_output)
        return scheduler_output

    def _num_seats_taken(self) -> int:
        return len(self.running) + len(self.waiting_for_remote_kv)

    def _select_victim(self) -> Request:
        if self._priority_mode:  # lowest priority, newest among equals
            return max(reversed(self.running), key=_priority_key)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Recompute mode: drop the KV; the prefix cache usually gives most of it back."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_queued_cached_tokens = None  # its own blocks may be cached now
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue_waiting(request, front=True)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: RunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        num_reqs = len(runner_output.req_ids)
        logprobs_per_req = runner_output.logprobs or [None] * num_reqs
        proposals = runner_output.spec_token_ids or [[]] * num_reqs
        num_steps_run = 1
        for req_id, (first_position, logprobs) in (runner_output.prompt_logprobs or {}).items():
            request = self.requests.get(req_id)
            if request is not None:  # before the tokens: the last chunk samples the first one
                request.add_prompt_logprobs(first_position, logprobs)
        for req_id, hidden_state in (runner_output.pooled_hidden or {}).items():
            request = self.requests.get(req_id)
            if request is not None and request.status is RequestStatus.RUNNING:  # else aborted meanwhile
                outputs.append(self._finish_pooled(request, hidden_state))
        for req_id, token_ids, logprobs, proposal in zip(runner_output.req_ids, runner_output.sampled_token_ids,
                                                         logprobs_per_req, proposals):
            request = self.requests.get(req_id)
            # Aborted (or preempted) after the step was scheduled: the tokens are stale.
            if request is None or request.status is not RequestStatus.RUNNING or not token_ids:
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:
                num_accepted = len(token_ids) - 1
                # The rejected drafts' slots hold wrong KV: recomputed (overwritten) next step.
                request.num_computed_tokens -= len(drafts) - num_accepted
                self.spec_policy.record(request, len(drafts), num_accepted)
            elif scheduler_output.num_steps > 1:
                # Decode steps back to back: each token but the last was the next step's input.
                request.num_computed_tokens += len(token_ids) - 1
                num_steps_run = max(num_steps_run, len(token_ids))
            outputs.append(self._append_tokens(request, token_ids, logprobs))
            if not request.is_finished:
                request.spec_token_ids = list(proposal)
        if scheduler_output.num_steps > 1:  # what ran, for whoever observes the step (metrics)
            scheduler_output.num_steps = num_steps_run
        if any(output.finished for output in outputs):
            self.running = [request for request in self.running if not request.is_finished]
        # After the tokens: a send may end in the very step whose request it holds.
        outputs += self.update_from_kv_transfers(runner_output.kv_transfer_outcomes)
        if self.kv_connector is not None:
            for req_id, reason in runner_output.failing_kv_transfers.items():
                self.kv_connector.request_aborted(req_id, reason)
        return outputs

    def update_from_kv_transfers(self, outcomes: list[KVTransferOutcome]) -> list[EngineCoreOutput]:
        """Transfers the worker half reported ended: no transport touches their blocks now."""
        if not outcomes:
            return []
        if self.kv_connector is not None:
            self.kv_connector.update_connector_output(outcomes)
        outputs = []
        for outcome in outcomes:
            if outcome.direction == "send":
                self.release_held_blocks(outcome.req_id)
            else:
                outputs += self._remote_kv_received(outcome.req_id, outcome.ok)
        return outputs

    def _remote_kv_received(self, req_id: str, ok: bool) -> list[EngineCoreOutput]:
        remote_import = self.remote_imports.get(req_id)
        if remote_import is None:
            return []
        remote_import.recv_ended, remote_import.recv_ok = True, ok
        if remote_import.aborting:
            return self._abort_remote_import(req_id)
        if ok and remote_import.first_token_ids is not None:
            return self._start_remote_request(req_id)
        return []  # a failed receive waits for its owner: fail_remote_kv, or a local prefill instead

    def _append_tokens(self, request: Request, token_ids: list[int],
                       logprobs: list[Logprobs] | None) -> EngineCoreOutput:
        """Append sampled tokens up to the first that stops the request."""
        num_kept = 0
        if token_ids and request.first_token_time is None:
            request.first_token_time = time.monotonic()
        for token_id in token_ids:
            request.append_output_token_ids([token_id])
            num_kept += 1
            if self._check_grammar(request, token_id) or self._check_stop(request, token_id):
                self._finish(request)
                break
        return EngineCoreOutput(
            req_id=request.req_id, new_token_ids=list(token_ids[:num_kept]),
            new_logprobs=logprobs[:num_kept] if logprobs is not None else None,
            prompt_logprobs=request.take_prompt_logprobs() if request.prompt_logprobs is not None else None,
            finish_reason=request.status.value if request.is_finished else None,
            stop_reason=request.stop_reason, num_cached_tokens=max(request.num_cached_tokens, 0),
            timings=request.timings(time.monotonic()) if request.is_finished else None)

    def _finish_pooled(self, request: Request, hidden_state: list[float]) -> EngineCoreOutput:
        """An embedding request whose prompt is computed: done, with its embedding."""
        request.status = RequestStatus.FINISHED_STOPPED
        self._finish(request)
        return EngineCoreOutput(req_id=request.req_id, new_token_ids=[],
                                finish_reason=request.status.value,
                                num_cached_tokens=max(request.num_cached_tokens, 0),
                                embedding=request.pooling_params.pool(hidden_state),
                                timings=request.timings(time.monotonic()))

    @staticmethod
    def _check_grammar(request: Request, token_id: int) -> bool:
        """Advance a constrained request's grammar; True when it ends the request: the
        grammar is complete ("stop"), or refused a token sampled elsewhere ("abort")."""
        grammar = request.grammar
        if grammar is None:
            return False
        if not grammar.accept_token(token_id):
            request.status = RequestStatus.FINISHED_ABORTED
            return True
        if grammar.is_terminated:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def _check_stop(self, request: Request, token_id: int) -> bool:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
            if not params.ignore_eos and token_id in request.eos_token_ids:
                # As in vLLM, EOS leaves stop_reason None so clients can tell it
                # apart from a user stop token.
                request.status = RequestStatus.FINISHED_STOPPED
                return True
        if ((params.max_tokens is not None and request.num_output_tokens >= params.max_tokens)
                or request.num_tokens >= self.max_model_len):
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _finish(self, request: Request) -> bool:
        """Bookkeeping for a request whose status is already a finished one; the caller
        removes it from its queue. True when its blocks are held for a KV transfer."""
        del self.requests[request.req_id]
        self._finished_req_ids.append(request.req_id)
        self.num_finished_requests += 1
        if self.kv_connector is not None and self.kv_connector.request_finished(request):
            self.held_requests[request.req_id] = request
            return True
        self.kv_cache_manager.free(request)
        return False

    def abort_requests(self, req_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Abort in any state. Every block goes back at once, except blocks a KV transfer
        may still touch: those go back once the connector reports the transfer ended (an
        import's abort output comes then too). Unknown ids are ignored."""
        outputs = []
        for req_id in req_ids:
            if req_id in self.held_requests:  # already finished: only its transfer is left
                if self.kv_connector is None:
                    self.release_held_blocks(req_id)
                else:  # the blocks go back once the transfer is reported ended
                    self.kv_connector.request_aborted(req_id, "request aborted")
                continue
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                outputs += self._abort_remote_import(req_id)
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            outputs.append(self._abort(request))
        return outputs

    def _abort(self, request: Request) -> EngineCoreOutput:
        request.status = RequestStatus.FINISHED_ABORTED
        if self._finish(request):
            self.kv_connector.request_aborted(request.req_id, "request aborted")
        return EngineCoreOutput(req_id=request.req_id, new_token_ids=[], finish_reason="abort",
                                num_cached_tokens=max(request.num_cached_tokens, 0),
                                timings=request.timings(time.monotonic()))

    def _abort_remote_import(self, req_id: str) -> list[EngineCoreOutput]:
        """Free an import's reservation, or, while a transfer may still write into it,
        cancel the transfer and free it (with the abort output) once it ended."""
        remote_import = self.remote_imports[req_id]
        if not remote_import.recv_ended:
            if not remote_import.aborting:
                remote_import.aborting = True
                self.kv_connector.request_aborted(req_id, "request aborted on the decode instance")
            return []
        del self.remote_imports[req_id]
        return [self._abort(self.waiting_for_remote_kv.pop(req_id))]

    # ---- disaggregation hooks ------------------------------------------------------

    def reserve_remote_kv(self, request: Request) -> RemoteKVReservation | None:
        """Decode role: take a seat and blocks for the whole prompt, to be filled by a
        remote prefill. None (nothing changed, request not kept) when either is short."""
        self._validate_new_request(request)
        if self._num_seats_taken() >= self.max_num_seqs:
            return None
        kv = self.kv_cache_manager
        hit_block_ids, num_hit_tokens = kv.get_computed_blocks(request)
        connector = self.kv_connector
        num_external_tokens = (request.num_tokens - num_hit_tokens if connector is None
                               else connector.get_num_new_matched_tokens(request, num_hit_tokens))
        if num_external_tokens <= 0:
            raise ValueError(f"request {request.req_id!r} names no KV to import (kv_transfer_params)")
        # The new blocks hold no KV yet: they join the prefix cache once it has landed.
        if kv.allocate_slots(request, num_external_tokens, hit_block_ids, delay_cache_blocks=True) is None:
            return None
        block_ids = kv.get_block_ids(request.req_id)
        num_prompt_blocks = -(-request.num_prompt_tokens // kv.block_size)  # past them: blocks taken ahead
        request.num_cached_tokens = request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.req_id] = request
        self.waiting_for_remote_kv[request.req_id] = request
        # With no connector nothing moves the KV here: whoever calls finish_remote_kv vouches for it.
        self.remote_imports[request.req_id] = RemoteImport(recv_ended=connector is None,
                                                           recv_ok=connector is None)
        if connector is not None:
            connector.update_state_after_alloc(request, block_ids, num_external_tokens)
        return RemoteKVReservation(block_ids=block_ids[:num_prompt_blocks], num_cached_tokens=num_hit_tokens)

    def finish_remote_kv(self, req_id: str, first_token_ids: list[int]) -> list[EngineCoreOutput]:
        """The remote prefill sampled first_token_ids: the request joins the running batch
        with them as soon as its KV has landed (now, if it has). Returns their output (it
        may already be final)."""
        remote_import = self.remote_imports.get(req_id)
        if remote_import is None or remote_import.aborting:  # aborted or failed meanwhile
            return []
        remote_import.first_token_ids = list(first_token_ids)
        if not (remote_import.recv_ended and remote_import.recv_ok):
            return []
        return self._start_remote_request(req_id)

    def cancel_remote_kv(self, req_id: str, reason: str) -> None:
        """Stop an import's transfer; the request keeps its reservation and stays waiting
        until its owner, told the receive ended, calls fail_remote_kv or finish_remote_kv."""
        remote_import = self.remote_imports.get(req_id)
        if remote_import is not None and not remote_import.recv_ended:
            self.kv_connector.request_aborted(req_id, reason)

    def remote_kv_aborting(self, req_id: str) -> bool:
        """An abort is freeing this import once its transfer ended (its output is the abort)."""
        remote_import = self.remote_imports.get(req_id)
        return remote_import is not None and remote_import.aborting

    def _start_remote_request(self, req_id: str) -> list[EngineCoreOutput]:
        first_token_ids = self.remote_imports.pop(req_id).first_token_ids
        request = self.waiting_for_remote_kv.pop(req_id)
        request.num_computed_tokens = request.num_tokens
        self.kv_cache_manager.cache_blocks(request, request.num_tokens)
        request.status = RequestStatus.RUNNING
        request.scheduled_time = time.monotonic()
        outputs = []
        if first_token_ids:
            request.first_token_time = request.scheduled_time  # it came with the KV: no prefill here
            outputs.append(self._append_tokens(request, first_token_ids, None))
        else:
            # Nothing sampled remotely: run the last prompt token here for its logits.
            request.num_computed_tokens -= 1
        if not request.is_finished:
            self.running.append(request)
        return outputs

    def fail_remote_kv(self, req_id: str) -> list[EngineCoreOutput]:
        """The KV import failed or timed out: free the reservation, finish "abort" (once
        no write can follow, when its transfer is still open)."""
        if req_id not in self.waiting_for_remote_kv:
            return []
        return self._abort_remote_import(req_id)

    def release_held_blocks(self, req_id: str) -> bool:
        """The finished request's KV transfer has ended; its blocks may be reused (they
        stay in the prefix cache until evicted)."""
        request = self.held_requests.pop(req_id, None)
        if request is None:
            return False
        self.kv_cache_manager.free(request)
        return True

    # ---- introspection -------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_open_kv_transfers(self) -> bool:
        """Blocks held for a transfer, or a transfer not yet reported ended: only further
        steps hear of its end."""
        return bool(self.held_requests) or (self.kv_connector is not None and self.kv_connector.has_open_transfers())

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_connector_stats(self) -> dict[str, int]:
        return self.kv_connector.stats() if self.kv_connector is not None else {}

    @property
    def stats(self) -> dict[str, int | float]:
        """Plain-data load snapshot for heartbeats and metrics.

        num_queued_prefill_tokens: the tokens a waiting request will compute (all of them,
        a preempted one's outputs too, less the prefix the cache held when first seen
        waiting) plus the uncomputed prompt tokens of running ones. Net of cache hits, as
        the gateway counts a dispatched prompt: otherwise a heartbeat taken while a
        request waits reports its cached system prompt as load, which outlives the
        request at the gateway. Each waiting request is looked up once, not every step
        (1,000 waiting with 32 cached blocks each cost ~4 ms a step otherwise).
        num_held: finished requests whose blocks are kept for a KV transfer.
        num_importing: requests whose prompt KV comes from outside, not yet running.
        num_sending (with a connector): KV sends not yet reported ended.
        """
        kv = self.kv_cache_manager
        num_queued_prefill_tokens = sum(max(0, request.num_prompt_tokens - request.num_computed_tokens)
                                        for request in self.running)
        for request in self.waiting:
            if request.num_queued_cached_tokens is None:
                request.num_queued_cached_tokens = kv.get_computed_blocks(request)[1]
            num_queued_prefill_tokens += request.num_tokens - max(request.num_computed_tokens,
                                                                  request.num_queued_cached_tokens)
        spec_stats = self.spec_policy.stats.as_dict() if self.spec_policy is not None else {}
        return self.kv_connector_stats() | spec_stats | {
            "num_running": len(self.running), "num_waiting": len(self.waiting),
            "num_waiting_for_remote_kv": len(self.waiting_for_remote_kv),
            "num_held": len(self.held_requests), "num_importing": len(self.waiting_for_remote_kv),
            "num_preemptions": self.num_preemptions,
            "num_finished_requests": self.num_finished_requests,
            "num_queued_prefill_tokens": num_queued_prefill_tokens,
            "num_free_blocks": kv.num_free_blocks, "num_total_blocks": kv.num_blocks,
            "num_blocks_held_ahead": kv.num_blocks_held_ahead,
            "kv_cache_usage": kv.usage,
            "prefix_cache_queried_tokens": kv.stats.num_query_tokens,
            "prefix_cache_hit_tokens": kv.stats.num_hit_tokens,
            "prefix_cache_hit_rate": kv.stats.hit_rate,
        }


def _priority_key(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time

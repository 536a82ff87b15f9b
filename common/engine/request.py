"""A request's state inside one engine. Plain Python, no torch."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from common.engine.block_hash import check_cache_salt
from common.engine.outputs import RequestTimings

if TYPE_CHECKING:
    from collections.abc import Sequence

    from common.engine.lora.request import LoRARequest
    from common.engine.pooling_params import PoolingParams
    from common.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Decode role: blocks are reserved and KV is being imported from a prefill instance.
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


class Request:
    """One generation request; `num_computed_tokens` catches up to `num_tokens`. With
    pooling_params, an embedding request: it ends once its prompt is computed, with the
    embedding instead of a token (its sampling_params are never used to sample)."""

    def __init__(self, req_id: str, prompt_token_ids: list[int], sampling_params: "SamplingParams",
                 eos_token_ids: tuple[int, ...] = (), priority: int = 0,
                 arrival_time: float | None = None, pooling_params: "PoolingParams | None" = None,
                 cache_salt: str | None = None, lora_request: "LoRARequest | None" = None,
                 output_token_ids: "Sequence[int]" = ()):
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # When the scheduler first gave it a step (or its imported KV landed), and when its
        # first token here came: RequestTimings at its end.
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # Non-empty at the start only for a request resumed from another instance's output: it
        # is computed like a preempted request, and its output so far counts as output.
        self.output_token_ids: list[int] = list(output_token_ids)
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache when the request was first scheduled.
        self.num_cached_tokens = -1
        # Leading tokens the prefix cache held when load stats first saw the request
        # waiting (None: not looked up since it last entered the queue); an estimate.
        self.num_queued_cached_tokens: int | None = None
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        # Chained hashes of the full blocks of all_token_ids, kept by the KV cache manager,
        # from the salt's root (block_hash.root_parent_hash): only equal salts share blocks.
        self.cache_salt = None if cache_salt is None else check_cache_salt(cache_salt)
        # The LoRA adapter the request runs with (None: the base model); its blocks are its own.
        self.lora_request = lora_request
        self.block_hashes: list[int] = []
        self.stop_reason: int | str | None = None
        # Where this request's KV comes from or goes to, for the engine's KV connector
        # (plain data; see common.engine.kv_connector). None: no transfer.
        self.kv_transfer_params: dict | None = None
        # Where the output stands in its structured_outputs constraint (a RequestGrammar,
        # set by the structured-output manager at admission). None: unconstrained.
        self.grammar = None
        # Speculative decoding: drafts proposed for the next step (never in all_token_ids:
        # nothing hashes, caches or publishes a token before the target verified it).
        self.spec_token_ids: list[int] = []
        # Recent acceptance rate of this request's drafts (an EMA), and the steps left
        # before it drafts again after the rate fell too low.
        self.spec_acceptance_rate: float | None = None  # None: no verification yet
        self.num_spec_backoff_steps = 0
        self.num_spec_backoffs = 0  # pauses in a row; each doubles the next
        # Entry i: prompt token i's logprob (None for token 0), gathered chunk by chunk while
        # the prompt is computed here; None when not asked for, or once sent.
        self.prompt_logprobs: list | None = [None] if sampling_params.prompt_logprobs is not None else None

    @classmethod
    def embedding(cls, req_id: str, prompt_token_ids: list[int], pooling_params: "PoolingParams",
                  eos_token_ids: tuple[int, ...] = (), priority: int = 0,
                  cache_salt: str | None = None, lora_request: "LoRARequest | None" = None) -> "Request":
        """An embedding request: its sampling params only fill the fields every request has."""
        from common.engine.sampling_params import SamplingParams
        return cls(req_id, prompt_token_ids, SamplingParams(max_tokens=1), eos_token_ids=eos_token_ids,
                   priority=priority, pooling_params=pooling_params, cache_salt=cache_salt,
                   lora_request=lora_request)

    def timings(self, now: float) -> RequestTimings:
        """Its RequestTimings, ending `now` (time.monotonic's clock)."""
        scheduled = now if self.scheduled_time is None else self.scheduled_time
        first_token = now if self.first_token_time is None else self.first_token_time
        return RequestTimings(queued_s=max(0.0, scheduled - self.arrival_time),
                              prefill_s=max(0.0, first_token - scheduled), decode_s=max(0.0, now - first_token),
                              inference_s=max(0.0, now - scheduled))

    @property
    def lora_name(self) -> str | None:
        return self.lora_request.lora_name if self.lora_request is not None else None

    def add_prompt_logprobs(self, first_position: int, logprobs: list) -> None:
        """The Logprobs of prompt tokens first_position + 1, + 2, ...; a chunk computed again
        (after a preemption) repeats what is here already and adds nothing."""
        have = self.prompt_logprobs
        if have is None:
            return
        num_known = len(have) - (first_position + 1)
        if num_known < 0:  # positions never computed here (only a prefix-cache hit would do it)
            self.prompt_logprobs = None
            return
        have.extend(logprobs[num_known:])

    def take_prompt_logprobs(self) -> list | None:
        """The prompt's logprobs once every prompt token has one (else None: the prompt was
        not computed here, e.g. its KV came from a prefill instance), at most once."""
        have, self.prompt_logprobs = self.prompt_logprobs, None
        return have if have is not None and len(have) == self.num_prompt_tokens else None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, status={self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")

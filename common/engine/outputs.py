"""Data that crosses component boundaries inside an engine, one step at a time.

scheduler --SchedulerOutput--> executor/model runner --RunnerOutput--> scheduler
scheduler --EngineCoreOutput (per request)--> frontends (LLM, async engine, services)
Plain dataclasses and lists: no torch, so they can be msgpack'd to TP workers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from common.engine.kv_connector.metadata import KVConnectorMetadata, KVTransferOutcome

if TYPE_CHECKING:
    from common.engine.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions start_pos.."""

    req_id: str
    token_ids: list[int]  # tokens whose KV this step computes
    start_pos: int  # == the request's num_computed_tokens before the step
    block_table: list[int]  # every block the request holds, in order
    # True when this chunk ends at the request's last known token, so the
    # step produces a new token for it (a partial prefill chunk samples nothing).
    do_sample: bool
    sampling_params: "SamplingParams"
    # Token history for penalties; references, the runner must not mutate them.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # Speculative decoding: the last len(spec_token_ids) of token_ids are drafts to verify
    # (the step samples at each of them and at the token before them).
    spec_token_ids: list[int] = field(default_factory=list)
    # How many drafts the proposer should propose for the next step (0: none).
    num_drafts_to_propose: int = 0
    # An embedding request's last chunk: the step returns its pooled final hidden state
    # (RunnerOutput.pooled_hidden) and samples nothing (do_sample is False).
    do_pool: bool = False
    # Every chunk of an embedding request whose pooling reads every token's state
    # (PoolingParams.pools_every_token): that pooling (MEAN, CLS, ...); None otherwise.
    pooling_type: str | None = None
    # The LoRA adapter whose deltas its tokens take (None: the base model alone).
    lora_name: str | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    # Requests that finished or were aborted since the last step (possibly never
    # seen by the runner); the runner drops their per-request state (seeded
    # generators). Preempted requests are not listed: they resume later.
    finished_req_ids: list[str] = field(default_factory=list)
    # The KV connector's work for this step (None: no connector configured).
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Structured outputs: the tokens each constrained sampling request may take next.
    # grammar_bitmask: [len(structured_output_req_ids), ceil(vocab_size / 32)] int32
    # tensor, row i for structured_output_req_ids[i]; bit t set = token t allowed.
    grammar_bitmask: Any = None
    structured_output_req_ids: list[str] = field(default_factory=list)
    # Speculative decoding: req_id -> the draft tokens this step verifies for it.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Decode steps the runner may run back to back (SchedulerConfig.num_scheduler_steps):
    # > 1 only where every request decodes one token greedily and holds the slots of this
    # many; the runner returns up to this many tokens per request, each the next one's input.
    # update_from_output sets it to the steps that ran.
    num_steps: int = 1

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class Logprobs:
    """Log-probability of a sampled token and the top-n alternatives."""

    token_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    # The token's rank among all tokens (1: the most likely), where it was computed (a prompt's
    # tokens); None otherwise.
    token_rank: int | None = None


@dataclass
class RunnerOutput:
    req_ids: list[str]  # requests that sampled this step, in scheduled order
    # One list per entry of req_ids: the accepted drafts, then the target's own token (or,
    # where SchedulerOutput.num_steps > 1, each decode step's token: the same number for all).
    sampled_token_ids: list[list[int]]
    logprobs: list[list[Logprobs] | None] | None = None  # parallel to sampled_token_ids
    # KV transfers that ended since the last step, from the worker half of the connector:
    # their blocks are no longer touched by any transport.
    finished_sending: list[str] = field(default_factory=list)  # req ids, any end state
    finished_recving: list[str] = field(default_factory=list)  # req ids, any end state
    kv_transfer_outcomes: list[KVTransferOutcome] = field(default_factory=list)  # how each ended
    # req_id -> why: a tensor-parallel rank's part of its transfer failed while other
    # ranks' parts are still open; they should stop rather than run to their deadline.
    failing_kv_transfers: dict[str, str] = field(default_factory=dict)
    # Drafts proposed for each entry of req_ids' next step (None: no proposer ran).
    spec_token_ids: list[list[int]] | None = None
    # req_id -> (p, the Logprobs of prompt tokens p + 1, p + 2, ...) for the requests asking
    # for prompt_logprobs whose chunk this step held such positions.
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] | None = None
    # req_id -> the pooled final hidden state [hidden_size] of each do_pool request (its
    # last token's, or its pooling_type's over all its tokens), as floats (None: no such
    # request this step).
    pooled_hidden: dict[str, list[float]] | None = None


@dataclass(frozen=True)
class RequestTimings:
    """Where a finished request's time in this engine went, in seconds (vLLM's intervals).
    queued: arrival until first scheduled (a KV import: until its KV had landed); prefill:
    first scheduled until its first token here (0 for a KV import, whose first token came
    with the KV); decode: first token until the end; inference: first scheduled until the
    end. A request that never got that far has 0 for what it did not reach."""

    queued_s: float
    prefill_s: float
    decode_s: float
    inference_s: float


@dataclass
class EngineCoreOutput:
    """What one request produced in one step."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None
    # With a request's first token, when it asked for prompt_logprobs and computed its prompt
    # here: one per prompt token, None for the first (nothing comes before it).
    prompt_logprobs: list[Logprobs | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string
    num_cached_tokens: int = 0
    # An embedding request's result (PoolingParams.pool of its last hidden state), with
    # finish_reason "stop" and no tokens.
    embedding: list[float] | None = None
    timings: RequestTimings | None = None  # with the output that finishes the request

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None


@dataclass
class RequestOutput:
    """The offline API's result for one prompt, shaped like vLLM's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[Logprobs | None] | None = None  # sampling_params.prompt_logprobs


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """The offline API's embedding of one prompt (LLM.embed), shaped like vLLM's."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """The offline API's score of one (query, document) pair (LLM.score), shaped like vLLM's:
    prompt_token_ids are the query's then the document's."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0

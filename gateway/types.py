"""Plain data the gateway works on; protobuf stays at the edges (gateway.api, decode_service.api).

GenerateInput (a Generate call) -> PreparedRequest (validated, tokenized)
decode_service.api.DecodeOutput (one DecodeResponse) -> GenerationDelta (one GenerateResponse)
EmbedInput (an Embed call) -> PreparedEmbedding -> EmbeddingResult (its EmbeddingResponse)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.outputs import Logprobs
from common.engine.pooling_params import PoolingParams
from common.engine.sampling_params import SamplingParams
from common.text.chat_template import DEFAULT_CHAT_TEMPLATE_OPTIONS, ChatTemplateOptions

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = "stop", "length", "abort"  # as in common.engine.outputs


@dataclass
class GenerateInput:
    """A Generate call: exactly one of text, token_ids, messages should be set."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict] | None = None  # {"role", "content"}
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""  # "": the gateway makes one
    priority: int = 0
    return_token_ids: bool = False
    return_logprobs: bool = False
    model: str = ""  # "": the served model
    chat_options: ChatTemplateOptions = DEFAULT_CHAT_TEMPLATE_OPTIONS  # how messages become the prompt
    add_special_tokens: bool | None = None  # the tokenizer's BOS ...; None: true for text, false for messages
    split_reasoning: bool = False  # gRPC: the thinking in GenerationDelta.reasoning (the gateway's parser)
    cache_salt: str | None = None  # only requests of the same salt share prefix-cache blocks
    # The caller's W3C trace context (traceparent, tracestate from gRPC metadata or HTTP headers):
    # the request's trace continues the caller's (common.service.tracing)
    trace_headers: dict[str, str] = field(default_factory=dict)


@dataclass
class PreparedRequest:
    """A validated request, ready to place: every field is within the model's limits."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # n == 1; logprobs set when they are to be returned
    priority: int = 0
    return_token_ids: bool = False
    cache_salt: str | None = None
    lora_name: str | None = None  # the request's model is this LoRA adapter (None: the base model)
    trace_headers: dict[str, str] = field(default_factory=dict)  # the Decode call's trace context

    @property
    def return_logprobs(self) -> bool:
        return self.sampling.logprobs is not None


@dataclass
class EmbedInput:
    """An Embed call: exactly one of text, token_ids, messages should be set (as GenerateInput's)."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict] | None = None
    pooling: PoolingParams = field(default_factory=PoolingParams)
    request_id: str = ""  # "": the gateway makes one
    priority: int = 0
    model: str = ""  # "": the served model
    chat_options: ChatTemplateOptions = DEFAULT_CHAT_TEMPLATE_OPTIONS
    add_special_tokens: bool | None = None  # None: true for text, false for messages
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens (-1: max_model_len)
    cache_salt: str | None = None  # only requests of the same salt share prefix-cache blocks
    trace_headers: dict[str, str] = field(default_factory=dict)  # the caller's W3C trace context


@dataclass
class PreparedEmbedding:
    """A validated Embed call, ready to place."""

    request_id: str
    prompt_token_ids: list[int]
    pooling: PoolingParams
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None  # the request's model is this LoRA adapter (None: the base model)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass
class GenerationDelta:
    """What a GenerateStream message carries (or, accumulated, a Generate response)."""

    request_id: str
    text: str
    usage: Usage
    token_ids: list[int] = field(default_factory=list)  # empty unless asked for
    logprobs: list[tuple[int, Logprobs]] = field(default_factory=list)  # (token id, logprobs)
    finish_reason: str | None = None
    stop_token_id: int | None = None  # a stop token (not EOS) ended it
    stop_string: str | None = None  # a stop string ended it
    prefill_instance_id: str = ""
    decode_instance_id: str = ""
    # (prompt token i + 1, its Logprobs), in the first delta, when sampling.prompt_logprobs was set
    prompt_logprobs: list[tuple[int, Logprobs]] = field(default_factory=list)
    # The prompt's token ids as tokenized (templated, truncated), in the first delta, when
    # return_token_ids was set
    prompt_token_ids: list[int] = field(default_factory=list)
    reasoning: str = ""  # the thinking split off text, where the request asked (split_reasoning)

    def merge(self, later: "GenerationDelta") -> "GenerationDelta":
        """Append a later delta of the same request to this one (in place)."""
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.prompt_logprobs += later.prompt_logprobs
        self.prompt_token_ids += later.prompt_token_ids
        self.reasoning += later.reasoning
        self.usage = later.usage
        self.prefill_instance_id = later.prefill_instance_id or self.prefill_instance_id
        self.decode_instance_id = later.decode_instance_id or self.decode_instance_id
        self.finish_reason, self.stop_token_id, self.stop_string = (
            later.finish_reason, later.stop_token_id, later.stop_string)
        return self


@dataclass
class EmbeddingResult:
    """What an Embed call answers."""

    request_id: str
    embedding: list[float]
    usage: Usage  # completion_tokens 0
    instance_id: str = ""  # the instance that computed it


@dataclass
class BeamSearchSequence:
    """One beam's completion."""

    text: str
    token_ids: list[int]  # generated, an ending EOS included
    cum_logprob: float  # the generated tokens' logprobs summed (length_penalty not applied)
    finish_reason: str  # "stop" where an EOS ended it, else "length"


@dataclass
class BeamSearchResult:
    """What a BeamSearch call answers: the best sequences, best first."""

    request_id: str
    sequences: list[BeamSearchSequence]
    usage: Usage  # completion_tokens: all sequences' together


@dataclass
class DeploymentInfo:
    """What ModelInfo answers."""

    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    num_prefill_instances: int
    num_decode_instances: int
    placement_policy: str

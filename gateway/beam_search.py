"""Beam search (vLLM's `use_beam_search`) over the gateway's one request path, for both edges
(HTTP `use_beam_search`, gRPC `BeamSearch`): the bookkeeping is common.engine.beam_search's;
each step here sends every live beam's whole sequence as an ordinary Generate request for one
token with its logprobs, placed, cancelled and counted like any other. The instances' prefix
caches hold each sequence but its last token, so a step prefills one token per beam.
"""
from __future__ import annotations

import dataclasses
import math
import uuid
from dataclasses import dataclass

import grpc

from common.engine.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams
from common.engine.sampling_params import SamplingParams
from common.service.errors import ServiceError, invalid
from gateway.core import Gateway
from gateway.openai_api.choices import generate_choices
from gateway.types import BeamSearchResult, BeamSearchSequence, GenerateInput, GenerationDelta, Usage
from gateway.validation import MAX_REQUEST_ID_CHARS

# Room left in a caller's request_id for its steps' suffix ("-beam-STEP-BEAM").
_STEP_ID_SUFFIX_CHARS = 24

# SamplingParams fields a beam search reads (n: HTTP's beam width); any other set to a value
# of its own is refused by the edge that parses the request.
BEAM_SEARCH_SAMPLING = ("n", "max_tokens", "temperature", "seed", "ignore_eos", "include_stop_str_in_output",
                        "skip_special_tokens")


def unsupported_sampling_field(sampling: SamplingParams) -> str | None:
    """The first SamplingParams field a beam search cannot honour that `sampling` sets to a
    value of its own (the ones that shape a draw, constraints, logprobs ...), or None."""
    defaults = SamplingParams()
    for f in dataclasses.fields(SamplingParams):
        if f.name not in BEAM_SEARCH_SAMPLING and getattr(sampling, f.name) != getattr(defaults, f.name):
            return f.name
    return None


def beam_search_params(request: GenerateInput, beam_width: int, length_penalty: float | None) -> BeamSearchParams:
    """A gRPC BeamSearch's parameters; INVALID_ARGUMENT (a ServiceError naming the field) for
    what a search cannot honour: a sampling field that shapes a draw, n, an output option."""
    sampling = request.sampling
    if not 1 <= beam_width <= MAX_BEAM_WIDTH:
        raise invalid(f"beam_width must be 1 to {MAX_BEAM_WIDTH}, got {beam_width}")
    if length_penalty is not None and not math.isfinite(length_penalty):
        raise invalid(f"length_penalty must be a finite number, got {length_penalty}")
    # n is HTTP's beam width (BEAM_SEARCH_SAMPLING); here the width is beam_width.
    unsupported = "n" if sampling.n != 1 else unsupported_sampling_field(sampling)
    if unsupported is not None:
        raise invalid(f"sampling.{unsupported} is not supported with beam search: it ranks sequences by the "
                      f"model's logprobs (only max_tokens, ignore_eos, include_stop_str_in_output, "
                      f"skip_special_tokens, temperature and seed may be set; the width is beam_width)")
    for option in ("return_logprobs", "split_reasoning"):
        if getattr(request, option):
            raise invalid(f"output.{option} is not supported with beam search")
    if len(request.request_id) > MAX_REQUEST_ID_CHARS - _STEP_ID_SUFFIX_CHARS:
        raise invalid(f"request_id has {len(request.request_id)} characters; at most "
                      f"{MAX_REQUEST_ID_CHARS - _STEP_ID_SUFFIX_CHARS} for a beam search (its steps' ids add "
                      f"a suffix)")
    return BeamSearchParams(beam_width=beam_width, max_tokens=sampling.max_tokens,
                            length_penalty=1.0 if length_penalty is None else length_penalty,
                            ignore_eos=sampling.ignore_eos,
                            include_stop_str_in_output=sampling.include_stop_str_in_output,
                            skip_special_tokens=sampling.skip_special_tokens)


async def run_beam_search(gateway: Gateway, request: GenerateInput, params: BeamSearchParams) -> BeamSearchResult:
    """A gRPC BeamSearch: the prompt tokenized as Generate would, searched, the best first."""
    if not request.request_id:
        request = dataclasses.replace(request, request_id=f"beam-{uuid.uuid4().hex}")
    prompt_token_ids = await gateway.tokenize(request)
    completions = await beam_search(gateway, request, prompt_token_ids, params)
    sequences = [BeamSearchSequence(c.delta.text, c.delta.token_ids, c.cum_logprob, c.delta.finish_reason)
                 for c in completions]
    return BeamSearchResult(request.request_id, sequences,
                            Usage(len(prompt_token_ids), sum(len(s.token_ids) for s in sequences)))


@dataclass
class BeamCompletion:
    """One finished beam, as its completion (token ids, text, finish reason) and its score's sum."""
    delta: GenerationDelta
    cum_logprob: float  # the generated tokens' logprobs summed (length_penalty not applied)


async def beam_search(gateway: Gateway, prompt: GenerateInput, prompt_token_ids: list[int],
                      params: BeamSearchParams) -> list[BeamCompletion]:
    """The beam_width best completions of prompt (tokenized: prompt_token_ids), best first."""
    search = BeamSearch(prompt_token_ids, params, gateway.model.tokenizer.eos_token_ids, gateway.max_model_len)
    while not search.done:
        requests = [GenerateInput(token_ids=beam.token_ids, sampling=search.step_params, return_logprobs=True,
                                  request_id=f"{prompt.request_id}-beam-{search.num_steps_done}-{i}",
                                  priority=prompt.priority, model=prompt.model,
                                  cache_salt=prompt.cache_salt, trace_headers=prompt.trace_headers)
                    for i, beam in enumerate(search.live)]
        results = await generate_choices(gateway, requests)
        if any(not result.logprobs for result in results):  # an instance's fault, never the request's
            raise ServiceError(grpc.StatusCode.INTERNAL, "a beam search step came back without the logprobs it "
                                                         "asked for; retry the request")
        search.advance([result.logprobs[0][1] for result in results])
    completions = []
    for beam in search.best():
        token_ids = search.generated_token_ids(beam)
        text = gateway.model.tokenizer.decode(search.shown_token_ids(beam),
                                              skip_special_tokens=params.skip_special_tokens)
        completions.append(BeamCompletion(GenerationDelta(
            request_id=prompt.request_id, text=text, usage=Usage(len(prompt_token_ids), len(token_ids)),
            token_ids=token_ids, prompt_token_ids=list(prompt_token_ids), finish_reason=beam.finish_reason),
            beam.cum_logprob))
    return completions

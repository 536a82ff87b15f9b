"""Beam search (`use_beam_search`, vLLM's), run here over the gateway's one request path.

As vLLM's V1 server does it: each step asks every live beam's sequence for one token with
its 2 * beam_width most likely next tokens (logprobs), keeps the beam_width best extensions
by cumulative logprob, and sets aside the beams an EOS ends. After max_tokens steps the best
beam_width of all, by cumulative logprob over length ** length_penalty (Hugging Face's
score), are the choices, best first. Every step's requests are ordinary Generate requests:
placed, cancelled and counted like any other, and the instances' prefix caches hold each
sequence but its last token, so a step prefills one token per beam. The logprobs are the
model's before temperature, so temperature does not change the search.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from gateway.core import Gateway
from gateway.openai_api.choices import generate_choices
from gateway.types import FINISH_LENGTH, FINISH_STOP, GenerateInput, GenerationDelta, Usage


MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each step reads 2 * beam_width logprobs


@dataclass
class BeamSearchParams:
    beam_width: int  # the request's n: beams kept, choices returned
    max_tokens: int | None  # None: until the context is full
    length_penalty: float = 1.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # the EOS that ended a beam stays in its text
    skip_special_tokens: bool = True


@dataclass
class Beam:
    token_ids: list[int]  # the prompt's, then the beam's own
    cum_logprob: float = 0.0
    finish_reason: str = FINISH_LENGTH
    eos_token_id: int | None = None  # the EOS that ended it (the last of token_ids), if one did

    def score(self, length_penalty: float) -> float:
        """Hugging Face's (and vLLM's): the length counts the prompt, not an ending EOS."""
        length = len(self.token_ids) - (self.eos_token_id is not None)
        return self.cum_logprob / (max(length, 1) ** length_penalty)


async def beam_search(gateway: Gateway, prompt: GenerateInput, params: BeamSearchParams) -> list[GenerationDelta]:
    """The beam_width best completions of prompt (a text, token ids or messages), best first."""
    prompt_token_ids = await gateway.tokenize(prompt)
    num_prompt_tokens = len(prompt_token_ids)
    room = gateway.max_model_len - num_prompt_tokens
    num_steps = room if params.max_tokens is None else min(params.max_tokens, room)
    eos_token_ids = frozenset(gateway.model.tokenizer.eos_token_ids)
    # Greedy, one token: only the logprobs (taken before temperature) are read.
    step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * params.beam_width, ignore_eos=True)
    beams = [Beam(list(prompt_token_ids))]
    ended: list[Beam] = []
    for index in range(num_steps):
        requests = [GenerateInput(token_ids=beam.token_ids, sampling=step, return_logprobs=True,
                                  request_id=f"{prompt.request_id}-beam-{index}-{i}", priority=prompt.priority,
                                  model=prompt.model) for i, beam in enumerate(beams)]
        results = await generate_choices(gateway, requests)
        candidates: list[Beam] = []
        for beam, result in zip(beams, results):
            top = result.logprobs[0][1]
            for token_id, logprob in zip(top.top_token_ids, top.top_logprobs):
                extended = Beam(beam.token_ids + [token_id], beam.cum_logprob + logprob)
                if token_id in eos_token_ids and not params.ignore_eos:
                    extended.finish_reason, extended.eos_token_id = FINISH_STOP, token_id
                    ended.append(extended)
                else:
                    candidates.append(extended)
        beams = sorted(candidates, key=lambda b: b.cum_logprob, reverse=True)[:params.beam_width]
        if not beams:
            break
    best = sorted(ended + beams, key=lambda b: b.score(params.length_penalty), reverse=True)[:params.beam_width]
    return [_completion(gateway, prompt.request_id, beam, prompt_token_ids, params) for beam in best]


def _completion(gateway: Gateway, request_id: str, beam: Beam, prompt_token_ids: list[int],
                params: BeamSearchParams) -> GenerationDelta:
    num_prompt_tokens = len(prompt_token_ids)
    token_ids = beam.token_ids[num_prompt_tokens:]
    shown = token_ids if beam.eos_token_id is None or params.include_stop_str_in_output else token_ids[:-1]
    text = gateway.model.tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens)
    return GenerationDelta(request_id=request_id, text=text, usage=Usage(num_prompt_tokens, len(token_ids)),
                           token_ids=token_ids, prompt_token_ids=list(prompt_token_ids),
                           finish_reason=beam.finish_reason)

"""Beam search (`use_beam_search`, vLLM's) over the gateway's one request path: the bookkeeping
is common.engine.beam_search's; each step here sends every live beam's whole sequence as an
ordinary Generate request for one token with its logprobs, placed, cancelled and counted like
any other. The instances' prefix caches hold each sequence but its last token, so a step
prefills one token per beam.
"""
from __future__ import annotations

from common.engine.beam_search import BeamSearch, BeamSearchParams
from gateway.core import Gateway
from gateway.openai_api.choices import generate_choices
from gateway.types import GenerateInput, GenerationDelta, Usage


async def beam_search(gateway: Gateway, prompt: GenerateInput, prompt_token_ids: list[int],
                      params: BeamSearchParams) -> list[GenerationDelta]:
    """The beam_width best completions of prompt (tokenized: prompt_token_ids), best first."""
    search = BeamSearch(prompt_token_ids, params, gateway.model.tokenizer.eos_token_ids, gateway.max_model_len)
    while not search.done:
        requests = [GenerateInput(token_ids=beam.token_ids, sampling=search.step_params, return_logprobs=True,
                                  request_id=f"{prompt.request_id}-beam-{search.num_steps_done}-{i}",
                                  priority=prompt.priority, model=prompt.model,
                                  cache_salt=prompt.cache_salt)
                    for i, beam in enumerate(search.live)]
        results = await generate_choices(gateway, requests)
        search.advance([result.logprobs[0][1] for result in results])
    completions = []
    for beam in search.best():
        token_ids = search.generated_token_ids(beam)
        text = gateway.model.tokenizer.decode(search.shown_token_ids(beam),
                                              skip_special_tokens=params.skip_special_tokens)
        completions.append(GenerationDelta(
            request_id=prompt.request_id, text=text, usage=Usage(len(prompt_token_ids), len(token_ids)),
            token_ids=token_ids, prompt_token_ids=list(prompt_token_ids), finish_reason=beam.finish_reason))
    return completions

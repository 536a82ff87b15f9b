"""Beam search as plain bookkeeping (no torch, no I/O): what vLLM's V1 runs around its engine,
shared by the offline `LLM.beam_search` and the gateway's searches (HTTP `use_beam_search`,
gRPC `BeamSearch`: gateway/beam_search.py), which each run the steps their own way.

Each step asks for one token of every live beam with its 2 * beam_width most likely next
tokens (their logprobs, taken before temperature); the beam_width best extensions by
cumulative logprob live on, and an extension by EOS ends its beam (unless ignore_eos). After
max_tokens steps (or once no beam lives) the best beam_width of all, by cumulative logprob
over length ** length_penalty (Hugging Face's score; the length counts the prompt, not an
ending EOS), are the result, best first.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.engine.outputs import Logprobs
from common.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from common.text.detokenizer import shown_token_ids

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each step reads 2 * beam_width logprobs


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int  # beams kept, sequences returned
    max_tokens: int | None  # None: until the context is full
    length_penalty: float = 1.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # the EOS that ended a beam stays in its text
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")


@dataclass
class BeamSequence:
    token_ids: list[int]  # the prompt's, then the beam's own
    cum_logprob: float = 0.0
    finish_reason: str = "length"  # "stop" where an EOS ended it
    eos_token_id: int | None = None  # that EOS (the last of token_ids)
    logprobs: list[Logprobs] = field(default_factory=list)  # each generated token's step
    text: str = ""  # filled by whoever detokenizes the result

    def score(self, length_penalty: float) -> float:
        length = len(self.token_ids) - (self.eos_token_id is not None)
        return self.cum_logprob / (max(length, 1) ** length_penalty)


@dataclass
class BeamSearchOutput:
    """One prompt's result (vLLM's shape): its best sequences, best first."""
    sequences: list[BeamSequence]


class BeamSearch:
    """One prompt's search: `live` beams to run a step for, `advance` with each one's step."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: Sequence[int],
                 max_model_len: int):
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        room = max_model_len - self.num_prompt_tokens
        self.num_steps = room if params.max_tokens is None else min(params.max_tokens, room)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.live = [BeamSequence(list(prompt_token_ids))]
        self.ended: list[BeamSequence] = []
        self.num_steps_done = 0
        # Greedy, one token: only the logprobs are read.
        self.step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * params.beam_width,
                                          ignore_eos=True)

    @property
    def done(self) -> bool:
        return not self.live or self.num_steps_done >= self.num_steps

    def advance(self, steps: Sequence[Logprobs]) -> None:
        """steps: each live beam's next-token Logprobs, in `live` order."""
        candidates = []
        for beam, step in zip(self.live, steps, strict=True):
            for token_id, logprob in zip(step.top_token_ids, step.top_logprobs):
                extended = BeamSequence(beam.token_ids + [token_id], beam.cum_logprob + logprob,
                                        logprobs=beam.logprobs + [step])
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    extended.finish_reason, extended.eos_token_id = "stop", token_id
                    self.ended.append(extended)
                else:
                    candidates.append(extended)
        self.live = sorted(candidates, key=lambda b: b.cum_logprob, reverse=True)[:self.params.beam_width]
        self.num_steps_done += 1

    def best(self) -> list[BeamSequence]:
        """The beam_width best sequences, ended or not, best first."""
        ranked = sorted(self.ended + self.live, key=lambda b: b.score(self.params.length_penalty), reverse=True)
        return ranked[:self.params.beam_width]

    def generated_token_ids(self, beam: BeamSequence) -> list[int]:
        return beam.token_ids[self.num_prompt_tokens:]

    def shown_token_ids(self, beam: BeamSequence) -> list[int]:
        """The beam's own tokens whose text it shows: an ending EOS only with include_stop_str_in_output."""
        return list(shown_token_ids(self.generated_token_ids(beam), beam.eos_token_id is not None,
                                    self.params.include_stop_str_in_output))

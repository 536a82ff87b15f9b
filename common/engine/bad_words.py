"""bad_words -> the token sequences the sampler masks (vLLM's rule): each word as written and,
where a leading space makes it other tokens of the same count, with one, so the word is
caught both at the start of the output and after a space."""
from __future__ import annotations

from collections.abc import Callable

from common.engine.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams


def with_bad_words_token_ids(params: SamplingParams, encode: Callable[[str], list[int]]) -> SamplingParams:
    """params with its bad words tokenized (unchanged where it has none, or has them already):
    what the frontend that tokenizes a request does before the engine sees it."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    return params.clone(bad_words_token_ids=bad_words_token_ids(params.bad_words, encode))


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """encode: text -> token ids without special tokens. ValueError naming a word whose tokens
    are more than the sampler looks back over."""
    sequences: list[list[int]] = []
    for i, word in enumerate(words):
        plain = encode(word.lstrip())
        if len(plain) > MAX_BAD_WORD_TOKENS:
            raise ValueError(f"bad_words[{i}] is {len(plain)} tokens long; at most {MAX_BAD_WORD_TOKENS} are allowed")
        sequences.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences

"""Per-request sampling parameters, with vLLM's field names and semantics.

Every value is checked in __post_init__ (and again by clone()/from_dict(), which
build a new object); a bad value raises ValueError naming the field and the
allowed range, which the gateway turns into INVALID_ARGUMENT. Token ids can only
be checked against a vocabulary: validate_token_ids() / validate_prompt_token_ids().

n > 1 is accepted but an engine only ever runs n == 1 requests: the frontend
(LLM API, gateway) fans a request out into n child requests built with
for_child(i), which sets n=1 and, for a seeded request, seed + i so the n samples
differ yet stay reproducible (vLLM does the same).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from common.engine.structured_output.params import StructuredOutputsParams

MAX_LOGPROBS = 20  # cap on top-n logprobs per token; each one costs a topk over the vocab
# Per-request list bounds, so that no one request can slow the loop that serves all of
# them: every stop string is searched for in each new piece of text and the text held
# back for the longest one; stop token ids are looked up for every token sampled.
# Generous next to real use (OpenAI allows 4 stop strings; evaluation harnesses and
# chat templates send a handful of strings and a few end-of-turn ids).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
# logit_bias entries are added to each step's logits of the request; OpenAI's range of values.
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_ABS_LOGIT_BIAS = 100.0
# allowed_token_ids may name most of a vocabulary (every token but a few); the largest
# vocabularies served today are ~256k tokens.
MAX_ALLOWED_TOKEN_IDS = 262_144
# bad_words: each word is looked for at the end of the output at every step of the request.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 64  # a word's token sequence (the tokenizer's; a long word is refused)
MAX_SEED = 2**63 - 1
# Temperatures below this are treated as greedy: dividing logits by ~0 overflows (vLLM's eps).
SAMPLING_EPS = 1e-5


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt; fanned out by the frontend (see module doc)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = -1  # keep the k most likely tokens; -1 disables
    min_p: float = 0.0  # drop tokens less likely than min_p * p(most likely token)
    repetition_penalty: float = 1.0  # over prompt + output tokens; > 1 discourages repeats
    presence_penalty: float = 0.0  # subtracted once from tokens already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    seed: int | None = None  # per-request RNG: same seed, same tokens, whatever the batch
    stop: list[str] = field(default_factory=list)  # stop strings (a single str is accepted)
    stop_token_ids: list[int] = field(default_factory=list)  # stop tokens besides EOS
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    max_tokens: int | None = 16  # None: until EOS or the model's context length
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    logprobs: int | None = None  # None: none; 0: the sampled token's only; k: plus top-k
    # Each prompt token's logprob given the tokens before it, plus the top-k there (vLLM's;
    # None: none). Such a prompt is computed whole: no prefix-cache hits.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # in the detokenized text
    # Guided decoding: the output obeys this constraint (a dict is turned into one).
    structured_outputs: StructuredOutputsParams | None = None
    # Added to these tokens' logits at every step, in [-100, 100] (OpenAI's logit_bias; to_dict()
    # writes it as [token_id, bias] pairs, which are accepted too). {} is None: no bias.
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled (vLLM's allowed_token_ids); None: every token.
    allowed_token_ids: list[int] | None = None
    # Keep only the prompt's last k tokens (vLLM's; -1: the last max_model_len). Applied where
    # the prompt is tokenized (the gateway, the offline LLM): truncate_prompt().
    truncate_prompt_tokens: int | None = None
    # Words the output may not contain (vLLM's bad_words): at each step, a word's last token is
    # masked where the output ends with the rest of it. The frontend that tokenizes (the gateway,
    # the offline LLM) turns them into bad_words_token_ids, which the engine applies.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        # A lone string is vLLM's shorthand for one stop string.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check()

    def _check(self) -> None:
        def fail(name: str, allowed: str) -> None:
            raise ValueError(f"{name} must be {allowed}, got {_short_repr(getattr(self, name))}")

        if not _is_int(self.n) or self.n < 1:
            fail("n", "an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                fail(name, "a finite number")
            setattr(self, name, float(value))
        if self.temperature < 0.0:
            fail("temperature", ">= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1 or self.top_k == 0:
            fail("top_k", "-1 (disabled) or an integer >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]")
        if self.repetition_penalty <= 0.0:
            fail("repetition_penalty", "> 0 (1 disables)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                fail(name, "in [-2, 2]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            fail("seed", f"None or an integer in [0, {MAX_SEED}]")
        self._check_stop_lists()
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "a bool")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "None or an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                fail(name, f"None or an integer in [0, {MAX_LOGPROBS}]")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            fail("structured_outputs", "None, a StructuredOutputsParams or a dict")
        self._check_logit_bias()
        self._check_allowed_token_ids()
        self._check_bad_words()
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k == -1 or 1 <= k <= 2**31 - 1)):
            fail("truncate_prompt_tokens", "None, -1 (the model's maximum length) or an integer >= 1")

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if isinstance(bias, dict):
            items = list(bias.items())
        elif isinstance(bias, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in bias):
            items = [tuple(pair) for pair in bias]  # to_dict()'s pairs
        else:
            raise ValueError(f"logit_bias must be None, a dict of token id -> bias or a list of "
                             f"[token_id, bias] pairs; got {_short_repr(bias)}")
        if len(items) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias must hold at most {MAX_LOGIT_BIAS_TOKENS} token ids, got {len(items)}")
        checked: dict[int, float] = {}
        for token_id, value in items:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0); got {_short_repr(token_id)}")
            if token_id in checked:
                raise ValueError(f"logit_bias names token id {token_id} twice")
            if not _is_number(value) or not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{token_id}] must be a number in [{-MAX_ABS_LOGIT_BIAS:g}, "
                                 f"{MAX_ABS_LOGIT_BIAS:g}], got {_short_repr(value)}")
            checked[token_id] = float(value)
        self.logit_bias = checked or None

    def _check_allowed_token_ids(self) -> None:
        allowed = self.allowed_token_ids
        if allowed is None:
            return
        if isinstance(allowed, tuple):
            allowed = self.allowed_token_ids = list(allowed)
        if not isinstance(allowed, list):
            raise ValueError(f"allowed_token_ids must be None or a list of token ids, got {type(allowed).__name__}")
        if not allowed:
            raise ValueError("allowed_token_ids must not be empty (None allows every token)")
        if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
            raise ValueError(f"allowed_token_ids must hold at most {MAX_ALLOWED_TOKEN_IDS} token ids, "
                             f"got {len(allowed)}")
        for i, token_id in enumerate(allowed):
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"allowed_token_ids must be a list of integers >= 0; allowed_token_ids[{i}] "
                                 f"is {_short_repr(token_id)}")
        if self.structured_outputs is not None:
            # Each would mask what the other allows; a row left with no token has nothing to sample.
            raise ValueError("allowed_token_ids cannot be combined with structured_outputs; "
                             "the constraint decides which tokens may follow")

    def _check_bad_words(self) -> None:
        words = self.bad_words
        if isinstance(words, tuple):
            words = self.bad_words = list(words)
        if words is not None:
            if not isinstance(words, list) or len(words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words must be a list of at most {MAX_BAD_WORDS} non-empty strings")
            for i, word in enumerate(words):
                if not isinstance(word, str) or not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
                    raise ValueError(f"bad_words[{i}] must be a string of 1 to {MAX_BAD_WORD_CHARS} characters, "
                                     f"not only spaces; got {_short_repr(word)}")
            self.bad_words = words or None
        sequences = self.bad_words_token_ids
        if sequences is None:
            return
        if (not isinstance(sequences, (list, tuple)) or len(sequences) > 2 * MAX_BAD_WORDS
                or not all(isinstance(seq, (list, tuple)) and 0 < len(seq) <= MAX_BAD_WORD_TOKENS
                           and all(_is_int(t) and t >= 0 for t in seq) for seq in sequences)):
            raise ValueError(f"bad_words_token_ids must be a list of at most {2 * MAX_BAD_WORDS} token id lists "
                             f"of 1 to {MAX_BAD_WORD_TOKENS} ids >= 0 each")
        self.bad_words_token_ids = [list(seq) for seq in sequences] or None

    def _check_stop_lists(self) -> None:
        """The stop lists' bounds, counted before any element is looked at; messages
        name the offending element, never echo a whole (possibly huge) list."""
        if isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if not isinstance(self.stop, list):
            raise ValueError(f"stop must be a list of non-empty strings, got {type(self.stop).__name__}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for i, stop in enumerate(self.stop):
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop must be a list of non-empty strings; stop[{i}] is {_short_repr(stop)}")
            if len(stop) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop[{i}] must be at most {MAX_STOP_STRING_CHARS} characters long, "
                                 f"got {len(stop)}")
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list of integers >= 0, "
                             f"got {type(self.stop_token_ids).__name__}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} token ids, "
                             f"got {len(self.stop_token_ids)}")
        for i, token_id in enumerate(self.stop_token_ids):
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"stop_token_ids must be a list of integers >= 0; stop_token_ids[{i}] "
                                 f"is {_short_repr(token_id)}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad words change this request's logits."""
        return (self.logit_bias is not None or self.allowed_token_ids is not None
                or self.bad_words_token_ids is not None)

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def holds_back_stop_tokens(self, num_output_tokens: int) -> bool:
        """Whether a request that has num_output_tokens may not take a stop token yet (min_tokens)."""
        return num_output_tokens < self.min_tokens

    def samples_argmax(self, num_output_tokens: int) -> bool:
        """Whether a request that has num_output_tokens samples its next token as the logits'
        argmax and nothing more (greedy; no penalties, bias, allowed set, logprobs or stop
        tokens held back)."""
        return (self.is_greedy and self.logprobs is None and not self.has_penalties and not self.adjusts_logits
                and not self.holds_back_stop_tokens(num_output_tokens))

    def validate_token_ids(self, vocab_size: int) -> None:
        """Check stop_token_ids, logit_bias, allowed_token_ids, bad_words_token_ids and the
        constraint's start_after_token_ids against the vocabulary (known only to the
        engine/gateway)."""
        bad_word_ids = [t for seq in self.bad_words_token_ids or () for t in seq]
        start_after_ids = self.structured_outputs.start_after_token_ids if self.structured_outputs else ()
        for name, token_ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or ()),
                                ("allowed_token_ids", self.allowed_token_ids or ()),
                                ("bad_words_token_ids", bad_word_ids),
                                ("structured_outputs.start_after_token_ids", start_after_ids)):
            for token_id in token_ids:
                if token_id >= vocab_size:
                    raise ValueError(f"{name}: token id {token_id} is out of range "
                                     f"[0, {vocab_size}) for vocab size {vocab_size}")

    def for_child(self, index: int) -> "SamplingParams":
        """Params of the index-th of n fanned-out requests (n=1, distinct seeds)."""
        if not 0 <= index < self.n:
            raise ValueError(f"child index must be in [0, {self.n}), got {index}")
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        return self.clone(n=1, seed=seed)

    def clone(self, **changes: Any) -> "SamplingParams":
        """A validated copy with `changes` applied; lists are copied, not shared."""
        values = self.to_dict()
        unknown = set(changes) - values.keys()
        if unknown:
            raise ValueError(f"unknown SamplingParams fields: {sorted(unknown)}")
        values.update(changes)
        return SamplingParams(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (ints, floats, bools, lists, None) for msgpack/JSON transport."""
        values = {f.name: (list(v) if isinstance(v := getattr(self, f.name), list) else v)
                  for f in dataclasses.fields(self)}
        if self.structured_outputs is not None:
            values["structured_outputs"] = self.structured_outputs.to_dict()
        if self.bad_words_token_ids is not None:
            values["bad_words_token_ids"] = [list(seq) for seq in self.bad_words_token_ids]
        if self.logit_bias is not None:
            # Pairs, not a dict: msgpack (strict map keys) and JSON only take string keys.
            values["logit_bias"] = [[token_id, bias] for token_id, bias in self.logit_bias.items()]
        return values

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        """Inverse of to_dict(); unknown keys are rejected (likely a typo or version skew)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown SamplingParams fields: {sorted(unknown)}")
        return cls(**data)


def _short_repr(value: Any, limit: int = 80) -> str:
    if _is_int(value) and value.bit_length() > 256:  # repr of a huge int is slow, or refused
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def truncate_prompt(prompt_token_ids: list[int], truncate_prompt_tokens: int | None,
                    max_model_len: int) -> list[int]:
    """The prompt's last truncate_prompt_tokens tokens (all of them when None); ValueError when
    that is more than the model takes (vLLM's rule)."""
    if truncate_prompt_tokens is None:
        return prompt_token_ids
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens: {keep} is more than the model's maximum length of "
                         f"{max_model_len} tokens; choose a smaller truncation")
    return prompt_token_ids[-keep:]


def validate_prompt_token_ids(prompt_token_ids: list[int], vocab_size: int, name: str = "prompt_token_ids") -> None:
    """Raise ValueError if the prompt is empty or holds a non-int or out-of-vocab id; `name`
    is the field the message names."""
    if len(prompt_token_ids) == 0:
        raise ValueError(f"{name} must not be empty")
    # min/max run in C; only a failing prompt pays for the Python scan that names the id.
    try:
        in_range = min(prompt_token_ids) >= 0 and max(prompt_token_ids) < vocab_size
    except TypeError:
        in_range = False
    if in_range and set(map(type, prompt_token_ids)) == {int}:
        return
    for position, token_id in enumerate(prompt_token_ids):
        if not _is_int(token_id):
            raise ValueError(f"{name}[{position}]: token id {token_id!r} is not an int")
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"{name}[{position}]: token id {token_id} is out of "
                             f"range [0, {vocab_size}) for vocab size {vocab_size}")

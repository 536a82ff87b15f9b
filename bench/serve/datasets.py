"""Benchmark prompts, generated offline from a seed (nothing is ever downloaded).

- random: vLLM's random dataset. Lengths uniform on [L*(1-r), L*(1+r)] (integers,
  floor/ceil, at least 1) for --random-input-len/--random-output-len L and
  --random-range-ratio r in [0, 1).
- sharegpt-like: lengths from log-normal fits to ShareGPT as `vllm bench serve`
  samples it (first human turn -> first reply), with vLLM's filter applied by
  redrawing: 4 <= prompt <= 1024, reply >= 4, prompt + reply <= 2048, and both also
  capped by max_model_len. The published anchor is the mean: vLLM's ShareGPT runs
  report 229,711 input / 203,068 generated tokens for 1000 prompts (vllm PR #18566,
  Llama-3.1 tokenizer; SGLang #1639 shows 227/188 per prompt on 2000), so we target
  means of 230 and 200 after the filter. ShareGPT gives no published median, so the
  spreads are judgement: prompts heavy-tailed (sigma 1.2: mostly short questions,
  some pasted documents), replies less so (sigma 0.9). The medians were then set so
  the filtered means hit 230/200: exp(mu) = 169 and 137 tokens, which leaves filtered
  medians of about 153 and 136 (7% of draws are redrawn).
- prefix-repetition: N shared prefixes of --prefix-len tokens, each followed by a
  unique suffix of --suffix-len tokens; requests cycle through the prefixes evenly
  and are then shuffled. For prefix-cache-aware placement.

Two more builders serve the real-stack drivers (bench.routing,
bench.disagg) rather than `bench serve`'s --dataset-name; each request
carries a `kind` naming its part of the workload:
- system_prompt_requests: tenants with a fixed system prompt each, plus a unique
  user part per request; tenants in "rounds" (every tenant once per round, shuffled
  within the round: steady per-tenant rates) or "random" order (as placement_sim).
- ranged_requests: prompt and output lengths uniform on inclusive ranges, e.g.
  long prompts (1024-2048 tokens, 16 out) or decode streams (32-64 in, 128-384 out).

Prompts are token ids by default: lengths are exact and shared prefixes are the same
KV blocks, with no tokenizer. Token ids are drawn uniformly from the vocabulary minus
its special ids (EOS from ModelInfo; all special ids when a tokenizer is given). Text
prompts decode such ids with the tokenizer, re-encoding to hit the length (as vLLM
does); without a tokenizer they are common English words, about one token each, and
their lengths are estimates.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

SHAREGPT_PROMPT_LOGNORMAL = (math.log(169.0), 1.2)  # (mu, sigma) of prompt tokens
SHAREGPT_OUTPUT_LOGNORMAL = (math.log(137.0), 0.9)  # (mu, sigma) of reply tokens
SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL, SHAREGPT_MIN_LEN = 1024, 2048, 4

# Frequent English words; with a leading space each is one token in common BPE vocabularies.
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her one all she there would their we him been has when "
         "who will more no if out so said what up its about into than them can only other new "
         "some could time these two may then do first any my now such like our over man me even "
         "most made after also did many before must through back years where much your way well "
         "down should because each just those people how too little state good very make world "
         "still own see men work long get here between both life being under never day same "
         "another know while last might us great old year off come since against go came right "
         "used take three").split()


@dataclass
class BenchRequest:
    prompt: list[int] | str  # token ids, or text
    prompt_len: int  # tokens in the prompt (an estimate for text without a tokenizer)
    output_len: int  # max_tokens to ask for
    kind: str = ""  # its part of a mixed workload ("decode", "long-prefill", "tenant-3"); "" for one-part ones
    # vLLM's structured_outputs object ({"json": schema}, {"regex": ...}); None: unconstrained
    structured_output: dict | None = None
    # A chat request's messages (the openai-chat backend); None: the prompt as one user message
    messages: list[dict] | None = None


@dataclass
class Vocabulary:
    size: int
    special_ids: frozenset[int] = frozenset()
    tokenizer: Any = None  # common.text.tokenizer.Tokenizer, for exact text prompts

    def ordinary_ids(self) -> np.ndarray:
        ids = np.arange(self.size)
        return ids[~np.isin(ids, list(self.special_ids))] if self.special_ids else ids


def _ids(rng: np.random.Generator, ordinary: np.ndarray, n: int) -> list[int]:
    return rng.choice(ordinary, size=n).tolist()


def _prompt(ids: list[int], fmt: str, vocab: Vocabulary, rng: np.random.Generator,
            ordinary: np.ndarray) -> tuple[list[int] | str, int]:
    if fmt == "ids":
        return ids, len(ids)
    if vocab.tokenizer is None:
        return " ".join(WORDS[i % len(WORDS)] for i in ids), len(ids)
    # Decoding random ids and re-encoding rarely round-trips exactly (merges across
    # boundaries); trim or extend and retry, as vLLM's random dataset does.
    tokenizer, target = vocab.tokenizer, len(ids)
    for _ in range(10):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target:
            break
        ids = ids[:target] if len(ids) > target else ids + _ids(rng, ordinary, target - len(ids))
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def _check_fits(longest_prompt: int, longest_output: int, max_model_len: int | None) -> None:
    if max_model_len and longest_prompt + longest_output > max_model_len:
        raise ValueError(f"prompts of up to {longest_prompt} tokens plus {longest_output} output "
                         f"tokens exceed max_model_len {max_model_len}; shorten them")


def random_requests(num: int, vocab: Vocabulary, rng: np.random.Generator, input_len: int = 1024,
                    output_len: int = 128, range_ratio: float = 0.0, prompt_format: str = "ids",
                    max_model_len: int | None = None) -> list[BenchRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    in_low = max(math.floor(input_len * (1 - range_ratio)), 1)
    in_high = math.ceil(input_len * (1 + range_ratio))
    out_low = max(math.floor(output_len * (1 - range_ratio)), 1)
    out_high = math.ceil(output_len * (1 + range_ratio))
    _check_fits(in_high, out_high, max_model_len)
    input_lens = rng.integers(in_low, in_high + 1, size=num)
    output_lens = rng.integers(out_low, out_high + 1, size=num)
    ordinary = vocab.ordinary_ids()
    requests = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist()):
        prompt, prompt_len = _prompt(_ids(rng, ordinary, n_in), prompt_format, vocab, rng, ordinary)
        requests.append(BenchRequest(prompt, prompt_len, n_out))
    return requests


def sharegpt_like_lengths(num: int, rng: np.random.Generator,
                          max_model_len: int | None = None) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs drawn from the fits above, filtered like vLLM."""
    max_prompt = min(SHAREGPT_MAX_PROMPT, max_model_len or SHAREGPT_MAX_PROMPT)
    max_total = min(SHAREGPT_MAX_TOTAL, max_model_len or SHAREGPT_MAX_TOTAL)
    if max_total < 2 * SHAREGPT_MIN_LEN:
        raise ValueError(f"max_model_len {max_model_len} is too short for sharegpt-like prompts")
    pairs: list[tuple[int, int]] = []
    while len(pairs) < num:  # about 7% are redrawn; draw in batches
        batch = 2 * (num - len(pairs)) + 16
        prompts = np.rint(rng.lognormal(*SHAREGPT_PROMPT_LOGNORMAL, size=batch)).astype(int)
        outputs = np.rint(rng.lognormal(*SHAREGPT_OUTPUT_LOGNORMAL, size=batch)).astype(int)
        keep = ((prompts >= SHAREGPT_MIN_LEN) & (outputs >= SHAREGPT_MIN_LEN)
                & (prompts <= max_prompt) & (prompts + outputs <= max_total))
        pairs.extend(zip(prompts[keep].tolist(), outputs[keep].tolist()))
    return pairs[:num]


def sharegpt_like_requests(num: int, vocab: Vocabulary, rng: np.random.Generator,
                           prompt_format: str = "ids", max_model_len: int | None = None,
                           output_len: int | None = None) -> list[BenchRequest]:
    """output_len, when given, replaces every drawn reply length (vLLM's --sharegpt-output-len)."""
    ordinary = vocab.ordinary_ids()
    requests = []
    for n_in, n_out in sharegpt_like_lengths(num, rng, max_model_len):
        prompt, prompt_len = _prompt(_ids(rng, ordinary, n_in), prompt_format, vocab, rng, ordinary)
        requests.append(BenchRequest(prompt, prompt_len, output_len or n_out))
    if output_len:
        _check_fits(max(r.prompt_len for r in requests), output_len, max_model_len)
    return requests


def prefix_repetition_requests(num: int, vocab: Vocabulary, rng: np.random.Generator,
                               prefix_len: int = 256, suffix_len: int = 256, num_prefixes: int = 10,
                               output_len: int = 128, prompt_format: str = "ids",
                               max_model_len: int | None = None) -> list[BenchRequest]:
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1:
        raise ValueError("prefix-repetition needs --prefix-num-prefixes >= 1 and a non-empty prompt")
    _check_fits(prefix_len + suffix_len, output_len, max_model_len)
    ordinary = vocab.ordinary_ids()
    prefixes = [_ids(rng, ordinary, prefix_len) for _ in range(num_prefixes)]
    requests = []
    for i in range(num):
        ids = prefixes[i % num_prefixes] + _ids(rng, ordinary, suffix_len)
        prompt, prompt_len = _prompt(ids, prompt_format, vocab, rng, ordinary)
        requests.append(BenchRequest(prompt, prompt_len, output_len))
    order = rng.permutation(num)  # arrivals interleave the prefixes, as real traffic would
    return [requests[i] for i in order]


def parse_length_range(text: str) -> tuple[int, int]:
    """A command-line LOW-HIGH token range (or one number, LOW = HIGH); argparse's `type=`."""
    low, sep, high = text.partition("-")
    try:
        return (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH (e.g. 64-128), got {text!r}") from None


def _check_range(name: str, low_high: tuple[int, int], minimum: int) -> tuple[int, int]:
    low, high = (int(v) for v in low_high)
    if not minimum <= low <= high:
        raise ValueError(f"{name} must be a range LOW-HIGH with {minimum} <= LOW <= HIGH; got {low}-{high}")
    return low, high


def ranged_requests(num: int, vocab: Vocabulary, rng: np.random.Generator, input_len_range: tuple[int, int],
                    output_len_range: tuple[int, int], kind: str = "",
                    max_model_len: int | None = None) -> list[BenchRequest]:
    """Token-id prompts, lengths uniform on the inclusive ranges (e.g. (1024, 2048))."""
    in_low, in_high = _check_range("input length", input_len_range, 1)
    out_low, out_high = _check_range("output length", output_len_range, 1)
    _check_fits(in_high, out_high, max_model_len)
    input_lens = rng.integers(in_low, in_high + 1, size=num)
    output_lens = rng.integers(out_low, out_high + 1, size=num)
    ordinary = vocab.ordinary_ids()
    return [BenchRequest(_ids(rng, ordinary, n_in), n_in, n_out, kind)
            for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist())]


TENANT_ORDERS = ("rounds", "random")


def system_prompt_requests(num: int, vocab: Vocabulary, rng: np.random.Generator, num_tenants: int = 8,
                           system_prompt_len: int = 512, user_len_range: tuple[int, int] = (64, 128),
                           output_len_range: tuple[int, int] = (8, 16), tenant_order: str = "rounds",
                           max_model_len: int | None = None) -> list[BenchRequest]:
    """Tenant t's requests are its system prompt (the same ids every time) plus a unique
    user part; kind "tenant-t". Token ids, so a prompt's leading blocks are exactly the
    tenant's (system_prompt_len a multiple of the block size makes them whole blocks)."""
    if num_tenants < 1 or system_prompt_len < 1:
        raise ValueError("system-prompt workload needs >= 1 tenant and a non-empty system prompt")
    if tenant_order not in TENANT_ORDERS:
        raise ValueError(f"tenant order must be one of {', '.join(TENANT_ORDERS)}; got {tenant_order!r}")
    user_low, user_high = _check_range("user part length", user_len_range, 1)
    out_low, out_high = _check_range("output length", output_len_range, 1)
    _check_fits(system_prompt_len + user_high, out_high, max_model_len)
    ordinary = vocab.ordinary_ids()
    system_prompts = [_ids(rng, ordinary, system_prompt_len) for _ in range(num_tenants)]
    requests, round_left = [], []
    for _ in range(num):
        if tenant_order == "rounds":
            if not round_left:
                round_left = rng.permutation(num_tenants).tolist()
            tenant = round_left.pop()
        else:
            tenant = int(rng.integers(num_tenants))
        user = _ids(rng, ordinary, int(rng.integers(user_low, user_high + 1)))
        prompt = system_prompts[tenant] + user
        requests.append(BenchRequest(prompt, len(prompt), int(rng.integers(out_low, out_high + 1)),
                                     f"tenant-{tenant}"))
    return requests


def json_schema_requests(num: int, vocab: Vocabulary, rng: np.random.Generator, output_len: int = 128,
                         prompt_format: str = "text", max_model_len: int | None = None) -> list[BenchRequest]:
    """The shape of vLLM's structured-output serving benchmark: each request asks in words
    for an object of one of bench.structured's schemas (nested objects, arrays, enums,
    bounded numbers), in turn, and is constrained to that schema; it ends when its JSON
    closes (so it needs EOS honoured), at most output_len tokens. Prompts are text, counted
    with the tokenizer when there is one."""
    from bench.structured import ASKS, SCHEMAS, TOPICS
    if prompt_format != "text":
        raise ValueError("the json-schema dataset's prompts are text: pass --prompt-format text")
    requests = []
    for index in range(num):
        schema_index = index % len(SCHEMAS)
        prompt = ASKS[int(rng.integers(len(ASKS)))].format(TOPICS[schema_index])
        prompt_len = (len(vocab.tokenizer.encode(prompt, add_special_tokens=False)) if vocab.tokenizer is not None
                      else len(prompt.split()))
        requests.append(BenchRequest(prompt, prompt_len, output_len, f"schema-{schema_index}",
                                     {"json": SCHEMAS[schema_index]}))
    _check_fits(max(r.prompt_len for r in requests), output_len, max_model_len)
    return requests


DATASETS = ("random", "sharegpt-like", "prefix-repetition", "json-schema")


def make_requests(name: str, num: int, vocab: Vocabulary, seed: int, **options) -> list[BenchRequest]:
    """The named dataset, deterministic in seed; options are the builders' keywords."""
    rng = np.random.default_rng(seed)
    builders = {"random": random_requests, "sharegpt-like": sharegpt_like_requests,
                "prefix-repetition": prefix_repetition_requests, "json-schema": json_schema_requests}
    if name not in builders:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    if options.get("prompt_format", "ids") not in ("ids", "text"):
        raise ValueError("prompt format must be 'ids' or 'text'")
    return builders[name](num, vocab, rng, **options)

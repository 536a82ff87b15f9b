"""bench.serve.datasets: lengths, ranges, exact prefix sharing, seeding."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from bench.serve.datasets import WORDS, Vocabulary, make_requests, sharegpt_like_lengths

VOCAB = Vocabulary(1000, frozenset({0, 1, 2, 999}))


def test_random_lengths_within_range_and_ids_avoid_special():
    requests = make_requests("random", 500, VOCAB, 0, input_len=100, output_len=20, range_ratio=0.5)
    prompt_lens = [r.prompt_len for r in requests]
    output_lens = [r.output_len for r in requests]
    assert min(prompt_lens) >= 50 and max(prompt_lens) <= 150
    assert min(output_lens) >= 10 and max(output_lens) <= 30
    assert len(set(prompt_lens)) > 50  # spread over the range, not stuck at an end
    for r in requests:
        assert len(r.prompt) == r.prompt_len
    ids = np.concatenate([r.prompt for r in requests])
    assert ids.min() >= 0 and ids.max() < 1000
    assert not set(ids.tolist()) & VOCAB.special_ids
    assert len(set(ids.tolist())) == 1000 - len(VOCAB.special_ids)  # every ordinary id shows up


def test_random_exact_lengths_and_limits():
    requests = make_requests("random", 20, VOCAB, 0, input_len=64, output_len=8)
    assert {(r.prompt_len, r.output_len) for r in requests} == {(64, 8)}
    with pytest.raises(ValueError, match="max_model_len"):
        make_requests("random", 2, VOCAB, 0, input_len=100, output_len=50, max_model_len=120)
    with pytest.raises(ValueError):
        make_requests("random", 2, VOCAB, 0, range_ratio=1.0)
    with pytest.raises(ValueError):
        make_requests("nope", 2, VOCAB, 0)


def test_determinism_by_seed():
    for name in ("random", "sharegpt-like", "prefix-repetition"):
        a = make_requests(name, 30, VOCAB, 5)
        b = make_requests(name, 30, VOCAB, 5)
        c = make_requests(name, 30, VOCAB, 6)
        assert [(r.prompt, r.output_len) for r in a] == [(r.prompt, r.output_len) for r in b]
        assert [r.prompt for r in a] != [r.prompt for r in c]


def test_sharegpt_like_matches_targets_and_filter():
    pairs = np.array(sharegpt_like_lengths(5000, np.random.default_rng(0)))
    prompts, outputs = pairs[:, 0], pairs[:, 1]
    assert prompts.min() >= 4 and outputs.min() >= 4
    assert prompts.max() <= 1024 and (prompts + outputs).max() <= 2048
    assert prompts.mean() == pytest.approx(230, rel=0.06)  # the published means we fitted to
    assert outputs.mean() == pytest.approx(200, rel=0.06)
    assert np.median(prompts) < prompts.mean()  # heavy right tail
    short = np.array(sharegpt_like_lengths(2000, np.random.default_rng(1), max_model_len=512))
    assert short[:, 0].max() <= 512 and short.sum(axis=1).max() <= 512
    requests = make_requests("sharegpt-like", 50, VOCAB, 0, output_len=32)
    assert {r.output_len for r in requests} == {32}


def test_prefix_repetition_shares_prefixes_exactly():
    requests = make_requests("prefix-repetition", 40, VOCAB, 0, prefix_len=48, suffix_len=16,
                             num_prefixes=4, output_len=5)
    assert all(r.prompt_len == 64 and len(r.prompt) == 64 and r.output_len == 5 for r in requests)
    prefixes = Counter(tuple(r.prompt[:48]) for r in requests)
    assert len(prefixes) == 4 and set(prefixes.values()) == {10}  # evenly cycled
    assert len({tuple(r.prompt[48:]) for r in requests}) == 40  # suffixes unique
    order = [list(prefixes).index(tuple(r.prompt[:48])) for r in requests]
    assert order != sorted(order) and order != [i % 4 for i in range(40)]  # shuffled
    with pytest.raises(ValueError):
        make_requests("prefix-repetition", 4, VOCAB, 0, num_prefixes=0)


def test_text_prompts_without_tokenizer_are_words():
    requests = make_requests("random", 5, VOCAB, 0, input_len=12, output_len=3, prompt_format="text")
    for r in requests:
        assert isinstance(r.prompt, str) and len(r.prompt.split()) == r.prompt_len == 12
        assert set(r.prompt.split()) <= set(WORDS)


def test_json_schema_requests_ask_for_each_schema_in_turn_and_are_constrained_to_it():
    from bench.structured import SCHEMAS, TOPICS
    requests = make_requests("json-schema", 2 * len(SCHEMAS) + 3, VOCAB, 5, output_len=96)
    for index, r in enumerate(requests):
        k = index % len(SCHEMAS)
        assert r.structured_output == {"json": SCHEMAS[k]} and r.kind == f"schema-{k}"
        assert isinstance(r.prompt, str) and TOPICS[k] in r.prompt and "JSON" in r.prompt
        assert r.output_len == 96 and r.prompt_len == len(r.prompt.split())  # no tokenizer: words
    assert [r.prompt for r in requests] == [r.prompt for r in make_requests("json-schema", len(requests), VOCAB, 5)]
    with pytest.raises(ValueError, match="--prompt-format text"):
        make_requests("json-schema", 4, VOCAB, 0, prompt_format="ids")
    with pytest.raises(ValueError, match="max_model_len"):
        make_requests("json-schema", 4, VOCAB, 0, output_len=100, max_model_len=64)

import math

import msgpack
import pytest

from common.engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_SEED,
    SamplingParams,
    truncate_prompt,
    validate_prompt_token_ids,
)

# (field, bad value, a fragment of the allowed range the message must state)
INVALID = [
    ("temperature", -0.1, ">= 0"),
    ("temperature", math.nan, "finite"),
    ("temperature", math.inf, "finite"),
    ("temperature", "1.0", "finite"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.01, "(0, 1]"),
    ("top_p", -0.5, "(0, 1]"),
    ("top_k", 0, ">= 1"),
    ("top_k", -2, "-1"),
    ("top_k", 2.5, ">= 1"),
    ("min_p", -0.01, "[0, 1]"),
    ("min_p", 1.5, "[0, 1]"),
    ("repetition_penalty", 0.0, "> 0"),
    ("repetition_penalty", -1.0, "> 0"),
    ("presence_penalty", 2.01, "[-2, 2]"),
    ("presence_penalty", -2.5, "[-2, 2]"),
    ("frequency_penalty", 3.0, "[-2, 2]"),
    ("frequency_penalty", -2.01, "[-2, 2]"),
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", -5, ">= 1"),
    ("min_tokens", -1, ">= 0"),
    ("n", 0, ">= 1"),
    ("n", True, ">= 1"),
    ("logprobs", -1, f"[0, {MAX_LOGPROBS}]"),
    ("logprobs", MAX_LOGPROBS + 1, f"[0, {MAX_LOGPROBS}]"),
    ("seed", -1, f"[0, {MAX_SEED}]"),
    ("seed", MAX_SEED + 1, f"[0, {MAX_SEED}]"),
    ("seed", 1.5, f"[0, {MAX_SEED}]"),
    ("stop", [""], "non-empty strings"),
    ("stop", ["ok", 3], "non-empty strings"),
    ("stop", 7, "non-empty strings"),
    ("stop_token_ids", [-1], ">= 0"),
    ("stop_token_ids", [1.0], ">= 0"),
    ("ignore_eos", 1, "bool"),
    ("logit_bias", {5: 100.5}, "[-100, 100]"),
    ("logit_bias", {5: math.nan}, "[-100, 100]"),
    ("logit_bias", {5: "1"}, "[-100, 100]"),
    ("logit_bias", {-1: 1.0}, "integers >= 0"),
    ("logit_bias", {"5": 1.0}, "integers >= 0"),
    ("logit_bias", {i: 1.0 for i in range(1025)}, "at most 1024"),
    ("logit_bias", [[5, 1.0], [5, 2.0]], "twice"),
    ("logit_bias", [5, 1.0], "[token_id, bias] pairs"),
    ("allowed_token_ids", [], "not be empty"),
    ("allowed_token_ids", [3, -1], ">= 0"),
    ("allowed_token_ids", 3, "list of token ids"),
    ("bad_words", [""], "1 to 256 characters"),
    ("bad_words", ["  "], "not only spaces"),
    ("bad_words", ["x" * 257], "1 to 256 characters"),
    ("bad_words", ["a"] * 129, "at most 128"),
    ("bad_words", "word", "a list"),
    ("bad_words_token_ids", [[]], "1 to 64 ids"),
    ("bad_words_token_ids", [[1, -1]], "ids >= 0"),
    ("bad_words_token_ids", [[1] * 65], "1 to 64 ids"),
    ("truncate_prompt_tokens", 0, "-1 (the model's maximum length) or an integer >= 1"),
    ("truncate_prompt_tokens", -2, "-1 (the model's maximum length) or an integer >= 1"),
    ("truncate_prompt_tokens", 2**31, "an integer >= 1"),
]


@pytest.mark.parametrize("name,value,allowed", INVALID, ids=[f"{n}={v!r}" for n, v, _ in INVALID])
def test_invalid_value_rejected_naming_field_and_range(name, value, allowed):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{name: value})
    assert name in str(excinfo.value)
    assert allowed in str(excinfo.value)


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=4, min_tokens=4)
    SamplingParams(max_tokens=None, min_tokens=1000)


@pytest.mark.parametrize("changes", [
    dict(temperature=0.0), dict(temperature=2), dict(top_p=1.0), dict(top_p=1e-6),
    dict(top_k=-1), dict(top_k=1), dict(top_k=10**6), dict(min_p=0.0), dict(min_p=1.0),
    dict(repetition_penalty=1e-3), dict(presence_penalty=-2), dict(frequency_penalty=2.0),
    dict(seed=0), dict(seed=MAX_SEED), dict(logprobs=0), dict(logprobs=MAX_LOGPROBS),
    dict(max_tokens=None), dict(max_tokens=1), dict(n=4), dict(stop=["a", "\n\n"]),
    dict(truncate_prompt_tokens=-1), dict(truncate_prompt_tokens=1),
])
def test_boundary_values_accepted(changes):
    SamplingParams(**changes)


def test_normalisation():
    params = SamplingParams(temperature=1, stop="###", stop_token_ids=(5, 6))
    assert isinstance(params.temperature, float)
    assert params.stop == ["###"]  # vLLM accepts one string
    assert params.stop_token_ids == [5, 6]


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy  # would overflow as a divisor
    assert SamplingParams(temperature=0.8, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.8).is_greedy


def test_dict_round_trip_and_unknown_keys():
    params = SamplingParams(n=2, temperature=0.7, top_k=5, seed=3, stop=["x"], stop_token_ids=[9],
                            max_tokens=None, logprobs=2, logit_bias={7: -100, 2: 0.5}, allowed_token_ids=[2, 7, 9])
    data = params.to_dict()
    assert all(isinstance(v, (int, float, bool, str, list, type(None))) for v in data.values())
    assert SamplingParams.from_dict(data) == params
    # The engine's processes exchange it as msgpack, whose unpacker takes string map keys only.
    assert SamplingParams.from_dict(msgpack.unpackb(msgpack.packb(data))) == params
    with pytest.raises(ValueError, match="tempreature"):
        SamplingParams.from_dict({"tempreature": 0.5})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({**data, "top_p": 0.0})


def test_clone_copies_and_validates():
    params = SamplingParams(stop=["a"], stop_token_ids=[1])
    copy = params.clone(temperature=0.0)
    assert copy.temperature == 0.0 and params.temperature == 1.0
    copy.stop.append("b")
    copy.stop_token_ids.append(2)
    assert params.stop == ["a"] and params.stop_token_ids == [1]
    with pytest.raises(ValueError, match="top_k"):
        params.clone(top_k=0)
    with pytest.raises(ValueError, match="unknown"):
        params.clone(beam_width=2)


def test_for_child_fans_out_with_distinct_seeds():
    params = SamplingParams(n=3, seed=MAX_SEED - 1)
    children = [params.for_child(i) for i in range(3)]
    assert [c.n for c in children] == [1, 1, 1]
    assert [c.seed for c in children] == [MAX_SEED - 1, MAX_SEED, 0]
    assert SamplingParams(n=2).for_child(1).seed is None
    with pytest.raises(ValueError):
        params.for_child(3)


def test_validate_token_ids():
    SamplingParams(stop_token_ids=[0, 99], logit_bias={99: 1}, allowed_token_ids=[0, 99]).validate_token_ids(100)
    with pytest.raises(ValueError, match=r"stop_token_ids.*100.*vocab size 100"):
        SamplingParams(stop_token_ids=[5, 100]).validate_token_ids(100)
    with pytest.raises(ValueError, match=r"^logit_bias: token id 100 is out of range"):
        SamplingParams(logit_bias={5: 1, 100: -1}).validate_token_ids(100)
    with pytest.raises(ValueError, match=r"^allowed_token_ids: token id 123 is out of range"):
        SamplingParams(allowed_token_ids=[5, 123]).validate_token_ids(100)


def test_logit_bias_and_allowed_token_ids():
    params = SamplingParams(logit_bias={3: 1, 4: -2.5}, allowed_token_ids=(4, 3))
    assert params.logit_bias == {3: 1.0, 4: -2.5} and type(params.logit_bias[3]) is float
    assert params.allowed_token_ids == [4, 3]
    assert params.adjusts_logits and not params.clone(temperature=0.0).samples_argmax(0)
    assert SamplingParams(logit_bias={}).logit_bias is None  # no bias: argmax steps stay argmax
    assert SamplingParams(temperature=0.0, logit_bias={}).samples_argmax(0)
    with pytest.raises(ValueError, match="allowed_token_ids cannot be combined with structured_outputs"):
        SamplingParams(allowed_token_ids=[1], structured_outputs={"regex": "a+"})
    SamplingParams(logit_bias={1: 5}, structured_outputs={"regex": "a+"})  # a bias within the grammar's choice


def test_validate_prompt_token_ids():
    validate_prompt_token_ids([0, 5, 99], 100)
    with pytest.raises(ValueError, match="empty"):
        validate_prompt_token_ids([], 100)
    with pytest.raises(ValueError, match=r"\[2\].*token id 100 .*vocab size 100"):
        validate_prompt_token_ids([1, 2, 100], 100)
    with pytest.raises(ValueError, match=r"\[0\].*token id -3 .*vocab size 100"):
        validate_prompt_token_ids([-3], 100)
    with pytest.raises(ValueError, match=r"\[1\].*'7'"):
        validate_prompt_token_ids([1, "7"], 100)
    with pytest.raises(ValueError, match=r"\[1\].*2.0.*not an int"):
        validate_prompt_token_ids([1, 2.0], 100)


def test_a_requests_prompt_logprobs_gather_chunk_by_chunk_once():
    from common.engine.outputs import Logprobs
    from common.engine.request import Request
    def lp(value):
        return Logprobs(value, [], [])
    request = Request("r", [5, 6, 7, 8, 9], SamplingParams(prompt_logprobs=0))
    request.add_prompt_logprobs(0, [lp(-1.0), lp(-2.0)])  # tokens 1 and 2, from the first chunk
    assert request.take_prompt_logprobs() is None  # not every prompt token has one yet: nothing
    request = Request("r", [5, 6, 7, 8, 9], SamplingParams(prompt_logprobs=0))
    request.add_prompt_logprobs(0, [lp(-1.0), lp(-2.0)])
    request.add_prompt_logprobs(0, [lp(-1.5), lp(-2.5), lp(-3.0)])  # recomputed after a preemption
    request.add_prompt_logprobs(3, [lp(-4.0)])
    assert request.take_prompt_logprobs() == [None, lp(-1.0), lp(-2.0), lp(-3.0), lp(-4.0)]
    assert request.take_prompt_logprobs() is None  # once
    request.add_prompt_logprobs(0, [lp(-1.0)])  # a recompute after it was sent adds nothing
    assert request.prompt_logprobs is None
    gap = Request("g", [5, 6, 7], SamplingParams(prompt_logprobs=2))
    gap.add_prompt_logprobs(1, [lp(-1.0)])  # position 0 never computed here
    assert gap.take_prompt_logprobs() is None
    assert Request("n", [5, 6], SamplingParams()).prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=MAX_LOGPROBS + 1)


def test_truncate_prompt_keeps_the_last_tokens():
    ids = list(range(10, 20))
    assert truncate_prompt(ids, None, 8) == ids
    assert truncate_prompt(ids, 3, 8) == [17, 18, 19]
    assert truncate_prompt(ids, -1, 8) == ids[-8:]
    assert truncate_prompt(ids, 20, 32) == ids  # shorter than the truncation: all of it
    with pytest.raises(ValueError, match="truncate_prompt_tokens: 9 is more than the model's maximum length of 8"):
        truncate_prompt(ids, 9, 8)


def test_bad_words_become_token_sequences_at_the_start_and_after_a_space():
    from common.engine.bad_words import bad_words_token_ids
    from common.engine.model_files import resolve_model
    from common.text.prompt_tokenizer import PromptTokenizer
    tokenizer = PromptTokenizer(resolve_model())
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    sequences = bad_words_token_ids(["Paris", " London"], encode)
    assert sequences == [encode("Paris"), encode(" Paris"), encode("London"), encode(" London")]
    assert SamplingParams(bad_words=["Paris"], bad_words_token_ids=sequences).adjusts_logits
    with pytest.raises(ValueError, match=r"bad_words\[0\] is 65 tokens long"):
        bad_words_token_ids([" x" * 65], encode)
    with pytest.raises(ValueError, match="bad_words_token_ids: token id 49152"):
        SamplingParams(bad_words_token_ids=[[49152]]).validate_token_ids(49152)
    assert SamplingParams(bad_words=[]).bad_words is None

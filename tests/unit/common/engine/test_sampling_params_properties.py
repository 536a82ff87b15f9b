"""Property tests of SamplingParams validation, the check every edge and every instance
runs on sampling fields from the wire: any values of any type are accepted or refused
with ValueError naming a field, never anything else; what is accepted survives
to_dict/from_dict and clone unchanged, and respects the documented bounds."""
from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from common.engine.sampling_params import (
    MAX_ABS_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from tests.support.properties import BOUNDED, json_values

FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
ANY_VALUE = (json_values | st.tuples(st.integers(-3, 5)) | st.integers(min_value=-(2**80), max_value=2**80)
             | st.lists(st.text(min_size=1, max_size=3), min_size=MAX_STOP_STRINGS - 1, max_size=MAX_STOP_STRINGS + 1)
             | st.lists(st.integers(0, 10), min_size=MAX_STOP_TOKEN_IDS - 1, max_size=MAX_STOP_TOKEN_IDS + 1)
             | st.just(["x" * MAX_STOP_STRING_CHARS]) | st.just(["x" * (MAX_STOP_STRING_CHARS + 1)])
             # logit_bias as a dict and as to_dict()'s pairs, at and past its bounds
             | st.dictionaries(st.integers(-2, 2**33), st.floats(-150, 150) | st.integers(-101, 101), max_size=4)
             | st.lists(st.tuples(st.integers(-1, 5), st.floats(allow_nan=True)), max_size=4)
             | st.dictionaries(st.integers(0, 5000), st.just(1.0), min_size=MAX_LOGIT_BIAS_TOKENS,
                               max_size=MAX_LOGIT_BIAS_TOKENS + 1))


@BOUNDED
@given(st.dictionaries(st.sampled_from(FIELDS), ANY_VALUE, max_size=6))
def test_any_values_are_accepted_or_refused_with_value_error_naming_a_field(values):
    try:
        params = SamplingParams(**values)
    except ValueError as e:
        assert str(e).split(" ", 1)[0].split("[", 1)[0] in FIELDS, str(e)
        return
    assert SamplingParams.from_dict(params.to_dict()) == params == params.clone()
    assert len(params.stop) <= MAX_STOP_STRINGS and all(0 < len(s) <= MAX_STOP_STRING_CHARS for s in params.stop)
    assert len(params.stop_token_ids) <= MAX_STOP_TOKEN_IDS
    assert params.logprobs is None or 0 <= params.logprobs <= MAX_LOGPROBS
    assert params.logit_bias is None or (0 < len(params.logit_bias) <= MAX_LOGIT_BIAS_TOKENS and all(
        type(t) is int and t >= 0 and type(b) is float and abs(b) <= MAX_ABS_LOGIT_BIAS
        for t, b in params.logit_bias.items()))
    assert params.allowed_token_ids is None or (
        len(params.allowed_token_ids) > 0 and all(type(t) is int and t >= 0 for t in params.allowed_token_ids))

"""Property tests of the OpenAI request parser (gateway.openai_api.protocol), the HTTP
edge's trust boundary: any body, JSON or not, at any depth and with any field values,
parses or is refused with ApiError (an HTTP 4xx naming the field), never anything else;
what parses builds GenerateInputs whose sampling parameters are valid."""
from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from common.engine.sampling_params import SamplingParams
from gateway.openai_api.errors import ApiError
from gateway.openai_api.protocol import CHAT_FIELDS, COMPLETION_FIELDS, parse_request
from tests.support.properties import BOUNDED, json_values

MESSAGE_VALUES = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool", "bot"]) | json_values},
                                       optional={"content": st.text(max_size=8) | json_values,
                                                 "name": json_values})
FIELD_VALUES = {"messages": st.lists(MESSAGE_VALUES | json_values, max_size=3),
                "prompt": st.text(max_size=8) | st.lists(st.integers(-2, 60_000), max_size=4) | json_values,
                "model": st.just("m") | json_values}


def bodies(fields: dict) -> st.SearchStrategy[dict]:
    """Objects with known fields at any values (and now and then an unknown field)."""
    names = sorted(fields) + ["not_a_field"]
    return st.dictionaries(st.sampled_from(names), st.none(), max_size=8).flatmap(
        lambda chosen: st.fixed_dictionaries({name: FIELD_VALUES.get(name, json_values) for name in chosen}))


def parse_or_refuse(body: bytes, chat: bool):
    try:
        parsed = parse_request(body, chat)
    except ApiError as e:
        assert 400 <= e.status < 500 and e.message, e
        return None
    for request in parsed.generate_inputs("id"):
        assert isinstance(request.sampling, SamplingParams) and request.sampling.n == 1
    return parsed


@BOUNDED
@given(st.booleans(), st.binary(max_size=64))
def test_any_bytes_parse_or_are_refused(chat, body):
    parse_or_refuse(body, chat)


@BOUNDED
@given(st.booleans(), json_values)
def test_any_json_value_parses_or_is_refused(chat, value):
    parse_or_refuse(json.dumps(value).encode(), chat)


@BOUNDED
@given(bodies(COMPLETION_FIELDS))
def test_completion_bodies_parse_or_are_refused(body):
    parse_or_refuse(json.dumps(body).encode(), chat=False)


@BOUNDED
@given(bodies(CHAT_FIELDS))
def test_chat_bodies_parse_or_are_refused(body):
    parse_or_refuse(json.dumps(body).encode(), chat=True)


@BOUNDED
@given(st.booleans(), st.integers(1, 200), st.sampled_from("[{"), st.integers(0, 40))
def test_deep_bodies_and_long_numbers_are_refused_not_crashing(chat, depth, bracket, digits):
    close = "]" if bracket == "[" else "}"
    inner = '"k": ' if bracket == "{" else ""
    body = '{"model": "m", "metadata": ' + (bracket + inner) * depth + "1" * max(digits, 1) + close * depth + "}"
    parse_or_refuse(body.encode(), chat)

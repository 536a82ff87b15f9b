"""Every tool-call parser streamed in any split (a property test): the content streamed plus
the calls at the end equal what the whole answer gives, and nothing of a call goes out as
content before it can be told apart from text."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.openai_api.tool_parsers import make_tool_parser

HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
MISTRAL_LISTED = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
MISTRAL_NAMED = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
PYTHONIC_CALLS = '[get_weather(city="Paris", days=2), get_time(zone="CET")]'
PHI4_CALLS = 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time"}]'
ANSWERS = {
    "hermes": ["Paris is sunny today.", "Let me check. " + HERMES_CALL, HERMES_CALL, HERMES_CALL + HERMES_CALL,
               "a < b but <tool_ is not a call", "<tool_call>{broken</tool_call>", "text <tool_cal", "ends with <",
               "Sure.\n\n" + HERMES_CALL + "\n", "\n" + HERMES_CALL],
    "llama3_json": ["Paris is sunny today.", LLAMA_CALL, " \n" + LLAMA_CALL, LLAMA_CALL + "; " + LLAMA_CALL,
                    "Sure: " + LLAMA_CALL, LLAMA_CALL + " trailing text", "{", "{broken", " ", "",
                    "a {b} c"],
    "mistral": ["Paris is sunny today.", MISTRAL_LISTED, "Let me check. " + MISTRAL_LISTED, MISTRAL_NAMED,
                MISTRAL_NAMED + MISTRAL_NAMED, "[TOOL_CALLS]", "text [TOOL_", "[TOOL_CALLS]get_weather[ARGS]{",
                "ends with ["],
    "pythonic": ["Paris is sunny today.", PYTHONIC_CALLS, " \n" + PYTHONIC_CALLS, "Sure: " + PYTHONIC_CALLS,
                 PYTHONIC_CALLS + " and text", "[", "[1, 2]", "[get_weather(", "", " "],
    "phi4_mini_json": ["Paris is sunny today.", PHI4_CALLS, "Let me check. " + PHI4_CALLS, PHI4_CALLS + " done",
                       "functools[", "functools[{broken]", "func", "text functools", "[1]"],
}
MARKERS = {"hermes": "<tool_call>", "llama3_json": "{", "mistral": "[TOOL_CALLS]", "pythonic": "[",
           "phi4_mini_json": "functools["}


@pytest.mark.parametrize("name", sorted(ANSWERS))
@settings(max_examples=200, deadline=None)
@given(data=st.data(), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_any_split_streams_what_the_whole_answer_gives(name, data, cuts):
    parser = make_tool_parser(name)
    answer = data.draw(st.sampled_from(ANSWERS[name]))
    points = sorted({min(c, len(answer)) for c in cuts})
    pieces = [answer[a:b] for a, b in zip([0, *points], [*points, len(answer)])]
    stream = parser.stream()
    sent = "".join(stream.feed(piece) for piece in pieces)
    rest, calls = stream.finish()
    content, expected_calls = parser.extract(answer)
    assert calls == expected_calls
    assert sent + rest == content
    assert MARKERS[name] not in sent or not expected_calls

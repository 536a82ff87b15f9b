"""Hermes' tool-call syntax read whole, and streamed in any split (a property test: the
content streamed plus the calls at the end equal what the whole answer gives)."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.openai_api.tool_parsers import ParsedCall, make_tool_parser

PARSER = make_tool_parser("hermes")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
WEATHER = ParsedCall("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}))


def test_calls_after_text_and_alone():
    assert PARSER.extract("Let me check. " + CALL) == ("Let me check. ", [WEATHER])
    assert PARSER.extract(CALL + "\n" + CALL.replace("Paris", "Rome")) == (
        "", [WEATHER, ParsedCall("get_weather", json.dumps({"city": "Rome", "unit": "celsius"}))])
    # a stop token may end the answer before the closing tag
    assert PARSER.extract(CALL.removesuffix("</tool_call>")) == ("", [WEATHER])
    # arguments already written as JSON text stay as they are
    assert PARSER.extract('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>') == (
        "", [ParsedCall("f", '{"a": 1}')])
    assert PARSER.extract('\n<tool_call>{"name": "f"}</tool_call>') == ("\n", [ParsedCall("f", "{}")])


def test_answers_without_a_readable_call_are_content():
    for text in ("Paris is sunny.", "<tool_call>{not json</tool_call>", '<tool_call>["f"]</tool_call>',
                 '<tool_call>{"arguments": {}}</tool_call>', CALL + '<tool_call>{"name": "g", '):
        assert PARSER.extract(text) == (text, [])


ANSWERS = st.sampled_from([
    "Paris is sunny today.", "Let me check. " + CALL, CALL, CALL + CALL, "a < b but <tool_ is not a call",
    "<tool_call>{broken</tool_call>", "text <tool_cal", "ends with <", "Sure.\n\n" + CALL + "\n", "\n" + CALL])


@settings(max_examples=300, deadline=None)
@given(answer=ANSWERS, cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_any_split_streams_what_the_whole_answer_gives(answer, cuts):
    points = sorted({min(c, len(answer)) for c in cuts})
    pieces = [answer[a:b] for a, b in zip([0, *points], [*points, len(answer)])]
    stream = PARSER.stream()
    sent = "".join(stream.feed(piece) for piece in pieces)
    rest, calls = stream.finish()
    content, expected_calls = PARSER.extract(answer)
    assert calls == expected_calls
    assert sent + rest == content
    # nothing of a call went out as content before it could be told apart from text
    assert "<tool_call>" not in sent or not expected_calls

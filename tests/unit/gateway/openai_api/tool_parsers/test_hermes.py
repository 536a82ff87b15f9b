"""Hermes' tool-call syntax read whole (streamed: test_streams.py)."""
from __future__ import annotations

import json

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

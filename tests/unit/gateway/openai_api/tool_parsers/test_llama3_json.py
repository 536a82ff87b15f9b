"""Llama 3's JSON tool calls read whole (streamed: test_streams.py)."""
from __future__ import annotations

import json

from gateway.openai_api.tool_parsers import ParsedCall, make_tool_parser

PARSER = make_tool_parser("llama3_json")
CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
WEATHER = ParsedCall("get_weather", json.dumps({"city": "Paris"}))


def test_calls_that_open_the_answer():
    assert PARSER.extract(CALL) == ("", [WEATHER])
    assert PARSER.extract("\n " + CALL + "; " + CALL.replace("Paris", "Rome") + "\n") == (
        "\n ", [WEATHER, ParsedCall("get_weather", json.dumps({"city": "Rome"}))])
    assert PARSER.extract('{"name": "f", "arguments": {"a": 1}}') == ("", [ParsedCall("f", '{"a": 1}')])
    assert PARSER.extract('{"name": "f"}') == ("", [ParsedCall("f", "{}")])


def test_answers_that_open_with_text_or_do_not_parse_are_content():
    for text in ("Paris is sunny.", "Sure: " + CALL, CALL + " and more text", '{"city": "Paris"}',
                 '{"name": 3, "parameters": {}}', '{"name": "f", "parameters": [1]}', CALL[:-3], "{"):
        assert PARSER.extract(text) == (text, [])

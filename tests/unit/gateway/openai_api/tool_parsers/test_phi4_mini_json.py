"""Phi-4-mini's functools[...] tool calls read whole (streamed: test_streams.py)."""
from __future__ import annotations

import json

from gateway.openai_api.tool_parsers import ParsedCall, make_tool_parser

PARSER = make_tool_parser("phi4_mini_json")


def test_the_calls_after_functools():
    text = ('Let me check. functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "ping"}]')
    assert PARSER.extract(text) == ("Let me check. ", [ParsedCall("get_weather", json.dumps({"city": "Paris"})),
                                                       ParsedCall("get_time", json.dumps({"zone": "CET"})),
                                                       ParsedCall("ping", "{}")])


def test_anything_else_is_content():
    for text in ("Paris is sunny.", "functools[", "functools[]", "functools[{broken}]", 'functools[{"name": 1}]',
                 'functools[{"name": "f", "arguments": [1]}]', "functools{}"):
        assert PARSER.extract(text) == (text, [])

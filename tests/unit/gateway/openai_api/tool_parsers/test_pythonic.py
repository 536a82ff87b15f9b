"""Pythonic tool calls read whole (streamed: test_streams.py)."""
from __future__ import annotations

import json

from gateway.openai_api.tool_parsers import ParsedCall, make_tool_parser

PARSER = make_tool_parser("pythonic")


def test_a_list_of_calls_with_literal_arguments():
    text = '[get_weather(city="Paris", days=2, metric=True), get_time(), plan(stops=["a", "b"], opts={"x": None})]'
    assert PARSER.extract(text) == ("", [
        ParsedCall("get_weather", json.dumps({"city": "Paris", "days": 2, "metric": True})),
        ParsedCall("get_time", "{}"),
        ParsedCall("plan", json.dumps({"stops": ["a", "b"], "opts": {"x": None}}))])
    assert PARSER.extract('\n [f(a=1)]\n') == ("\n ", [ParsedCall("f", '{"a": 1}')])


def test_anything_else_is_text_and_nothing_is_evaluated():
    for text in ("Paris is sunny.", "Sure: [f(a=1)]", "[f(a=1)] and more", "[]", "[1, 2]", "[f(1)]",
                 "[f(**kw)]", "[obj.method(a=1)]", "[f(a=g())]", "[f(a=__import__('os').getcwd())]", "[f(a=1",
                 "[" * 5000 + "]" * 5000):
        assert PARSER.extract(text) == (text, [])

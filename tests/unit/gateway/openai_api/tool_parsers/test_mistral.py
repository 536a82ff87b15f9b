"""Mistral's tool calls read whole (streamed: test_streams.py), and what a request it reads
asks of the instances."""
from __future__ import annotations

import json
import re

from gateway.openai_api.protocol import parse_request
from gateway.openai_api.tool_parsers import ParsedCall, make_tool_parser

PARSER = make_tool_parser("mistral")
WEATHER = ParsedCall("get_weather", json.dumps({"city": "Paris"}))
ROME = ParsedCall("get_weather", json.dumps({"city": "Rome"}))


def test_calls_before_v11_are_a_json_array_after_the_marker():
    assert PARSER.extract('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]') == (
        "", [WEATHER])
    both = ('Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    assert PARSER.extract(both) == ("Let me check.", [WEATHER, ROME])
    as_text = '[TOOL_CALLS]{"name": "f", "arguments": "{\\"a\\": 1}"}'  # one object, arguments as JSON text
    assert PARSER.extract(as_text) == ("", [ParsedCall("f", '{"a": 1}')])


def test_calls_from_v11_are_each_a_name_and_its_arguments():
    assert PARSER.extract('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}') == ("", [WEATHER])
    assert PARSER.extract('Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather{"city": "Rome"}'
                          ) == ("Sure. ", [WEATHER, ROME])


def test_answers_without_calls_or_with_broken_ones_are_content():
    for text in ("Paris is sunny.", "[TOOL_CALLS]", "[TOOL_CALLS] [", '[TOOL_CALLS][{"name": 3}]',
                 "[TOOL_CALLS]get_weather[ARGS]{broken", "[TOOL_CALLS]get_weather", '[TOOL_CALLS][ARGS]{"a": 1}',
                 '[TOOL_CALLS]get_weather[ARGS][1, 2]', "[TOOL_CALLS][]"):
        assert PARSER.extract(text) == (text, [])


def test_a_request_it_reads_keeps_special_tokens_and_its_calls_get_mistral_ids():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": tools}
    auto = parse_request(json.dumps(body).encode(), True, PARSER)
    assert auto.sampling.skip_special_tokens is False  # [TOOL_CALLS] is a special token
    assert re.fullmatch(r"[A-Za-z0-9]{9}", auto.tool_choice.new_id())
    forced = parse_request(json.dumps({**body, "tool_choice": "required"}).encode(), True, PARSER)
    assert forced.sampling.skip_special_tokens is True and re.fullmatch(r"[A-Za-z0-9]{9}", forced.tool_choice.new_id())
    hermes = parse_request(json.dumps(body).encode(), True, make_tool_parser("hermes"))
    assert hermes.sampling.skip_special_tokens is True and hermes.tool_choice.new_id().startswith("chatcmpl-tool-")

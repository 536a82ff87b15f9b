"""Llama 3.1 / 3.2's JSON tool calls: an answer that opens with one or more JSON objects
{"name", "parameters"} (3.2 separates several with ";"). The <|python_tag|> the model may write
first is a special token, gone from the text. An answer that opens with anything else is text."""
from __future__ import annotations

import json

from gateway.openai_api.tool_parsers.base import ParsedCall, ToolCallParser, json_call

_DECODER = json.JSONDecoder()


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    start_marker = "{"
    opens_answer = True

    def extract(self, text: str) -> tuple[str, list[ParsedCall]]:
        start = len(text) - len(text.lstrip())
        if not text.startswith(self.start_marker, start):
            return text, []
        calls, position = [], start
        while position < len(text):
            try:
                call, position = _DECODER.raw_decode(text, position)
            except ValueError:
                return text, []
            parsed = json_call(call, ("parameters", "arguments"))
            if parsed is None:
                return text, []
            calls.append(parsed)
            while position < len(text) and text[position] in " \t\n;":  # between calls, after the last
                position += 1
        return text[:start], calls

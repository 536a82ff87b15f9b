"""Phi-4-mini's tool calls: `functools[` then the calls as JSON objects {"name", "arguments"}
(or "parameters"), the list closed by `]`; the text before it is the content."""
from __future__ import annotations

import json

from gateway.openai_api.tool_parsers.base import ParsedCall, ToolCallParser, json_call

_DECODER = json.JSONDecoder()


class Phi4MiniJsonParser(ToolCallParser):
    name = "phi4_mini_json"
    start_marker = "functools["

    def extract(self, text: str) -> tuple[str, list[ParsedCall]]:
        start = text.find(self.start_marker)
        if start < 0:
            return text, []
        try:
            listed, _ = _DECODER.raw_decode(text, start + len(self.start_marker) - 1)  # from its "["
        except ValueError:
            return text, []
        if not isinstance(listed, list) or not listed:
            return text, []
        calls = [json_call(call, ("arguments", "parameters")) for call in listed]
        return (text[:start], calls) if None not in calls else (text, [])

"""Hermes' tool-call syntax, which Qwen 2.5 / 3, Hermes 2 / 3 and many fine-tunes write:
each call a JSON object {"name", "arguments"} between <tool_call> and </tool_call>."""
from __future__ import annotations

import json
import re

from gateway.openai_api.tool_parsers.base import ParsedCall, ToolCallParser, json_call

# A call's closing tag may be missing on the last one (the answer ended at a stop token).
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class HermesParser(ToolCallParser):
    name = "hermes"
    start_marker = "<tool_call>"

    def extract(self, text: str) -> tuple[str, list[ParsedCall]]:
        start = text.find(self.start_marker)
        if start < 0:
            return text, []
        calls = []
        for match in _CALL.finditer(text, start):
            body = match.group(1) if match.group(1) is not None else match.group(2)
            try:
                call = json.loads(body)
            except ValueError:
                return text, []
            parsed = json_call(call)
            if parsed is None:
                return text, []
            calls.append(parsed)
        return text[:start], calls

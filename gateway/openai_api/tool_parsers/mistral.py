"""Mistral's tool calls, after its special token [TOOL_CALLS]: a JSON array of {"name",
"arguments"} (tokenizers before v11: Mistral 7B Instruct v0.3, Nemo), or from v11 on
(Mistral Small 3.x, Magistral, Devstral) each call as its name, [ARGS] (or nothing) and its
JSON arguments, several calls each after a [TOOL_CALLS] of its own.

The marker is a special token that detokenization would drop, so a request this parser reads
keeps special tokens in its text (vLLM's adjustment); and Mistral's chat templates accept a
call back only with an id of 9 letters and digits, so its calls get such ids."""
from __future__ import annotations

import json
import secrets
import string

from gateway.openai_api.tool_parsers.base import ParsedCall, ToolCallParser, json_call

_DECODER = json.JSONDecoder()
_ARGS = "[ARGS]"
_ID_ALPHABET = string.ascii_letters + string.digits


class MistralParser(ToolCallParser):
    name = "mistral"
    start_marker = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def extract(self, text: str) -> tuple[str, list[ParsedCall]]:
        start = text.find(self.start_marker)
        if start < 0:
            return text, []
        segments = [s.strip() for s in text[start:].split(self.start_marker) if s.strip()]
        if not segments:
            return text, []
        calls = _listed_calls(segments[0]) if segments[0][0] in "[{" else _named_calls(segments)
        return (text[:start], calls) if calls else (text, [])


def _listed_calls(body: str) -> list[ParsedCall]:
    """Before v11: [{"name", "arguments"}, ...] (or one such object); [] unless all parse."""
    try:
        listed, _ = _DECODER.raw_decode(body)
    except ValueError:
        return []
    listed = [listed] if isinstance(listed, dict) else listed
    if not isinstance(listed, list) or not listed:
        return []
    calls = [json_call(call) for call in listed]
    return [] if None in calls else calls


def _named_calls(segments: list[str]) -> list[ParsedCall]:
    """From v11: each segment `name[ARGS]{...}` or `name{...}`; [] unless all parse."""
    calls = []
    for segment in segments:
        name, separator, rest = segment.partition(_ARGS)
        if not separator:
            brace = segment.find("{")
            name, rest = (segment[:brace], segment[brace:]) if brace > 0 else ("", "")
        name = name.strip()
        try:
            arguments, _ = _DECODER.raw_decode(rest.strip())
        except ValueError:
            return []
        if not name or not isinstance(arguments, dict):
            return []
        calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False)))
    return calls

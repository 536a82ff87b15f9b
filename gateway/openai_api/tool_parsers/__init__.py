"""Parsers of models' own tool-call syntax, one per file behind base.ToolCallParser, for
tool_choice "auto" (`pdserve gateway --tool-call-parser NAME`)."""
from __future__ import annotations

from gateway.openai_api.tool_parsers.base import ParsedCall, ToolCallParser, ToolCallStream
from gateway.openai_api.tool_parsers.hermes import HermesParser
from gateway.openai_api.tool_parsers.llama3_json import Llama3JsonParser
from gateway.openai_api.tool_parsers.mistral import MistralParser
from gateway.openai_api.tool_parsers.phi4_mini_json import Phi4MiniJsonParser
from gateway.openai_api.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser
    for parser in (HermesParser, Llama3JsonParser, MistralParser, Phi4MiniJsonParser, PythonicParser)}


def make_tool_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)}")
    return PARSERS[name]()


__all__ = ["PARSERS", "ParsedCall", "ToolCallParser", "ToolCallStream", "make_tool_parser"]

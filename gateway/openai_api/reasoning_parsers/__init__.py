"""Parsers that split a reasoning model's thinking from its answer, one per file behind
base.ReasoningParser (`pdserve gateway --reasoning-parser NAME`): chat answers then carry the
thinking as `reasoning` (vLLM's field) and the rest as content."""
from __future__ import annotations

from gateway.openai_api.reasoning_parsers.base import ReasoningParser, ReasoningStream, may_reason
from gateway.openai_api.reasoning_parsers.deepseek_r1 import DeepSeekR1Parser
from gateway.openai_api.reasoning_parsers.qwen3 import Qwen3Parser

PARSERS: dict[str, type[ReasoningParser]] = {parser.name: parser for parser in (DeepSeekR1Parser, Qwen3Parser)}


def make_reasoning_parser(name: str) -> ReasoningParser:
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(PARSERS)}")
    return PARSERS[name]()


__all__ = ["PARSERS", "ReasoningParser", "ReasoningStream", "make_reasoning_parser", "may_reason"]

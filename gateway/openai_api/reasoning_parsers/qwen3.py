"""Qwen3 (and QwQ-style templates that leave <think> to the model): an answer reasons only
when it opens with <think>; with thinking switched off (`chat_template_kwargs:
{"enable_thinking": false}`) it is all content."""
from __future__ import annotations

from gateway.openai_api.reasoning_parsers.base import ReasoningParser


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    opens_in_prompt = False

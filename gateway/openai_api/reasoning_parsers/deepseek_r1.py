"""DeepSeek-R1 and its distills: the chat template opens <think> in the prompt, so the answer
is reasoning until </think> (a leading <think>, which older templates leave to the model, is
dropped)."""
from __future__ import annotations

from gateway.openai_api.reasoning_parsers.base import ReasoningParser


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    opens_in_prompt = True

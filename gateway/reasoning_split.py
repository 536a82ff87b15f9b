"""A gRPC Generate call's thinking split off its text (output.split_reasoning) by the gateway's
--reasoning-parser, the parsers the HTTP API's chat answers use: streamed, each delta's text
becomes its answer part and `reasoning` its thinking, a possible marker held back until the
next delta tells; whole (Generate), the same over the one merged delta."""
from __future__ import annotations

from common.service.errors import invalid
from gateway.openai_api.reasoning_parsers import ReasoningParser, may_reason
from gateway.types import GenerateInput, GenerationDelta


class ReasoningSplit:
    def __init__(self, parser: ReasoningParser, request: GenerateInput):
        # An answer constrained from its first token holds no thinking: all of it is text.
        self._stream = parser.stream() if may_reason(request.sampling.structured_outputs) else None

    def apply(self, delta: GenerationDelta) -> GenerationDelta:
        """delta with its text split (in place); the last delta (finish_reason set) also
        carries what was held back."""
        if self._stream is None:
            return delta
        reasoning, content = self._stream.feed(delta.text)
        if delta.finish_reason is not None:
            more_reasoning, more_content = self._stream.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        delta.reasoning, delta.text = reasoning, content
        return delta


def reasoning_split(parser: ReasoningParser | None, request: GenerateInput) -> ReasoningSplit | None:
    """The request's split, None where it asks for none; INVALID_ARGUMENT where it asks and the
    gateway has no parser."""
    if not request.split_reasoning:
        return None
    if parser is None:
        raise invalid("output.split_reasoning needs the gateway's --reasoning-parser (the served model's "
                      "thinking markers)")
    return ReasoningSplit(parser, request)

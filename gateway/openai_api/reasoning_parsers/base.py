"""What every reasoning parser offers (`--reasoning-parser`): a reasoning model writes its
thinking between two markers before the answer, and the parser splits the two, for the whole
answer and piece by piece as it streams."""
from __future__ import annotations

from abc import ABC
from enum import Enum

from common.engine.structured_output.params import StructuredOutputsParams
from gateway.openai_api.text_markers import held_back


def may_reason(constraint: StructuredOutputsParams | None) -> bool:
    """Whether an answer under this constraint may hold thinking: not one constrained from its
    first token (a parser whose thinking opens in the prompt would take all of it for
    reasoning); yes unconstrained, or constrained only after the thinking ends."""
    return constraint is None or bool(constraint.start_after_token_ids)


class ReasoningParser(ABC):
    name: str  # what --reasoning-parser takes
    start_marker = "<think>"
    end_marker = "</think>"
    # True: the chat template opened the reasoning in the prompt, so the answer starts in it
    # whether or not it writes the start marker; False: only an answer that opens with the
    # start marker reasons (thinking may be switched off).
    opens_in_prompt: bool

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None for a part it does not have. Reasoning
        that never ends (the answer was cut short) is all reasoning."""
        body = text.lstrip()
        if body.startswith(self.start_marker):
            body = body[len(self.start_marker):]
        elif self.opens_in_prompt:
            body = text
        else:
            return None, text
        reasoning, ended, content = body.partition(self.end_marker)
        return reasoning, (content or None) if ended else None

    def closed_in(self, prompt: str) -> bool:
        """The prompt (the rendered chat) closed the reasoning: its last marker is the end
        marker (thinking switched off in the template, or an answer continued after it). An
        answer to such a prompt does not think, so a constraint applies from its first token."""
        end = prompt.rfind(self.end_marker)
        return end >= 0 and end > prompt.rfind(self.start_marker)

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)


class _State(Enum):
    START = 0  # not yet known whether the answer opens with the start marker
    REASONING = 1
    CONTENT = 2


class ReasoningStream:
    """One streamed answer: feed() gives the (reasoning, content) that may go out now; a
    possible prefix of a marker is held back until the next piece tells."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self.position = 0  # characters of text already given out (or dropped: markers)
        self.state = _State.START

    def feed(self, piece: str) -> tuple[str, str]:
        self.text += piece
        reasoning = ""
        if self.state is _State.START and not self._decide():
            return "", ""
        if self.state is _State.REASONING:
            end = self.text.find(self.parser.end_marker, self.position)
            if end < 0:
                stop = len(self.text) - held_back(self.text[self.position:], self.parser.end_marker)
                reasoning, self.position = self.text[self.position:stop], stop
                return reasoning, ""
            reasoning = self.text[self.position:end]
            self.position, self.state = end + len(self.parser.end_marker), _State.CONTENT
        content, self.position = self.text[self.position:], len(self.text)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, as (reasoning, content)."""
        if self.state is _State.START:  # nothing but whitespace or the start of the marker
            self.state = _State.REASONING if self.parser.opens_in_prompt else _State.CONTENT
        rest, self.position = self.text[self.position:], len(self.text)
        return (rest, "") if self.state is _State.REASONING else ("", rest)

    def _decide(self) -> bool:
        stripped = self.text.lstrip()
        marker = self.parser.start_marker
        if stripped.startswith(marker):
            self.state, self.position = _State.REASONING, len(self.text) - len(stripped) + len(marker)
        elif marker.startswith(stripped):
            return False  # whitespace, or a prefix of the marker: the next piece tells
        else:
            self.state = _State.REASONING if self.parser.opens_in_prompt else _State.CONTENT
        return True


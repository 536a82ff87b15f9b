"""What every tool-call parser offers (tool_choice "auto"): a model writes its calls in its
own syntax after any text, and a parser finds where they begin and reads them.

Streaming is the same for every parser: text streams as content until the parser's start
marker could be beginning (a possible prefix of it is held back), and from the marker on the
answer is held and read whole at the end, so calls come with the last chunk, each complete.
"""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from gateway.openai_api.text_markers import held_back


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


def json_call(call: Any, argument_keys: tuple[str, ...] = ("arguments",)) -> ParsedCall | None:
    """A decoded JSON call {"name": ..., <the first of argument_keys present>: an object or its
    JSON text} as a ParsedCall (no arguments: {}); None where it is not one."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = next((call[key] for key in argument_keys if key in call), {})
    if not isinstance(arguments, (dict, str)):
        return None
    return ParsedCall(call["name"], arguments if isinstance(arguments, str)
                      else json.dumps(arguments, ensure_ascii=False))


def new_call_id() -> str:
    """A tool call's id (vLLM's form)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallParser(ABC):
    name: str  # what --tool-call-parser takes
    start_marker: str  # text the calls begin with; what comes before it is content
    # True: calls can only open the answer (after whitespace); an answer that starts with
    # anything else is text throughout, markers and all.
    opens_answer: bool = False
    # True: the start marker is a special token, so the requests this parser reads keep
    # special tokens in their text (skip_special_tokens false).
    keeps_special_tokens: bool = False

    def new_call_id(self) -> str:
        """An id for one of the calls this parser reads."""
        return new_call_id()

    @abstractmethod
    def extract(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(content, calls) of a whole answer: the text before the calls and the calls, or
        `text` and no calls when it has none or they do not parse."""

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)


class ToolCallStream:
    """One streamed answer: feed() gives the content that may go out now, finish() the rest
    of the content and the calls."""

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self.text = ""  # the whole answer so far
        self.num_sent = 0  # characters of it already sent as content
        self.in_calls = False
        self.plain = False  # an opens_answer parser's answer that opened with text

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.in_calls:
            return ""
        marker = self.parser.start_marker
        if self.plain:
            return self._send_until(len(self.text))
        if self.parser.opens_answer:
            stripped = self.text.lstrip()
            if stripped.startswith(marker):
                self.in_calls = True
                return self._send_until(len(self.text) - len(stripped))
            if marker.startswith(stripped):  # whitespace, or the marker's start: the next piece tells
                return ""
            self.plain = True
            return self._send_until(len(self.text))
        start = self.text.find(marker, max(0, self.num_sent - len(marker) + 1))
        if start >= 0:
            self.in_calls = True
            return self._send_until(start)
        return self._send_until(len(self.text) - held_back(self.text, marker))

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """(content not yet sent, calls)."""
        if not self.in_calls:
            return self._send_until(len(self.text)), []
        content, calls = self.parser.extract(self.text)
        if not calls:  # the calls did not parse: what was held back goes out as content
            return self._send_until(len(self.text)), []
        return self._send_until(len(content)), calls

    def _send_until(self, end: int) -> str:
        end = max(end, self.num_sent)
        piece, self.num_sent = self.text[self.num_sent:end], end
        return piece


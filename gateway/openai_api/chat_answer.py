"""One chat choice's generated text -> its message: the reasoning (the server's reasoning
parser), the tool calls (a forced call, or the server's tool parser under tool_choice "auto")
and the content, whole (`message`) or piece by piece as it streams (`delta`).

The reasoning comes first in the text and is split off first; what follows it is the
answer, which a tool parser reads. A constrained answer (a forced call's JSON, a structured
output) held back until the thinking ends (the server's reasoning parser; see
OpenAIServer._constrain_after_reasoning) is read for reasoning too; one that follows its
grammar from the first token (the prompt closed the thinking) has none.
"""
from __future__ import annotations

from gateway.openai_api.protocol import ParsedRequest
from gateway.openai_api.reasoning_parsers import ReasoningParser, may_reason
from gateway.openai_api.tools import parsed_calls


class ChatAnswer:
    def __init__(self, request: ParsedRequest, reasoning_parser: ReasoningParser | None):
        self.role = request.response_role
        self.echo = request.chat_echo
        self.tool_choice = request.tool_choice
        self.forced = request.tool_choice.forced if request.forced_tool_call else None
        tool_parser = self.tool_choice.parser if self.tool_choice is not None else None
        self.reasoning_parser = reasoning_parser if may_reason(request.sampling.structured_outputs) else None
        self.include_reasoning = request.include_reasoning
        self.reasoning_stream = self.reasoning_parser.stream() if self.reasoning_parser else None
        self.tool_stream = tool_parser.stream() if tool_parser is not None else None
        self.forced_text = ""  # "required": the array so far, parsed whole at the end
        self.call_started = False  # named: the call's first delta went out
        self.made_calls = False  # a parser read calls: finish_reason "tool_calls"

    def message(self, text: str) -> dict:
        message: dict = {"role": self.role}
        if self.reasoning_parser is not None:
            reasoning, text = self.reasoning_parser.split(text)
            text = text or ""
            if reasoning is not None and self.include_reasoning:
                message["reasoning"] = reasoning
        if self.forced is not None:
            if self.reasoning_parser is not None and not text:  # cut short while thinking: no call yet
                return {**message, "content": None}
            calls = self.tool_choice.tool_calls(text)
            if calls is None:  # not a complete call (cut short): the text as it is
                return {**message, "content": text}
            return {**message, "content": None, "tool_calls": calls}
        if self.tool_stream is not None:
            content, parsed = self.tool_stream.parser.extract(text)
            if parsed:
                self.made_calls = True
                content = self.echo + content
                return {**message, "content": content if content.strip() else None,
                        "tool_calls": parsed_calls(parsed, self.tool_choice.new_id)}
        return {**message, "content": self.echo + text}

    def delta(self, piece: str, finished: bool, first: bool) -> dict:
        """The delta of one streamed piece (the role with the first). A named call streams its
        arguments as they come; a "required" array, and calls a parser reads, come whole
        with the last piece."""
        out = {"role": self.role} if first else {}
        reasoning, answer = "", piece
        if self.reasoning_stream is not None:
            reasoning, answer = self.reasoning_stream.feed(piece)
            if finished:
                more_reasoning, more_answer = self.reasoning_stream.finish()
                reasoning, answer = reasoning + more_reasoning, answer + more_answer
        if reasoning and self.include_reasoning:
            out["reasoning"] = reasoning
        if self.forced == "named":
            return out | self._named_delta(answer, first)
        if self.forced == "required":
            return out | self._required_delta(answer, finished, first)
        calls = []
        if self.tool_stream is not None:
            answer = self.tool_stream.feed(answer)
            if finished:
                rest, calls = self.tool_stream.finish()
                answer += rest
        content = (self.echo if first else "") + answer
        if content or (first and not out.get("reasoning")):
            out["content"] = content
        if calls:
            self.made_calls = True
            out["tool_calls"] = [{"index": k, **call}
                                 for k, call in enumerate(parsed_calls(calls, self.tool_choice.new_id))]
        return out

    def _named_delta(self, answer: str, first: bool) -> dict:
        """The call opens with the answer's first piece (after any thinking: the first piece
        of all without a reasoning parser), its arguments streaming as they come."""
        if not self.call_started:
            if not answer and (self.reasoning_stream is not None or not first):
                return {"content": None} if first else {}
            self.call_started = True
            call = self.tool_choice.tool_calls(answer)[0]
            return {"content": None, "tool_calls": [{"index": 0, **call}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": answer}}]} if answer else {}

    def _required_delta(self, answer: str, finished: bool, first: bool) -> dict:
        self.forced_text += answer
        if not finished:
            return {"content": None} if first else {}
        calls = self.tool_choice.tool_calls(self.forced_text)
        if calls is None:  # not a complete array (cut short): the text as it is
            return {"content": self.forced_text}
        return {"content": None, "tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}

"""Pythonic tool calls, which Llama 3.2 (with its pythonic template) and Llama 4 write: the
whole answer a Python list of calls with keyword arguments, `[get_weather(city="Paris"),
get_time()]`. Read with `ast` (nothing is evaluated); arguments must be literals. An answer
that is anything else, or does not parse, is text."""
from __future__ import annotations

import ast
import json

from gateway.openai_api.tool_parsers.base import ParsedCall, ToolCallParser


class PythonicParser(ToolCallParser):
    name = "pythonic"
    start_marker = "["
    opens_answer = True

    def extract(self, text: str) -> tuple[str, list[ParsedCall]]:
        body = text.strip()
        if not body.startswith(self.start_marker):
            return text, []
        try:
            listed = ast.parse(body, mode="eval").body
            if not isinstance(listed, ast.List) or not listed.elts:
                return text, []
            calls = [_call(node) for node in listed.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return text, []
        return text[:len(text) - len(text.lstrip())], calls


def _call(node: ast.expr) -> ParsedCall:
    """One `name(key=literal, ...)`; ValueError for anything else."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("not a call by name with keyword arguments")
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            raise ValueError("not a keyword argument")
        arguments[keyword.arg] = ast.literal_eval(keyword.value)
    return ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False))

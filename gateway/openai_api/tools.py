"""OpenAI's function calling on chat completions: `tools`, `tool_choice`,
`parallel_tool_calls`, the assistant and "tool" turns of a conversation that used them, and
the `tool_calls` of an answer.

A forced call is a structured output, as in vLLM: a named function (`tool_choice:
{"type": "function", "function": {"name"}}`) constrains the answer to that function's
parameters schema, and `"required"` to a JSON array of `{"name", "parameters"}` calls of the
listed functions (one call when `parallel_tool_calls` is false). The answer then comes back
as `message.tool_calls` (content null, finish_reason "stop", as OpenAI answers a forced
call). `"auto"` (OpenAI's default when tools are sent) lets the model answer in text or
call in its own syntax, which a parser of that syntax reads (`--tool-call-parser`,
tool_parsers/; as vLLM's `--enable-auto-tool-choice --tool-call-parser`): calls come back as
tool_calls with finish_reason "tool_calls". Without a parser "auto" is refused with a 400
saying what to send instead. With `"none"` the tools are not listed in the prompt (vLLM's
default).
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.engine.structured_output.params import StructuredOutputsParams
from common.text.chat_template import MAX_TOOLS
from gateway.openai_api.errors import invalid_field
from gateway.openai_api.structured_outputs import checked_later
from gateway.openai_api.tool_parsers import ParsedCall, ToolCallParser
from gateway.openai_api.tool_parsers.base import new_call_id

MAX_TOOL_CALLS_PER_MESSAGE = 128
# OpenAI's rule for function names; it keeps them safe to place in a schema's enum and a prompt.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_FUNCTION_NAME_SCHEMA = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_TOOL_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["type", "function"], "properties": {
    "type": {"enum": ["function"]},
    "function": {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
        "name": _FUNCTION_NAME_SCHEMA, "description": {"type": ["string", "null"]},
        "parameters": {"type": ["object", "null"]}, "strict": {"type": ["boolean", "null"]}}}}}
_NAMED_CHOICE_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["type", "function"],
                        "properties": {"type": {"enum": ["function"]}, "function": {
                            "type": "object", "additionalProperties": False, "required": ["name"],
                            "properties": {"name": _FUNCTION_NAME_SCHEMA}}}}
TOOL_CALL_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "type", "function"],
                    "properties": {"id": {"type": "string"}, "type": {"enum": ["function"]}, "function": {
                        "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                        "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}

FIELDS = {
    "tools": checked_later({"type": "array", "maxItems": MAX_TOOLS, "items": _TOOL_SCHEMA,
                            "description": "functions the model may call; names unique"}),
    "tool_choice": checked_later({"anyOf": [{"enum": ["none", "required", "auto"]}, _NAMED_CHOICE_SCHEMA],
                                  "description": "\"auto\" needs the server's --tool-call-parser; without it "
                                                 "send \"required\" or a named function"}),
}


@dataclass(frozen=True)
class ToolChoice:
    """What a chat request's tool fields ask for."""
    tools: list[dict] | None  # listed in the prompt by the template
    forced: str | None = None  # "named", "required" or None (the answer is text)
    function_name: str | None = None  # named: the function
    constraint: StructuredOutputsParams | None = None  # forced: the answer's shape
    parser: ToolCallParser | None = None  # "auto": reads calls out of the answer
    # Makes each call's id: the server's parser's form where it has one (Mistral's templates
    # take back only their own), forced calls included.
    new_id: Callable[[], str] = new_call_id

    def tool_calls(self, text: str) -> list[dict] | None:
        """The answer `text` as OpenAI's tool_calls; None where it is not a complete call
        (an answer cut short by max_tokens), which then comes back as content."""
        if self.forced == "named":
            return [_call(self.function_name, text, self.new_id())]
        try:
            calls = json.loads(text)
        except ValueError:
            return None
        if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
            return None
        return [_call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False), self.new_id())
                for c in calls]


def parsed_calls(calls: list[ParsedCall], new_id: Callable[[], str]) -> list[dict]:
    """Calls a parser read ("auto"), as OpenAI's tool_calls."""
    return [_call(call.name, call.arguments, new_id()) for call in calls]


def _call(name: str | None, arguments: str, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_choice_of(values: dict[str, Any], parser: ToolCallParser | None = None) -> ToolChoice | None:
    """The request's tools and what it forces; None when it sends no tools. `parser`: the
    server's for "auto", if it has one. A 400 naming the field for what is malformed,
    unknown or refused."""
    tools = checked_tools(values["tools"]) if "tools" in values else None
    choice = values.get("tool_choice", "auto" if tools else "none")
    if choice == "none":
        return None if tools is None else ToolChoice(tools=None)
    if not tools:
        raise invalid_field("tool_choice", f"{json.dumps(choice)} needs tools to choose from")
    new_id = parser.new_call_id if parser is not None else new_call_id
    if choice == "auto" and parser is not None:
        return ToolChoice(tools=tools, parser=parser, new_id=new_id)
    if choice == "auto":
        raise invalid_field("tool_choice", "\"auto\" (the default when tools are sent) needs a parser of the "
                                           "model's own tool-call syntax, which this server was not started "
                                           "with (--tool-call-parser): send "
                                           "\"required\", a named function ({\"type\": \"function\", \"function\": "
                                           "{\"name\": ...}}) or \"none\"", code="unsupported_value")
    by_name = {tool["function"]["name"]: tool["function"] for tool in tools}
    if choice == "required":
        one = values.get("parallel_tool_calls") is False
        return ToolChoice(tools=tools, forced="required", constraint=_constraint(_calls_schema(by_name, one)),
                          new_id=new_id)
    name = _named(choice)
    if name not in by_name:
        raise invalid_field("tool_choice.function.name", f"{name!r} is not one of the tools "
                                                         f"({', '.join(sorted(by_name))})")
    return ToolChoice(tools=tools, forced="named", function_name=name,
                      constraint=_constraint(by_name[name].get("parameters") or _EMPTY_PARAMETERS), new_id=new_id)


def checked_tools(value: Any) -> list[dict]:
    """`tools`, each checked; a 400 naming what is wrong."""
    if not isinstance(value, list):
        raise invalid_field("tools", "must be an array of {\"type\": \"function\", \"function\": {...}}")
    if len(value) > MAX_TOOLS:
        raise invalid_field("tools", f"{len(value)} tools, more than the limit of {MAX_TOOLS}")
    names: set[str] = set()
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise invalid_field(param, "must be {\"type\": \"function\", \"function\": {\"name\", ...}}")
        unknown = sorted(set(tool) - {"type", "function"}) or sorted(
            set(tool["function"]) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise invalid_field(f"{param}.{unknown[0]}" if unknown[0] in tool else f"{param}.function.{unknown[0]}",
                                "unknown field", code="unknown_field")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise invalid_field(f"{param}.function.name", "must be 1 to 64 letters, digits, '_' or '-'")
        if name in names:
            raise invalid_field(f"{param}.function.name", f"{name!r} is listed twice")
        names.add(name)
        for field, kinds, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema object"),
                                   ("strict", bool, "a boolean")):
            if function.get(field) is not None and not isinstance(function[field], kinds):
                raise invalid_field(f"{param}.function.{field}", f"must be {what}")
    return value


def _named(choice: Any) -> str:
    if not isinstance(choice, dict):
        raise invalid_field("tool_choice", f"must be \"none\", \"required\" or {{\"type\": \"function\", "
                                           f"\"function\": {{\"name\": ...}}}}, got {json.dumps(choice)}")
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid_field("tool_choice", "a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}")
    return function["name"]


def _calls_schema(functions: dict[str, dict], one: bool) -> dict:
    """An array of calls, each one of the functions with its own parameters; the functions'
    $defs hoisted to the top, where their "#/$defs/..." references point."""
    defs: dict[str, Any] = {}
    variants = []
    for name, function in functions.items():
        parameters = dict(function.get("parameters") or _EMPTY_PARAMETERS)
        for key, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, definition) != definition:
                raise invalid_field("tools", f"two tools define $defs.{key} differently; \"required\" puts "
                                             f"every tool's definitions in one schema")
        variants.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                          "parameters": parameters},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if one:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _constraint(schema: dict) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as e:  # "structured_outputs.json <what is wrong>"
        raise invalid_field("tools", str(e).removeprefix("structured_outputs.json ")) from None


def message_tool_fields(param: str, role: str, values: dict[str, Any]) -> dict[str, Any]:
    """A conversation turn's tool fields, checked: an assistant turn's tool_calls, a tool
    turn's tool_call_id."""
    fields: dict[str, Any] = {}
    calls = values.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise invalid_field(f"{param}.tool_calls", "only an assistant turn makes tool calls")
        if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS_PER_MESSAGE:
            raise invalid_field(f"{param}.tool_calls", f"must be an array of at most {MAX_TOOL_CALLS_PER_MESSAGE} "
                                                       f"calls")
        fields["tool_calls"] = [_tool_call(f"{param}.tool_calls[{j}]", call) for j, call in enumerate(calls)]
    call_id = values.get("tool_call_id")
    if role == "tool":
        if not isinstance(call_id, str):
            raise invalid_field(f"{param}.tool_call_id", "is required on a tool turn: the id of the call it "
                                                         "answers", code="missing_field")
        fields["tool_call_id"] = call_id
    elif call_id is not None:
        raise invalid_field(f"{param}.tool_call_id", "only a tool turn answers a call")
    return fields


def _tool_call(param: str, call: Any) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if (not isinstance(call, dict) or not isinstance(call.get("id"), str) or call.get("type", "function") != "function"
            or not isinstance(function, dict) or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)):
        raise invalid_field(param, "must be {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}} "
                                   "with strings")
    return {"id": call["id"], "type": "function",
            "function": {"name": function["name"], "arguments": function["arguments"]}}

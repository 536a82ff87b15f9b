"""OpenAI's Responses API (POST /v1/responses; GET and DELETE /v1/responses/{id}) over the chat path.

A Responses request is written as the chat completion it means (`ResponsesRequest.chat_body`):
`instructions` is the first system message; `input` the messages after it (a string is one
user message; an item list holds messages, whose parts are input_text / output_text,
`function_call` items, the assistant's tool calls, and `function_call_output` items, tool
messages); with `previous_response_id` the stored conversation comes before them (its
instructions do not carry over, as OpenAI's do not). `max_output_tokens`, `text.format`,
function `tools` and `tool_choice` take their chat names. The chat path then runs it as it
runs any chat completion (placement, structured outputs, tool and reasoning parsers), and
`response_object` writes the chat answer back as a Response: a reasoning item, a message
with one output_text part, function_call items; status "incomplete" where
max_output_tokens cut it short. A stream is the Responses events (`ResponseEvents`).

`include: ["message.output_text.logprobs"]` (or `top_logprobs` alone) puts the chat
answer's token logprobs on the message's output_text, with top_logprobs alternatives each.
`truncation: "auto"` drops the conversation's oldest turns until the prompt fits the model
(the server tokenizes it as generation will).

A stored response (`store`, default true) lives in this gateway's memory (`ResponseStore`:
the newest MAX_STORED_RESPONSES, at most MAX_STORED_CHARS of conversation in all): a
gateway restart or another gateway replica does not know it. `background: true` (with
store, without stream) answers at once with the response `queued`; it runs on, read back
with GET (`in_progress`, then `completed` / `incomplete` / `failed`) and stopped with
`POST /v1/responses/{id}/cancel` (`cancelled`). Built-in tools (web search, files, code),
images and files as input and the like are refused with a 400 naming the field.
"""
from __future__ import annotations

import collections
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from gateway.openai_api.errors import ApiError, invalid_field
from gateway.openai_api.protocol import (
    COMMON_FIELDS,
    UINT32_MAX,
    boolean,
    checked_fields,
    described,
    integer,
    neutral,
    number,
    obj,
    parse_body,
    string,
)
from gateway.openai_api.responses import ResponseBuilder, json_bytes
from gateway.openai_api.structured_outputs import checked_later
from gateway.types import GenerationDelta

MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 64 * 1024 * 1024
MAX_INPUT_ITEMS = 2048


@described({"anyOf": [{"type": "string"}, {"type": "array", "maxItems": MAX_INPUT_ITEMS, "items": {"type": "object"}}],
            "description": "a user message, or items: messages (content a string or input_text / output_text "
                           "parts), function_call and function_call_output items"})
def input_value(param: str, value: Any) -> Any:
    """Checked whole by input_messages."""
    return value


@described({"type": "object", "description": "{\"format\": {\"type\": \"text\" | \"json_object\" | "
                                             "\"json_schema\", \"name\", \"schema\", \"strict\"}}"})
def text_value(param: str, value: Any) -> dict:
    obj(param, value)
    unknown = next((name for name in value if name not in ("format", "verbosity")), None)
    if unknown is not None:
        raise invalid_field(f"{param}.{unknown}", "unknown field; text takes format", code="unknown_field")
    if value.get("verbosity") not in (None, "medium"):
        raise invalid_field(f"{param}.verbosity", "is not supported by this server; leave it unset",
                            code="unsupported_value")
    return value


LOGPROBS_INCLUDE = "message.output_text.logprobs"


@described({"type": "array", "items": {"enum": [LOGPROBS_INCLUDE]},
            "description": "extra output: the answer's token logprobs (with top_logprobs alternatives each)"})
def include_value(param: str, value: Any) -> list[str]:
    if not isinstance(value, list):
        raise invalid_field(param, "must be an array", code="invalid_type")
    for i, item in enumerate(value):
        if item != LOGPROBS_INCLUDE:
            raise invalid_field(f"{param}[{i}]", f"{json.dumps(item)} is not supported; only "
                                                 f"\"{LOGPROBS_INCLUDE}\" is", code="unsupported_value")
    return value


@described({"enum": ["disabled", "auto"],
            "description": "auto: drop the conversation's oldest turns until the prompt fits the model with room "
                           "for max_output_tokens; disabled (default): a prompt too long is a 400"})
def truncation_value(param: str, value: Any) -> str:
    if value not in ("disabled", "auto"):
        raise invalid_field(param, "must be \"disabled\" or \"auto\"")
    return value


# Sampling fields vLLM's Responses API takes beyond OpenAI's, checked as chat checks them.
PASSTHROUGH_FIELDS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
                      "stop", "ignore_eos", "priority", "cache_salt", "user")
RESPONSES_FIELDS: dict[str, Callable] = {
    "model": string, "input": input_value, "instructions": string, "previous_response_id": string,
    "max_output_tokens": integer(1, UINT32_MAX), "temperature": number(0.0, 2.0),
    "top_p": number(0.0, 1.0, lo_open=True), "stream": boolean, "store": boolean, "metadata": obj,
    "tools": checked_later({"type": "array", "items": {"type": "object"},
                            "description": "function tools: {\"type\": \"function\", \"name\", \"description\", "
                                           "\"parameters\", \"strict\"}; names unique"}),
    "tool_choice": checked_later({"anyOf": [{"enum": ["none", "required", "auto"]}, {
        "type": "object", "required": ["type", "name"], "properties": {"type": {"enum": ["function"]},
                                                                        "name": {"type": "string"}}}],
        "description": "\"auto\" needs the server's --tool-call-parser; without it send \"required\" or a "
                       "named function"}),
    "parallel_tool_calls": boolean,
    "text": text_value, "safety_identifier": string, "prompt_cache_key": string, "service_tier": string,
    "truncation": truncation_value, "background": boolean, "include": include_value,
    "reasoning": neutral(), "top_logprobs": integer(0, MAX_LOGPROBS), "max_tool_calls": neutral(),
    "prompt": neutral(),
    "conversation": neutral(), "stream_options": neutral(),
    **{name: COMMON_FIELDS[name] for name in PASSTHROUGH_FIELDS},
}


# A response continued by previous_response_id must have its conversation: one that ran to its end.
FINISHED_WITH_OUTPUT = ("completed", "incomplete")


@dataclass
class StoredResponse:
    response: dict  # the Response object, as it was answered
    conversation: list[dict]  # chat messages: the input's (instructions left out), then the output's
    input_items: list[dict] = field(default_factory=list)  # this request's own input, as OpenAI lists it


class ResponseStore:
    """Responses by id, the newest first to stay; bounded in count and in characters."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS):
        self.max_responses, self.max_chars = max_responses, max_chars
        self._stored: collections.OrderedDict[str, tuple[StoredResponse, int]] = collections.OrderedDict()
        self._num_chars = 0

    def put(self, stored: StoredResponse) -> None:
        size = len(json.dumps(stored.conversation)) + len(json.dumps(stored.response))
        self.delete(stored.response["id"])
        self._stored[stored.response["id"]] = (stored, size)
        self._num_chars += size
        while self._stored and (len(self._stored) > self.max_responses or self._num_chars > self.max_chars):
            self.delete(next(iter(self._stored)))

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._stored.get(response_id)
        return entry[0] if entry is not None else None

    def delete(self, response_id: str) -> bool:
        entry = self._stored.pop(response_id, None)
        if entry is not None:
            self._num_chars -= entry[1]
        return entry is not None


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"Response with id {response_id!r} not found.", param=param, code="response_not_found")


def _text_of(param: str, content: Any, part_types: tuple[str, ...]) -> str:
    """A message's content (a string, or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_field(param, "must be a string or an array of content parts", code="invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in part_types or not isinstance(part.get("text"), str):
            raise invalid_field(f"{param}[{j}]", f"only text parts ({', '.join(part_types)}) are supported; got "
                                                 f"{json.dumps(kind)}", code="unsupported_value")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(value: Any) -> list[dict]:
    """`input` as chat messages (a 400 naming the item for what is malformed or unsupported)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid_field("input", "must be a string or a non-empty array of items", code="invalid_type")
    if len(value) > MAX_INPUT_ITEMS:
        raise invalid_field("input", f"{len(value)} items, more than the limit of {MAX_INPUT_ITEMS}")
    messages: list[dict] = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_field(param, "must be an object", code="invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid_field(f"{param}.role", "must be user, system, developer or assistant")
            parts = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            text = _text_of(f"{param}.content", item.get("content"), parts)
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {"id": _string_in(item, "call_id", param), "type": "function",
                    "function": {"name": _string_in(item, "name", param),
                                 "arguments": _string_in(item, "arguments", param)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # calls made together are one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string_in(item, "call_id", param),
                             "content": _text_of(f"{param}.output", output, ("input_text",))})
        elif kind == "reasoning":
            continue  # a model's earlier thinking is not shown to it again (chat templates drop it too)
        else:
            raise invalid_field(f"{param}.type", f"{json.dumps(kind)} items are not supported; send message, "
                                                 f"function_call or function_call_output items",
                                code="unsupported_value")
    return messages


def input_items(value: Any) -> list[dict]:
    """`input` (checked by input_messages) as OpenAI lists a response's input items: each
    with an id (its own where it sent one), a message's content as typed parts."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    items = []
    for item in value:
        kind = item.get("type", "message")
        if kind == "message":
            part_type = "output_text" if item["role"] == "assistant" else "input_text"
            content = item["content"]
            parts = [{"type": part_type, "text": content}] if isinstance(content, str) else content
            items.append({"type": "message", "id": item.get("id") or _item_id("msg"), "role": item["role"],
                          "content": parts, "status": "completed"})
        elif kind == "function_call":
            items.append({"type": "function_call", "id": item.get("id") or _item_id("fc"),
                          "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"],
                          "status": "completed"})
        elif kind == "function_call_output":
            items.append({"type": "function_call_output", "id": item.get("id") or _item_id("fco"),
                          "call_id": item["call_id"], "output": item["output"], "status": "completed"})
    return items


def input_items_page(items: list[dict], order: str, limit: int, after: str | None) -> dict:
    """OpenAI's list of a response's input items: `order` desc (its default) or asc, at most
    `limit`, those after the item `after`."""
    ordered = list(reversed(items)) if order == "desc" else list(items)
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise invalid_field("after", f"no input item {after!r} in this response")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}


def _string_in(item: dict, name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise invalid_field(f"{param}.{name}", "is required and must be a string", code="missing_field")
    return value


def chat_tools(tools: Any) -> list[dict]:
    """Responses' function tools ({type, name, description, parameters, strict}) in chat's shape."""
    if not isinstance(tools, list):
        raise invalid_field("tools", "must be an array of function tools", code="invalid_type")
    converted = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise invalid_field(f"tools[{i}].type", f"{json.dumps(kind)} tools are not supported; only function "
                                                    f"tools are", code="unsupported_value")
        converted.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return converted


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice in ("none", "auto", "required"):
        return choice
    raise invalid_field("tool_choice", "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                       "\"name\": ...}", code="unsupported_value")


def chat_response_format(text: dict) -> dict | None:
    """text.format in chat's response_format shape (None: plain text)."""
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid_field("text.format", "must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}")
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return {"type": fmt["type"]}


# A chat field's name in a 400 -> the Responses field that set it.
_PARAM_PREFIXES = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
                   ("response_format.json_schema", "text.format"), ("response_format", "text.format"))


def responses_param(param: str | None) -> str | None:
    if param is not None and param.startswith("tools["):  # chat nests a tool's fields under "function"
        return param.replace(".function.", ".", 1)
    for chat_name, name in _PARAM_PREFIXES:
        if param is not None and param.startswith(chat_name):
            return name + param[len(chat_name):] if chat_name == "response_format.json_schema" else name
    return param


@dataclass
class ResponsesRequest:
    values: dict[str, Any]  # the checked fields
    conversation: list[dict]  # the chat messages before the answer, instructions left out
    input_items: list[dict] = field(default_factory=list)  # the input as OpenAI lists it (input_items)
    created_at: int = field(default_factory=lambda: int(time.time()))
    response_id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")

    @property
    def store(self) -> bool:
        return self.values.get("store", True)

    @property
    def background(self) -> bool:
        return self.values.get("background", False)

    @property
    def wants_logprobs(self) -> bool:
        """The answer's token logprobs: asked by include, or by top_logprobs alone (vLLM's)."""
        return LOGPROBS_INCLUDE in self.values.get("include", []) or "top_logprobs" in self.values

    def continue_stored(self, store: ResponseStore) -> None:
        """With previous_response_id: that response's conversation before this input."""
        previous_id = self.values.get("previous_response_id")
        if previous_id is not None:
            previous = store.get(previous_id)
            if previous is None:
                raise not_found(previous_id, "previous_response_id")
            status = previous.response["status"]
            if status not in FINISHED_WITH_OUTPUT:
                raise invalid_field("previous_response_id", f"response {previous_id!r} is {status}: only a "
                                    f"completed or incomplete response can be continued")
            self.conversation = previous.conversation + self.conversation

    def turn_starts(self) -> list[int]:
        """Where the conversation's turns begin (truncation "auto" drops whole turns from the
        front): a turn is a user message and what follows it up to the next one, so a tool's
        output goes with its call."""
        conversation = self.conversation
        return [0] + [i for i in range(1, len(conversation)) if conversation[i]["role"] == "user"]

    def chat_body(self) -> dict:
        """The chat completion this request means."""
        values = self.values
        instructions = values.get("instructions")
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + self.conversation
        chat: dict[str, Any] = {"model": values["model"], "messages": messages}
        renamed = {"max_output_tokens": "max_completion_tokens", "parallel_tool_calls": "parallel_tool_calls",
                   "temperature": "temperature", "top_p": "top_p", "stream": "stream"}
        chat |= {chat_name: values[name] for name, chat_name in renamed.items() if name in values}
        chat |= {name: values[name] for name in PASSTHROUGH_FIELDS if name in values}
        if values.get("stream"):
            chat["stream_options"] = {"include_usage": True}
        if self.wants_logprobs:
            chat |= {"logprobs": True, "top_logprobs": values.get("top_logprobs", 0)}
        if "tools" in values:
            chat["tools"] = chat_tools(values["tools"])
        if "tool_choice" in values:
            chat["tool_choice"] = chat_tool_choice(values["tool_choice"])
        response_format = chat_response_format(values["text"]) if "text" in values else None
        if response_format is not None:
            chat["response_format"] = response_format
        return chat


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """A Responses body, checked (a 400 naming the field); continue_stored then adds what
    previous_response_id names."""
    values = checked_fields(parse_body(body), RESPONSES_FIELDS)
    if "model" not in values:
        raise invalid_field("model", "is required: the name /v1/models lists", code="missing_field")
    if "input" not in values:
        raise invalid_field("input", "is required", code="missing_field")
    if "tools" in values:
        chat_tools(values["tools"])
    if "tool_choice" in values:
        chat_tool_choice(values["tool_choice"])
    if "text" in values:
        chat_response_format(values["text"])
    if values.get("background"):
        if values.get("store") is False:
            raise invalid_field("background", "needs store: true (a background response is read back with GET)")
        if values.get("stream"):
            raise invalid_field("background", "with stream is not supported by this server: poll "
                                "GET /v1/responses/{id} instead", code="unsupported_value")
    conversation = input_messages(values["input"])
    return ResponsesRequest(values, conversation, input_items(values["input"]))


def as_responses_error(error: ApiError) -> ApiError:
    """A 400 the chat checks gave, naming the Responses field instead of its chat name."""
    param = responses_param(error.param)
    if param != error.param and error.message.startswith(f"{error.param}:"):
        error.message = param + error.message[len(error.param):]
    error.param = param
    return error


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", logprobs: list[dict] | None = None) -> dict:
    return {"type": "message", "id": _item_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": _item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def function_call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _item_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def output_items(choice: dict) -> list[dict]:
    """A chat answer's choice as Response output items (its token logprobs, where asked, on
    the message's text: they are the chat choice's, every generated token's)."""
    message = choice["message"]
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(message["reasoning"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(message.get("content") or "",
                                  "incomplete" if choice["finish_reason"] == "length" else "completed",
                                  (choice.get("logprobs") or {}).get("content")))
    items += [function_call_item(call) for call in calls]
    return items


def conversation_after(request: ResponsesRequest, output: list[dict]) -> list[dict]:
    """The conversation a later request continues (previous_response_id): the input's
    messages, then the answer's text and calls as the assistant's turn."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    answer: dict = {"role": "assistant", "content": text or None}
    if calls:
        answer["tool_calls"] = calls
    return request.conversation + [answer]


def responses_usage(chat_usage: dict) -> dict:
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def response_object(request: ResponsesRequest, model_name: str, sampling: SamplingParams, status: str,
                    output: list[dict], usage: dict | None, error: dict | None = None) -> dict:
    """The Response, with the request's settings echoed as OpenAI echoes them (temperature and
    top_p as sampled: the request's, else the model's generation config's, else 1)."""
    values = request.values
    tools = [{"type": "function", **tool["function"]} for tool in chat_tools(values.get("tools", []))]
    text_format = values.get("text", {}).get("format") or {"type": "text"}
    return {
        "id": request.response_id, "object": "response", "created_at": request.created_at, "status": status,
        "background": request.background, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": values.get("instructions"), "max_output_tokens": values.get("max_output_tokens"),
        "max_tool_calls": None, "model": model_name, "output": output,
        "parallel_tool_calls": values.get("parallel_tool_calls", True),
        "previous_response_id": values.get("previous_response_id"), "reasoning": None,
        "service_tier": values.get("service_tier", "auto"), "store": request.store,
        "temperature": sampling.temperature,
        "text": {"format": text_format}, "tool_choice": values.get("tool_choice", "auto"), "tools": tools,
        "top_p": sampling.top_p, "truncation": values.get("truncation", "disabled"),
        "usage": usage, "user": values.get("user"), "metadata": values.get("metadata", {}),
    }


def completed_response(request: ResponsesRequest, model_name: str, chat_response: dict,
                       sampling: SamplingParams) -> tuple[dict, list[dict]]:
    """A whole chat completion as the Response, and the conversation to store with it."""
    choice = chat_response["choices"][0]
    output = output_items(choice)
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    response = response_object(request, model_name, sampling, status, output, responses_usage(chat_response["usage"]))
    return response, conversation_after(request, output)


def sse_named_event(payload: dict) -> bytes:
    """One Responses stream event: its type as the SSE event name, the payload as data."""
    return b"event: " + payload["type"].encode() + b"\ndata: " + json_bytes(payload) + b"\n\n"


class ResponseEvents:
    """One request's Responses stream from its chat chunks (ResponseBuilder.chunk_payload):
    an output item opens with its first piece (reasoning, text, a call) and closes when the
    next kind begins or the answer ends; the last event holds the whole Response, which
    `on_completed` stores. It writes the stream as ResponseBuilder does for chat
    (`chunk`, `ending`), so one SSE response serves both."""

    def __init__(self, builder: ResponseBuilder, request: ResponsesRequest, model_name: str,
                 on_completed: Callable[[dict, list[dict]], None]):
        self.builder, self.request, self.model_name = builder, request, model_name
        self.sampling = builder.request.sampling
        self.on_completed = on_completed
        self.sequence_number = 0
        self.output: list[dict] = []  # every item so far, as it stands
        self.open_text: dict | None = None  # the reasoning or message item text streams into
        self.open_calls: dict[int, dict] = {}  # the chat call index -> its function_call item
        self.finish_reason: str | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return sse_named_event(payload)

    def chunk(self, index: int, delta: GenerationDelta) -> bytes:
        payload = self.builder.chunk_payload(index, delta)
        events = []
        if self.sequence_number == 0:
            response = response_object(self.request, self.model_name, self.sampling, "in_progress", [], None)
            events += [self._event("response.created", response=response),
                       self._event("response.in_progress", response=response)]
        choice = payload["choices"][0]
        piece = choice["delta"]
        if piece.get("reasoning"):
            events += self._text("reasoning", piece["reasoning"])
        if piece.get("content"):
            events += self._text("message", piece["content"], (choice.get("logprobs") or {}).get("content") or [])
        for call in piece.get("tool_calls") or []:
            events += self._call(call)
        if choice["finish_reason"] is not None:
            self.finish_reason = choice["finish_reason"]
            events += self._close_text() + self._close_calls()
        return b"".join(events)

    def _text(self, kind: str, piece: str, logprobs: list[dict] | None = None) -> list[bytes]:
        events = []
        item = self.open_text
        if item is None or item["type"] != kind:
            events += self._close_text()
            if kind == "message":
                item = {**message_item("", "in_progress"), "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {**reasoning_item(""), "content": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            self.open_text = item
            self.output.append(item)
            events += [self._event("response.output_item.added", output_index=len(self.output) - 1, item=item),
                       self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self.output) - 1, content_index=0, part=part)]
            item["content"].append(part)
        item["content"][0]["text"] += piece
        where = {"item_id": item["id"], "output_index": self.output.index(item), "content_index": 0}
        if kind == "message":
            item["content"][0]["logprobs"] += logprobs or []
            return events + [self._event("response.output_text.delta", **where, delta=piece,
                                         logprobs=logprobs or [])]
        return events + [self._event("response.reasoning_text.delta", **where, delta=piece)]

    def _close_text(self) -> list[bytes]:
        item, self.open_text = self.open_text, None
        if item is None:
            return []
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": self.output.index(item), "content_index": 0}
        item["status"] = "incomplete" if item["type"] == "message" and self.finish_reason == "length" else "completed"
        done = (self._event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"])
                if item["type"] == "message" else self._event("response.reasoning_text.done", **where,
                                                              text=part["text"]))
        return [done, self._event("response.content_part.done", **where, part=part),
                self._event("response.output_item.done", output_index=where["output_index"], item=item)]

    def _call(self, call: dict) -> list[bytes]:
        events = []
        item = self.open_calls.get(call["index"])
        if item is None:
            events += self._close_text()
            item = function_call_item({"id": call["id"], "function": {**call["function"], "arguments": ""}},
                                      status="in_progress")
            self.open_calls[call["index"]] = item
            self.output.append(item)
            events.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=item))
        piece = call.get("function", {}).get("arguments") or ""
        if piece:
            item["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.output.index(item), delta=piece))
        return events

    def _close_calls(self) -> list[bytes]:
        events = []
        for item in self.open_calls.values():
            item["status"] = "completed"
            output_index = self.output.index(item)
            events += [self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=output_index, name=item["name"], arguments=item["arguments"]),
                       self._event("response.output_item.done", output_index=output_index, item=item)]
        self.open_calls = {}
        return events

    def ending(self, error: ApiError | None) -> bytes:
        """The last event: the whole Response, completed (stored), incomplete or failed."""
        if error is not None:
            events = self._close_text() + self._close_calls()
            response = response_object(self.request, self.model_name, self.sampling, "failed", self.output,
                                       responses_usage(self.builder.usage()),
                                       error={"code": error.code or "server_error", "message": error.message})
            return b"".join(events) + self._event("response.failed", response=response)
        status = "incomplete" if self.finish_reason == "length" else "completed"
        response = response_object(self.request, self.model_name, self.sampling, status, self.output,
                                   responses_usage(self.builder.usage()))
        self.on_completed(response, conversation_after(self.request, self.output))
        return self._event(f"response.{status}", response=response)

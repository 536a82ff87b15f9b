"""A chat choice's text -> its message (gateway.openai_api.chat_answer): the reasoning split
off by the server's reasoning parser, then the answer's tool calls and content, whole and
streamed, through ResponseBuilder as the server uses it."""
from __future__ import annotations

import json

from gateway.openai_api.protocol import parse_request
from gateway.openai_api.reasoning_parsers import make_reasoning_parser
from gateway.openai_api.responses import ResponseBuilder
from gateway.openai_api.tool_parsers import make_tool_parser
from gateway.types import GenerationDelta, Usage

QWEN3 = make_reasoning_parser("qwen3")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
THOUGHT_AND_CALL = ('<think>The user wants weather.</think>Checking. '
                    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')


def builder(reasoning_parser=QWEN3, tool_parser=None, **fields) -> ResponseBuilder:
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}
    return ResponseBuilder(parse_request(json.dumps(body).encode(), True, tool_parser), "c", "m", str,
                           reasoning_parser=reasoning_parser)


def delta(text: str, finish_reason: str | None = None) -> GenerationDelta:
    return GenerationDelta(request_id="r", text=text, usage=Usage(3, 1), finish_reason=finish_reason)


def whole(b: ResponseBuilder, text: str) -> dict:
    return b.full_response([delta(text, "stop")])["choices"][0]


def streamed(b: ResponseBuilder, pieces: list[str]) -> list[dict]:
    events = [b.chunk(0, delta(p, "stop" if i == len(pieces) - 1 else None)) for i, p in enumerate(pieces)]
    return [json.loads(e.removeprefix(b"data: "))["choices"][0] for e in events]


def test_reasoning_is_split_from_the_answer():
    choice = whole(builder(), "<think>\nIt is the capital.\n</think>\n\nParis.")
    assert choice["message"] == {"role": "assistant", "reasoning": "\nIt is the capital.\n", "content": "\n\nParis."}
    assert whole(builder(include_reasoning=False), "<think>x</think>Paris.")["message"] == {
        "role": "assistant", "content": "Paris."}
    # thinking off (qwen3): no reasoning at all; no parser: the markers stay in the content
    assert whole(builder(), "Paris.")["message"] == {"role": "assistant", "content": "Paris."}
    assert whole(builder(None), "<think>x</think>Paris.")["message"]["content"] == "<think>x</think>Paris."


def test_streamed_reasoning_then_content():
    choices = streamed(builder(), ["<thi", "nk>It is ", "the capital.</th", "ink>Par", "is."])
    reasoning = "".join(c["delta"].get("reasoning", "") for c in choices)
    content = "".join(c["delta"].get("content") or "" for c in choices)
    assert (reasoning, content) == ("It is the capital.", "Paris.")
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}  # nothing is known yet but who speaks
    assert not any("<" in c["delta"].get("reasoning", "") + (c["delta"].get("content") or "") for c in choices)


def test_reasoning_then_a_call_the_tool_parser_reads():
    hermes = make_tool_parser("hermes")
    choice = whole(builder(tool_parser=hermes, tools=[WEATHER]), THOUGHT_AND_CALL)
    message = choice["message"]
    assert (message["reasoning"], message["content"], choice["finish_reason"]) == (
        "The user wants weather.", "Checking. ", "tool_calls")
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    pieces = [THOUGHT_AND_CALL[i:i + 7] for i in range(0, len(THOUGHT_AND_CALL), 7)]
    choices = streamed(builder(tool_parser=hermes, tools=[WEATHER]), pieces)
    assert "".join(c["delta"].get("reasoning", "") for c in choices) == "The user wants weather."
    assert "".join(c["delta"].get("content") or "" for c in choices) == "Checking. "
    assert choices[-1]["finish_reason"] == "tool_calls"
    assert choices[-1]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_llama3_calls_open_the_answer_or_it_is_text():
    llama3 = make_tool_parser("llama3_json")
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    choice = whole(builder(None, tool_parser=llama3, tools=[WEATHER]), call)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    text = "Use {braces} freely."
    chunks = streamed(builder(None, tool_parser=llama3, tools=[WEATHER], stream=True), ["Use {bra", "ces} freely."])
    assert [c["delta"].get("content") for c in chunks] == ["Use {bra", "ces} freely."]  # text streams as it comes
    assert whole(builder(None, tool_parser=llama3, tools=[WEATHER]), text)["message"]["content"] == text


def test_constrained_answers_are_not_read_for_reasoning():
    forced = builder(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = whole(forced, '{"city": "Paris"}')["message"]
    assert "reasoning" not in message and message["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    # deepseek_r1 takes an answer without </think> for thinking: not a JSON answer
    r1 = make_reasoning_parser("deepseek_r1")
    assert whole(builder(r1), '{"a": 1}')["message"] == {"role": "assistant", "reasoning": '{"a": 1}', "content": ""}
    json_answer = builder(r1, response_format={"type": "json_object"})
    assert whole(json_answer, '{"a": 1}')["message"] == {"role": "assistant", "content": '{"a": 1}'}
    chunks = streamed(builder(r1, response_format={"type": "json_object"}, stream=True), ['{"a"', ": 1}"])
    assert "".join(c["delta"].get("content") or "" for c in chunks) == '{"a": 1}'


def test_past_reasoning_in_the_conversation_reaches_the_template():
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
                {"role": "user", "content": "And 3+3?"}]
    parsed = parse_request(json.dumps({"model": "m", "messages": messages}).encode(), True)
    assert parsed.messages[1] == {"role": "assistant", "content": "4", "reasoning": "Add them."}

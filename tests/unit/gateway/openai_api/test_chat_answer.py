"""A chat choice's text -> its message (gateway.openai_api.chat_answer): the reasoning split
off by the server's reasoning parser, then the answer's tool calls and content, whole and
streamed, through ResponseBuilder as the server uses it."""
from __future__ import annotations

import dataclasses
import json

from hypothesis import given, settings
from hypothesis import strategies as st

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


def builder(reasoning_parser=QWEN3, tool_parser=None, held_back: bool = False, **fields) -> ResponseBuilder:
    """held_back: the constraint waits for the thinking to end, as the server sends it under a
    reasoning parser (OpenAIServer._constrain_after_reasoning)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}
    parsed = parse_request(json.dumps(body).encode(), True, tool_parser)
    if held_back:
        parsed.sampling = parsed.sampling.clone(structured_outputs=dataclasses.replace(
            parsed.sampling.structured_outputs, start_after_token_ids=(1, 2)))
    return ResponseBuilder(parsed, "c", "m", str, reasoning_parser=reasoning_parser)


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


NAMED = {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
REQUIRED = {"tools": [WEATHER], "tool_choice": "required"}


def test_a_constraint_held_back_until_the_thinking_ends_reads_the_reasoning_first():
    r1 = make_reasoning_parser("deepseek_r1")
    json_answer = builder(r1, held_back=True, response_format={"type": "json_object"})
    assert whole(json_answer, 'Some JSON.</think>{"a": 1}')["message"] == {
        "role": "assistant", "reasoning": "Some JSON.", "content": '{"a": 1}'}
    named = whole(builder(held_back=True, **NAMED), '<think>Paris it is.</think>{"city": "Paris"}')["message"]
    assert named["reasoning"] == "Paris it is." and named["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in named["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')]
    required = whole(builder(held_back=True, **REQUIRED),
                     '<think>Hm.</think>[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')["message"]
    assert required["reasoning"] == "Hm." and required["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    # cut short while thinking: no call was made yet
    assert whole(builder(held_back=True, **NAMED), "<think>Still thinking")["message"] == {
        "role": "assistant", "reasoning": "Still thinking", "content": None}


def test_streamed_thinking_then_a_forced_call():
    pieces = ["<think>Paris", " it is.</th", 'ink>{"city"', ': "Paris"}']
    chunks = [c["delta"] for c in streamed(builder(held_back=True, stream=True, **NAMED), pieces)]
    assert chunks[0]["role"] == "assistant" and "tool_calls" not in chunks[0]
    assert "".join(c.get("reasoning", "") for c in chunks) == "Paris it is."
    calls = [call for c in chunks for call in c.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    assert sum("id" in call for call in calls) == 1  # the call opens once
    assert "".join(call["function"]["arguments"] for call in calls) == '{"city": "Paris"}'
    assert not any(c.get("content") for c in chunks)
    pieces = ["<think>Hm.", '</think>[{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}]']
    chunks = [c["delta"] for c in streamed(builder(held_back=True, stream=True, **REQUIRED), pieces)]
    assert "".join(c.get("reasoning", "") for c in chunks) == "Hm."
    assert [c["function"]["arguments"] for c in chunks[-1]["tool_calls"]] == ['{"city": "Oslo"}']
    # without a held-back constraint the call opens with the first piece, as before
    chunks = [c["delta"] for c in streamed(builder(stream=True, **NAMED), ['{"city"', ': "Rome"}'])]
    assert chunks[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city"'}


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=50), max_size=8), forced=st.sampled_from(["named", "required"]))
def test_any_split_of_thinking_and_a_forced_call_streams_what_the_whole_answer_gives(cuts, forced):
    call = '{"city": "Paris"}' if forced == "named" else '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    answer = "<think>Paris it is.</think>" + call
    points = sorted({min(c, len(answer)) for c in cuts})
    pieces = [answer[a:b] for a, b in zip([0, *points], [*points, len(answer)])]
    fields = NAMED if forced == "named" else REQUIRED
    chunks = [c["delta"] for c in streamed(builder(held_back=True, stream=True, **fields), pieces)]
    expected = whole(builder(held_back=True, **fields), answer)["message"]
    assert "".join(c.get("reasoning", "") for c in chunks) == expected["reasoning"] == "Paris it is."
    calls = [call for c in chunks for call in c.get("tool_calls", [])]
    assert [call["function"].get("name") for call in calls if "id" in call] == ["get_weather"]
    arguments = expected["tool_calls"][0]["function"]["arguments"]
    assert "".join(call["function"]["arguments"] for call in calls) == arguments
    assert not any(c.get("content") for c in chunks)


def test_past_reasoning_in_the_conversation_reaches_the_template():
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
                {"role": "user", "content": "And 3+3?"}]
    parsed = parse_request(json.dumps({"model": "m", "messages": messages}).encode(), True)
    assert parsed.messages[1] == {"role": "assistant", "content": "4", "reasoning": "Add them."}

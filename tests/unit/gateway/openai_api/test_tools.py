"""Function calling on chat (gateway.openai_api.tools): what a forced call constrains the
answer to, the conversation's tool turns reaching the template, and the answer as
tool_calls, whole and streamed. Bad fields: test_protocol.py."""
from __future__ import annotations

import json

import jsonschema
import pytest

from gateway.openai_api.protocol import parse_request
from gateway.openai_api.responses import ResponseBuilder
from gateway.types import GenerationDelta, Usage

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
ASKED = [{"role": "user", "content": "Weather in Paris?"}]


def parse(**fields):
    return parse_request(json.dumps({"model": "m", "messages": ASKED, **fields}).encode(), chat=True)


def delta(text: str, finish_reason: str | None = None) -> GenerationDelta:
    return GenerationDelta(request_id="r", text=text, usage=Usage(3, 1), finish_reason=finish_reason)


def test_a_named_call_constrains_the_answer_to_the_functions_parameters():
    parsed = parse(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert parsed.constraint_field == "tools"
    assert json.loads(parsed.sampling.structured_outputs.json) == WEATHER["function"]["parameters"]
    request = parsed.generate_inputs("c")[0]
    assert request.chat_options.tools == [WEATHER, TIME]  # the template lists every tool
    no_parameters = parse(tools=[TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(no_parameters.sampling.structured_outputs.json) == {"type": "object", "properties": {}}


@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_constrains_the_answer_to_an_array_of_calls(parallel):
    fields = {} if parallel is None else {"parallel_tool_calls": parallel}
    schema = json.loads(parse(tools=[WEATHER, TIME], tool_choice="required", **fields).sampling.structured_outputs.json)
    one = [{"name": "get_weather", "parameters": {"city": "Paris"}}]
    jsonschema.validate(one, schema)
    two = one + [{"name": "get_time", "parameters": {}}]
    if parallel is False:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)
    else:
        jsonschema.validate(two, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}],
                [{"name": "get_weather", "parameters": {"city": "Paris"}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_hoists_the_tools_definitions_and_refuses_clashing_ones():
    def tool(name: str, unit: dict) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"unit": {"$ref": "#/$defs/unit"}}, "$defs": {"unit": unit}}}}
    unit = {"enum": ["C", "F"]}
    schema = json.loads(parse(tools=[tool("a", unit), tool("b", unit)], tool_choice="required")
                        .sampling.structured_outputs.json)
    assert schema["$defs"] == {"unit": unit}
    jsonschema.validate([{"name": "b", "parameters": {"unit": "C"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "b", "parameters": {"unit": "K"}}], schema)
    with pytest.raises(Exception, match=r"\$defs.unit differently") as refused:
        parse(tools=[tool("a", unit), tool("b", {"enum": ["K"]})], tool_choice="required")
    assert refused.value.param == "tools"


def test_none_leaves_the_tools_out_of_the_prompt_and_the_answer_as_text():
    parsed = parse(tools=[WEATHER], tool_choice="none")
    assert parsed.sampling.structured_outputs is None and parsed.generate_inputs("c")[0].chat_options.tools is None
    builder = ResponseBuilder(parsed, "c", "m", str)
    assert builder.full_response([delta("Sunny.", "stop")])["choices"][0]["message"] == {
        "role": "assistant", "content": "Sunny."}


def test_a_conversation_with_tool_turns_reaches_the_template():
    messages = ASKED + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 C, sunny"}]
    parsed = parse_request(json.dumps({"model": "m", "messages": messages}).encode(), chat=True)
    assert parsed.messages[1] == {"role": "assistant", "content": "", "tool_calls": messages[1]["tool_calls"]}
    assert parsed.messages[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call-1"}


def test_a_forced_answer_comes_back_as_tool_calls():
    named = parse(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, n=2)
    choices = ResponseBuilder(named, "c", "m", str).full_response(
        [delta('{"city": "Paris"}', "stop"), delta('{"city": "Rome"}', "stop")])["choices"]
    calls = [c["message"]["tool_calls"][0] for c in choices]
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                                             {"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["id"].startswith("chatcmpl-tool-")
    assert all(c["message"]["content"] is None and c["finish_reason"] == "stop" for c in choices)
    required = parse(tools=[WEATHER, TIME], tool_choice="required")
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    message = ResponseBuilder(required, "c", "m", str).full_response([delta(text, "stop")])["choices"][0]["message"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    cut = ResponseBuilder(required, "c", "m", str).full_response([delta('[{"name": "get_w', "length")])
    assert cut["choices"][0]["message"] == {"role": "assistant", "content": '[{"name": "get_w'}


def _events(builder: ResponseBuilder, deltas: list[GenerationDelta]) -> list[dict]:
    return [json.loads(builder.chunk(0, d).removeprefix(b"data: "))["choices"][0]["delta"] for d in deltas]


def test_streamed_calls_named_as_they_come_required_whole_at_the_end():
    named = parse(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
    first, middle, empty, last = _events(ResponseBuilder(named, "c", "m", str), [
        delta('{"city"'), delta(': "Paris"'), delta(""), delta("}", "stop")])
    call = first["tool_calls"][0]
    assert (first["role"], first["content"], call["index"], call["type"], call["function"]) == (
        "assistant", None, 0, "function", {"name": "get_weather", "arguments": '{"city"'})
    assert middle == {"tool_calls": [{"index": 0, "function": {"arguments": ': "Paris"'}}]} and empty == {}
    assert last == {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}
    required = parse(tools=[WEATHER], tool_choice="required", stream=True)
    events = _events(ResponseBuilder(required, "c", "m", str), [
        delta('[{"name": "get_weather", '), delta('"parameters": {"city": "Paris"}}'), delta("]", "stop")])
    assert events[:2] == [{"role": "assistant", "content": None}, {}]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in events[2]["tool_calls"]] == [
        (0, "get_weather", '{"city": "Paris"}')]

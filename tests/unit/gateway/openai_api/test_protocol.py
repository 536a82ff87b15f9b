"""OpenAI request bodies -> GenerateInputs (gateway.openai_api.protocol) and responses
(responses.py), without a server: every bad field gets a 400 naming it; good bodies
map onto SamplingParams and fan out into one GenerateInput per choice."""
from __future__ import annotations

import json

import pytest

from common.engine.beam_search import BeamSearchParams
from common.engine.outputs import Logprobs
from gateway.openai_api.errors import ApiError
from gateway.openai_api.protocol import MAX_CHOICES, parse_request
from gateway.openai_api.responses import ResponseBuilder
from gateway.types import GenerationDelta, Usage


def parse(chat: bool = False, **fields):
    body = {"model": "m", **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    body.update(fields)
    return parse_request(json.dumps(body).encode(), chat)


def rejected(body: bytes | dict, chat: bool = False) -> ApiError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ApiError) as error:
        parse_request(raw, chat)
    assert error.value.status == 400
    return error.value


COMPLETION = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("body, chat, param, code", [
    # malformed JSON and bodies that are not objects
    (b'{"model": "m", "prompt": ', False, None, "invalid_json"),
    (b"\xff\xfe", False, None, "invalid_json"),
    (b"[1, 2]", False, None, "invalid_json"),
    # unknown fields, also nested ones
    ({**COMPLETION, "temprature": 0.5}, False, "temprature", "unknown_field"),
    ({**CHAT, "max_completion_tokenz": 5}, True, "max_completion_tokenz", "unknown_field"),
    ({**COMPLETION, "messages": CHAT["messages"]}, False, "messages", "unknown_field"),
    ({**CHAT, "prompt": "hi"}, True, "prompt", "unknown_field"),
    ({**COMPLETION, "stream": True, "stream_options": {"include_usage": True, "x": 1}}, False,
     "stream_options.x", "unknown_field"),
    ({**CHAT, "messages": [{"role": "user", "content": "hi", "extra": 1}]}, True, "messages[0].extra",
     "unknown_field"),
    # wrong types
    ({**COMPLETION, "max_tokens": "16"}, False, "max_tokens", "invalid_type"),
    ({**COMPLETION, "max_tokens": 1.5}, False, "max_tokens", "invalid_type"),
    ({**COMPLETION, "temperature": "hot"}, False, "temperature", "invalid_type"),
    ({**COMPLETION, "stream": "yes"}, False, "stream", "invalid_type"),
    ({**COMPLETION, "n": True}, False, "n", "invalid_type"),
    ({**COMPLETION, "stop": 3}, False, "stop", "invalid_type"),
    ({**COMPLETION, "stop": ["ok", 3]}, False, "stop[1]", "invalid_type"),
    ({**COMPLETION, "model": 7}, False, "model", "invalid_type"),
    ({**COMPLETION, "prompt": {"text": "hi"}}, False, "prompt", "invalid_type"),
    ({**COMPLETION, "prompt": ["a", 3]}, False, "prompt[1]", "invalid_type"),
    ({**COMPLETION, "prompt": [1, -2]}, False, "prompt[1]", "invalid_value"),
    ({**COMPLETION, "logprobs": True}, False, "logprobs", "invalid_type"),
    ({**CHAT, "logprobs": 3}, True, "logprobs", "invalid_type"),
    ({**CHAT, "messages": "hi"}, True, "messages", "invalid_type"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, True, "messages[0].content", "invalid_type"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, True,
     "messages[0].content[0].image_url", "unknown_field"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, True,
     "messages[0].content[0].type", "unsupported_value"),
    # out of range
    ({**COMPLETION, "temperature": 2.5}, False, "temperature", "invalid_value"),
    ({**COMPLETION, "top_p": 0}, False, "top_p", "invalid_value"),
    ({**COMPLETION, "top_p": 1.01}, False, "top_p", "invalid_value"),
    ({**COMPLETION, "top_k": -2}, False, "top_k", "invalid_value"),
    ({**COMPLETION, "min_p": -0.1}, False, "min_p", "invalid_value"),
    ({**COMPLETION, "presence_penalty": 2.5}, False, "presence_penalty", "invalid_value"),
    ({**COMPLETION, "frequency_penalty": -3}, False, "frequency_penalty", "invalid_value"),
    ({**COMPLETION, "repetition_penalty": 0}, False, "repetition_penalty", "invalid_value"),
    ({**COMPLETION, "max_tokens": 0}, False, "max_tokens", "invalid_value"),
    ({**CHAT, "max_completion_tokens": -1}, True, "max_completion_tokens", "invalid_value"),
    ({**COMPLETION, "n": 0}, False, "n", "invalid_value"),
    ({**COMPLETION, "n": MAX_CHOICES + 1}, False, "n", "invalid_value"),
    ({**COMPLETION, "prompt": ["a", "b"], "n": MAX_CHOICES // 2 + 1}, False, "n", "invalid_value"),
    ({**COMPLETION, "seed": -1}, False, "seed", "invalid_value"),
    ({**COMPLETION, "logprobs": 21}, False, "logprobs", "invalid_value"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, True, "top_logprobs", "invalid_value"),
    ({**COMPLETION, "min_tokens": 20, "max_tokens": 10}, False, "min_tokens", "invalid_value"),
    ({**COMPLETION, "stop": [""]}, False, "stop[0]", "invalid_value"),
    ({**COMPLETION, "prompt": ""}, False, "prompt", "invalid_value"),
    ({**COMPLETION, "prompt": []}, False, "prompt", "invalid_type"),
    ({**COMPLETION, "priority": 2**31}, False, "priority", "invalid_value"),
    ({**CHAT, "messages": []}, True, "messages", "invalid_type"),
    ({**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, True, "messages[0].role", "invalid_value"),
    # missing, inconsistent, unsupported
    ({"prompt": "hi"}, False, "model", "missing_field"),
    ({"model": "m"}, False, "prompt", "missing_field"),
    ({"model": "m"}, True, "messages", "missing_field"),
    ({**CHAT, "messages": [{"role": "user"}]}, True, "messages[0].content", "missing_field"),
    ({**COMPLETION, "stream_options": {"include_usage": True}}, False, "stream_options", "invalid_value"),
    ({**CHAT, "top_logprobs": 2}, True, "top_logprobs", "invalid_value"),
    ({**CHAT, "max_tokens": 5, "max_completion_tokens": 6}, True, "max_tokens", "invalid_value"),
    ({**COMPLETION, "best_of": 3}, False, "best_of", "unsupported_value"),
    ({**COMPLETION, "echo": "yes"}, False, "echo", "invalid_type"),
    ({**COMPLETION, "prompt_logprobs": 21}, False, "prompt_logprobs", "invalid_value"),
    ({**COMPLETION, "suffix": "x"}, False, "suffix", "unsupported_value"),
    ({**COMPLETION, "logit_bias": {"50256": -101}}, False, "logit_bias.50256", "invalid_value"),
    ({**COMPLETION, "logit_bias": {"50256": "-1"}}, False, "logit_bias.50256", "invalid_type"),
    ({**COMPLETION, "logit_bias": {"-3": 1}}, False, "logit_bias", "invalid_value"),
    ({**COMPLETION, "logit_bias": {"x": 1}}, False, "logit_bias", "invalid_value"),
    ({**COMPLETION, "logit_bias": {"7": 1, "07": 2}}, False, "logit_bias", "invalid_value"),
    ({**COMPLETION, "logit_bias": {str(i): 1 for i in range(1025)}}, False, "logit_bias", "invalid_value"),
    ({**CHAT, "logit_bias": [1, 2]}, True, "logit_bias", "invalid_type"),
    ({**COMPLETION, "allowed_token_ids": []}, False, "allowed_token_ids", "invalid_value"),
    ({**COMPLETION, "allowed_token_ids": [1, -1]}, False, "allowed_token_ids[1]", "invalid_value"),
    ({**COMPLETION, "allowed_token_ids": [1], "guided_regex": "a"}, False, "allowed_token_ids", "invalid_value"),
    # tools: "auto" (the default with tools) needs a parser this server lacks
    ({**CHAT, "tools": [TOOL]}, True, "tool_choice", "unsupported_value"),
    ({**CHAT, "tools": [TOOL], "tool_choice": "auto"}, True, "tool_choice", "unsupported_value"),
    ({**CHAT, "tool_choice": "required"}, True, "tool_choice", "invalid_value"),
    ({**CHAT, "tools": [TOOL], "tool_choice": "sometimes"}, True, "tool_choice", "invalid_value"),
    ({**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, True,
     "tool_choice.function.name", "invalid_value"),
    ({**CHAT, "tools": [TOOL], "tool_choice": {"type": "function"}}, True, "tool_choice", "invalid_value"),
    ({**CHAT, "tools": TOOL, "tool_choice": "required"}, True, "tools", "invalid_value"),
    ({**CHAT, "tools": [TOOL, TOOL], "tool_choice": "required"}, True, "tools[1].function.name", "invalid_value"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"}, True,
     "tools[0].function.name", "invalid_value"),
    ({**CHAT, "tools": [{"type": "retrieval"}], "tool_choice": "required"}, True, "tools[0]", "invalid_value"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}],
      "tool_choice": "required"}, True, "tools[0].function.parameters", "invalid_value"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "code": "x"}}], "tool_choice": "required"},
     True, "tools[0].function.code", "unknown_field"),
    ({**CHAT, "tools": [TOOL] * 129, "tool_choice": "required"}, True, "tools", "invalid_value"),
    ({**CHAT, "tools": [TOOL], "tool_choice": "required", "guided_regex": "a"}, True, "tool_choice", "invalid_value"),
    ({**CHAT, "tools": [TOOL], "tool_choice": "required", "echo": True,
      "messages": [{"role": "assistant", "content": "x"}], "add_generation_prompt": False}, True, "echo",
     "invalid_value"),
    ({**CHAT, "messages": [{"role": "tool", "content": "4"}]}, True, "messages[0].tool_call_id", "missing_field"),
    ({**CHAT, "messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, True, "messages[0].tool_call_id",
     "invalid_value"),
    ({**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, True, "messages[0].tool_calls",
     "invalid_value"),
    ({**CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]}, True,
     "messages[0].tool_calls[0]", "invalid_value"),
    ({**CHAT, "messages": [{"role": "assistant", "content": None}]}, True, "messages[0].content", "missing_field"),
    # output constraints
    ({**CHAT, "response_format": {"type": "xml"}}, True, "response_format.type", "invalid_value"),
    ({**CHAT, "response_format": {"type": "json_schema"}}, True, "response_format.json_schema", "invalid_value"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, True,
     "response_format.json_schema.schema", "missing_field"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": "{oops"}}}, True,
     "response_format.json_schema.schema", "invalid_value"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}, True,
     "response_format.json_schema.strict", "invalid_value"),
    ({**COMPLETION, "guided_regex": "a(b"}, False, "guided_regex", "invalid_value"),
    # re.compile raises OverflowError, not re.error, for this (it was a 500)
    ({**COMPLETION, "guided_regex": "a{99999999999}"}, False, "guided_regex", "invalid_value"),
    ({**CHAT, "structured_outputs": {"regex": "a{4294967296}"}}, True, "structured_outputs.regex", "invalid_value"),
    # past the protobuf field they travel in (they were a 500)
    ({**COMPLETION, "min_tokens": 2**32}, False, "min_tokens", "invalid_value"),
    ({**COMPLETION, "max_tokens": 2**32}, False, "max_tokens", "invalid_value"),
    ({**COMPLETION, "top_k": 2**31}, False, "top_k", "invalid_value"),
    ({**COMPLETION, "guided_choice": []}, False, "guided_choice", "invalid_value"),
    ({**COMPLETION, "guided_json": [1]}, False, "guided_json", "invalid_value"),
    ({**COMPLETION, "guided_grammar": 5}, False, "guided_grammar", "invalid_value"),
    ({**COMPLETION, "structured_outputs": {"xml": "a"}}, False, "structured_outputs.xml", "unknown_field"),
    ({**CHAT, "response_format": {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": {},
                                                                            "end": "</a>"}]}},
     True, "response_format.triggers", "invalid_value"),
    ({**CHAT, "response_format": {"type": "structural_tag", "tags": []}}, True, "response_format.tags",
     "unknown_field"),
    ({**CHAT, "structured_outputs": {"structural_tag": "{no"}}, True, "structured_outputs.structural_tag",
     "invalid_value"),
    ({**COMPLETION, "guided_regex": "a", "guided_choice": ["a"]}, False, "guided_choice", "invalid_value"),
    ({**CHAT, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, True,
     "structured_outputs.regex", "invalid_value"),
    # beam search: what a search cannot honour, and its own fields
    ({**COMPLETION, "use_beam_search": True, "stream": True}, False, "stream", "unsupported_value"),
    ({**COMPLETION, "use_beam_search": True, "logprobs": 1}, False, "logprobs", "unsupported_value"),
    ({**CHAT, "use_beam_search": True, "logprobs": True}, True, "logprobs", "unsupported_value"),
    ({**COMPLETION, "use_beam_search": True, "echo": True}, False, "echo", "unsupported_value"),
    ({**COMPLETION, "use_beam_search": True, "top_p": 0.5}, False, "top_p", "unsupported_value"),
    ({**COMPLETION, "use_beam_search": True, "stop": ["."]}, False, "stop", "unsupported_value"),
    ({**CHAT, "use_beam_search": True, "response_format": {"type": "json_object"}}, True, "response_format",
     "unsupported_value"),
    ({**COMPLETION, "use_beam_search": True, "n": 11}, False, "n", "invalid_value"),
    ({**COMPLETION, "length_penalty": 0.5}, False, "length_penalty", "invalid_value"),
    ({**COMPLETION, "use_beam_search": True, "length_penalty": "long"}, False, "length_penalty", "invalid_type"),
    (b'{"model": "m", "prompt": "hi", "use_beam_search": true, "length_penalty": Infinity}', False,
     "length_penalty", "invalid_value"),
])
def test_every_bad_field_is_a_400_naming_it(body, chat, param, code):
    error = rejected(body, chat)
    assert (error.param, error.code) == (param, code), error.message
    if param is not None:
        assert error.message.startswith(f"{param}: "), error.message
    assert error.body()["error"] == {"message": error.message, "type": "invalid_request_error",
                                     "param": param, "code": code}


def test_what_the_official_client_and_benchmark_clients_send_is_accepted():
    # Nulls are OpenAI's "unset"; guidellm sends stop: null and continuous_usage_stats.
    parsed = parse(stop=None, max_tokens=32, ignore_eos=True, stream=True,
                   stream_options={"include_usage": True, "continuous_usage_stats": True}, user="u",
                   logit_bias={}, echo=False, best_of=1, suffix=None, top_k=0, seed=None)
    assert parsed.stream and parsed.include_usage and parsed.continuous_usage
    assert parsed.sampling.max_tokens == 32 and parsed.sampling.ignore_eos and parsed.sampling.top_k == -1
    assert parsed.sampling.logit_bias is None
    chat = parse(chat=True, max_completion_tokens=8, tools=[], tool_choice="none", parallel_tool_calls=False,
                 response_format={"type": "text"}, metadata={"k": "v"}, store=False, n=None)
    assert chat.sampling.max_tokens == 8 and chat.sampling.n == 1


def test_echo_with_logprobs_asks_for_the_prompts_logprobs():
    assert parse(echo=True).echo and parse(echo=True).sampling.prompt_logprobs is None
    assert parse(echo=True, logprobs=2).sampling.prompt_logprobs == 2
    assert parse(echo=True, logprobs=2, prompt_logprobs=5).sampling.prompt_logprobs == 5
    assert parse(prompt_logprobs=0).sampling.prompt_logprobs == 0 and not parse(prompt_logprobs=0).echo
    assert parse(chat=True, prompt_logprobs=1).sampling.prompt_logprobs == 1


def test_logit_bias_and_allowed_token_ids_reach_the_sampling_params():
    parsed = parse(logit_bias={"50256": -100, "7": 2.5, "0": 0}, allowed_token_ids=[7, 9, 50256], n=2, seed=1)
    assert parsed.sampling.logit_bias == {50256: -100.0, 7: 2.5, 0: 0.0}
    assert parsed.sampling.allowed_token_ids == [7, 9, 50256]
    children = [request.sampling for request in parsed.generate_inputs("id")]
    assert [(c.logit_bias, c.allowed_token_ids) for c in children] == [
        ({50256: -100.0, 7: 2.5, 0: 0.0}, [7, 9, 50256])] * 2
    chat = parse(chat=True, logit_bias={"3": 100})
    assert chat.sampling.logit_bias == {3: 100.0} and chat.sampling.allowed_token_ids is None


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TAG = {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>",
                                            "content": {"type": "json_schema", "json_schema": SCHEMA}}}


@pytest.mark.parametrize("chat, fields, expected", [
    (True, {"response_format": {"type": "json_object"}}, {"json_object": True}),
    (True, {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA,
                                                                       "strict": True}}}, {"json": SCHEMA}),
    (False, {"response_format": {"type": "json_schema", "json_schema": {"schema": json.dumps(SCHEMA)}}},
     {"json": SCHEMA}),
    (False, {"guided_json": SCHEMA}, {"json": SCHEMA}),
    (False, {"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
    (True, {"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    (False, {"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
    (True, {"structured_outputs": {"choice": ["x"]}}, {"choice": ["x"]}),
    (True, {"response_format": {"type": "text"}}, None),
    (True, {"response_format": TAG}, {"structural_tag": TAG}),
    (False, {"structured_outputs": {"structural_tag": json.dumps(TAG)}}, {"structural_tag": TAG}),
    (True, {"response_format": {"type": "structural_tag", "triggers": ["<f="], "structures": [
        {"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"}]}},
     {"structural_tag": {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f="], "tags": [
         {"type": "tag", "begin": "<f=a>", "end": "</f>", "content": {"type": "json_schema", "json_schema": SCHEMA}}]}}}),
])
def test_output_constraints_map_onto_structured_outputs(chat, fields, expected):
    parsed = parse(chat=chat, n=2, **fields)
    constraint = parsed.sampling.structured_outputs
    if expected is None:
        assert constraint is None
        return
    kind, value = next(iter(expected.items()))
    assert constraint.kind == kind
    assert (json.loads(constraint.value) if kind in ("json", "structural_tag") else constraint.value) == value
    assert all(i.sampling.structured_outputs == constraint for i in parsed.generate_inputs("r"))


def test_beam_search_takes_the_beam_width_from_n_and_its_own_fields():
    parsed = parse_request(json.dumps({**COMPLETION, "use_beam_search": True, "n": 4, "max_tokens": 9,
                                       "length_penalty": 0.5, "ignore_eos": True, "temperature": 0.7,
                                       "skip_special_tokens": False}).encode(), False)
    assert parsed.beam_search == BeamSearchParams(beam_width=4, max_tokens=9, length_penalty=0.5, ignore_eos=True,
                                                  skip_special_tokens=False)
    assert parse_request(json.dumps(CHAT).encode(), True).beam_search is None


def test_defaults_follow_openai():
    completion, chat = parse(), parse(chat=True)
    assert completion.sampling.max_tokens == 16 and chat.sampling.max_tokens is None
    for parsed in (completion, chat):
        s = parsed.sampling
        assert (s.temperature, s.top_p, s.n, s.seed, s.logprobs) == (1.0, 1.0, 1, None, None)
        assert not parsed.stream and not parsed.include_usage


def test_sampling_fields_map_onto_sampling_params():
    s = parse(max_tokens=40, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, presence_penalty=0.5,
              frequency_penalty=-0.5, repetition_penalty=1.1, seed=7, stop="\n", stop_token_ids=[2],
              ignore_eos=True, min_tokens=4, include_stop_str_in_output=True, skip_special_tokens=False,
              logprobs=3).sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (40, 0.7, 0.9, 20, 0.05)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.seed) == (0.5, -0.5, 1.1, 7)
    assert (s.stop, s.stop_token_ids, s.ignore_eos, s.min_tokens) == (["\n"], [2], True, 4)
    assert s.include_stop_str_in_output and not s.skip_special_tokens and s.logprobs == 3
    chat = parse(chat=True, max_tokens=9, logprobs=True, top_logprobs=2)
    assert chat.sampling.max_tokens == 9 and chat.num_logprobs == 2 == chat.sampling.logprobs
    assert parse(chat=True, logprobs=True).num_logprobs == 0 and parse(chat=True).num_logprobs is None


def test_n_and_prompt_lists_fan_out_in_openai_choice_order():
    parsed = parse(prompt=["first", [1, 2, 3]], n=2, seed=10, temperature=0.8)
    inputs = parsed.generate_inputs("cmpl-x")
    assert [i.request_id for i in inputs] == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2", "cmpl-x-3"]
    assert [(i.text, i.token_ids) for i in inputs] == [("first", None), ("first", None), (None, [1, 2, 3]),
                                                       (None, [1, 2, 3])]
    assert [i.sampling.seed for i in inputs] == [10, 11, 10, 11]
    assert all(i.sampling.n == 1 and i.sampling.temperature == 0.8 for i in inputs)
    single = parse(prompt=[5, 6]).generate_inputs("cmpl-y")
    assert [(i.request_id, i.token_ids) for i in single] == [("cmpl-y", [5, 6])]
    chat = parse(chat=True, messages=[{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]},
                                      {"role": "user", "content": "hi", "name": "me"}])
    assert chat.generate_inputs("c")[0].messages == [{"role": "system", "content": "a\nb"},
                                                     {"role": "user", "content": "hi", "name": "me"}]


def delta(text: str, completion_tokens: int, logprobs=(), finish_reason=None, prompt_tokens=3,
          cached=0) -> GenerationDelta:
    return GenerationDelta(request_id="r", text=text, usage=Usage(prompt_tokens, completion_tokens, cached),
                           logprobs=list(logprobs), finish_reason=finish_reason)


TOKEN_TEXTS = {7: "Hel", 8: "lo", 9: "!"}
LOGPROBS = [(7, Logprobs(-0.5, [7, 9], [-0.5, -2.0])), (8, Logprobs(float("-inf"), [8, 9], [-0.1, -3.0]))]


def test_responses_count_each_prompt_once_and_write_both_logprob_shapes():
    builder = ResponseBuilder(parse(prompt="hi", n=2, logprobs=2), "cmpl-1", "served", TOKEN_TEXTS.get)
    response = builder.full_response([delta("Hello", 2, LOGPROBS, "length", cached=2),
                                      delta("!", 1, LOGPROBS[:1], "stop", cached=3)])
    assert response["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                 "prompt_tokens_details": {"cached_tokens": 2}}
    first = response["choices"][0]
    assert (first["index"], first["text"], first["finish_reason"]) == (0, "Hello", "length")
    assert first["logprobs"] == {"tokens": ["Hel", "lo"], "token_logprobs": [-0.5, -9999.0],
                                 "top_logprobs": [{"Hel": -0.5, "!": -2.0}, {"lo": -0.1, "!": -3.0}],
                                 "text_offset": [0, 3]}
    chat = ResponseBuilder(parse(chat=True, logprobs=True, top_logprobs=1), "c", "served", TOKEN_TEXTS.get)
    content = chat.full_response([delta("Hello", 2, LOGPROBS, "stop")])["choices"][0]
    assert content["message"] == {"role": "assistant", "content": "Hello"}
    assert content["logprobs"]["content"][0] == {
        "token": "Hel", "logprob": -0.5, "bytes": list(b"Hel"),
        "top_logprobs": [{"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel")},
                         {"token": "!", "logprob": -2.0, "bytes": list(b"!")}]}


def test_logprobs_name_tokens_by_id_on_request():
    builder = ResponseBuilder(parse(prompt="hi", logprobs=1, return_tokens_as_token_ids=True), "c", "m",
                              TOKEN_TEXTS.get)
    logprobs = builder.full_response([delta("Hello", 2, LOGPROBS, "stop")])["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["token_id:7", "token_id:8"]
    assert logprobs["top_logprobs"] == [{"token_id:7": -0.5, "token_id:9": -2.0},
                                        {"token_id:8": -0.1, "token_id:9": -3.0}]
    assert logprobs["text_offset"] == [0, 3]  # still the text's characters ("Hel", "lo")
    chat = ResponseBuilder(parse(chat=True, logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True),
                           "c", "m", TOKEN_TEXTS.get)
    content = chat.full_response([delta("Hello", 2, LOGPROBS, "stop")])["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["bytes"]) for c in content] == [("token_id:7", list(b"token_id:7")),
                                                           ("token_id:8", list(b"token_id:8"))]
    assert content[0]["top_logprobs"][1]["token"] == "token_id:9"


def test_prompt_logprobs_in_vllms_shape_with_each_tokens_rank():
    builder = ResponseBuilder(parse(prompt="hi", prompt_logprobs=1), "c", "m", TOKEN_TEXTS.get)
    result = GenerationDelta(request_id="r", text="!", usage=Usage(3, 1), finish_reason="stop", prompt_logprobs=[
        (8, Logprobs(-1.0, [9], [-0.5], token_rank=4)), (9, Logprobs(-0.5, [9], [-0.5], token_rank=1))])
    assert builder.full_response([result])["choices"][0]["prompt_logprobs"] == [
        None,
        {"9": {"logprob": -0.5, "rank": 1, "decoded_token": "!"},
         "8": {"logprob": -1.0, "rank": 4, "decoded_token": "lo"}},
        {"9": {"logprob": -0.5, "rank": 1, "decoded_token": "!"}}]


def test_stream_chunks_carry_the_role_once_and_usage_as_asked():
    parsed = parse(chat=True, stream=True, stream_options={"include_usage": True})
    builder = ResponseBuilder(parsed, "chatcmpl-1", "served", TOKEN_TEXTS.get)
    events = [builder.chunk(0, delta("Hel", 1)), builder.chunk(0, delta("lo", 2)),
              builder.chunk(0, delta("", 3, finish_reason="length")), builder.usage_chunk()]
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events]
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [{"role": "assistant", "content": "Hel"},
                                                             {"content": "lo"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "length"]
    assert [c["usage"] for c in chunks[:3]] == [None] * 3
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 3
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and {c["id"] for c in chunks} == {"chatcmpl-1"}
    continuous = ResponseBuilder(parse(stream=True, stream_options={"continuous_usage_stats": True}), "x",
                                 "served", TOKEN_TEXTS.get)
    chunk = json.loads(continuous.chunk(0, delta("Hel", 1)).removeprefix(b"data: "))
    assert chunk["usage"]["completion_tokens"] == 1 and chunk["choices"][0]["text"] == "Hel"
    assert "usage" not in json.loads(ResponseBuilder(parse(stream=True), "x", "s", TOKEN_TEXTS.get).chunk(
        0, delta("a", 1)).removeprefix(b"data: "))

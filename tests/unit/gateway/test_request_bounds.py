"""The documented per-request bounds, at the gateway's two edges: a request at every
bound is served; one past it is refused (gRPC INVALID_ARGUMENT, HTTP 400) with a message
naming the field and the bound. HTTP bodies nested too deep or with too long an integer
are 400 naming the problem."""
from __future__ import annotations

import http.client
import json

import grpc
import pytest

from common.engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from common.service.common_api import sampling_params_to_pb
from gateway.core import GatewaySettings
from gateway.openai_api.protocol import MAX_INTEGER_DIGITS, MAX_JSON_DEPTH, parse_body
from gateway.openai_api.server import OpenAIServer
from gateway.validation import MAX_CHAT_MESSAGES
from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc
from tests.support.background_gateway import BackgroundGateway

MAX_MODEL_LEN = 8192  # the bundled model's; 1024 empty chat messages take ~5,100 tokens
MODEL = "SmolLM2-135M-Instruct"
LONG_STOP = "\u00a7" * MAX_STOP_STRING_CHARS  # never in the fake's text


@pytest.fixture(scope="module")
def gw():
    with BackgroundGateway(GatewaySettings(max_model_len=MAX_MODEL_LEN, heartbeat_timeout_s=30.0)) as gateway:
        gateway.add_fake_decode("decode-0", token_ids=[504, 3458])
        server = gateway.call(lambda: OpenAIServer(gateway.gateway, port=0))
        gateway.http_address = gateway.call(server.start())
        try:
            yield gateway
        finally:
            gateway.call(server.stop())


# (field, value at the bound, value one past it, the bound the refusal names)
SAMPLING_BOUNDS = [
    ("stop", [LONG_STOP] * MAX_STOP_STRINGS, [LONG_STOP] * (MAX_STOP_STRINGS + 1), MAX_STOP_STRINGS),
    ("stop", [LONG_STOP], [LONG_STOP + "x"], MAX_STOP_STRING_CHARS),
    ("stop_token_ids", list(range(1, MAX_STOP_TOKEN_IDS + 1)), list(range(1, MAX_STOP_TOKEN_IDS + 2)),
     MAX_STOP_TOKEN_IDS),
    ("logprobs", MAX_LOGPROBS, MAX_LOGPROBS + 1, MAX_LOGPROBS),
]
MESSAGE = {"role": "user", "content": ""}


def grpc_generate(gw, request: generate_pb2.GenerateRequest) -> generate_pb2.GenerateResponse:
    with grpc.insecure_channel(gw.address) as channel:
        return generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=30)


def grpc_request(sampling: dict, **prompt) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(sampling=sampling_params_to_pb(SamplingParams(max_tokens=1)), **prompt)
    for name, value in sampling.items():  # set on the message: SamplingParams would refuse past the bound
        field = getattr(request.sampling, name)
        if isinstance(value, list):
            field.extend(value)
        else:
            setattr(request.sampling, name, value)
    if "text" not in prompt and "token_ids" not in prompt and "messages" not in prompt:
        request.text = "hi"
    return request


def assert_refused(error: grpc.RpcError, field: str, bound: int) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert field in error.details() and str(bound) in error.details(), error.details()


@pytest.mark.parametrize("field, at_bound, past_bound, bound", SAMPLING_BOUNDS)
def test_grpc_sampling_lists_at_the_bound_are_served_and_past_it_refused(gw, field, at_bound, past_bound, bound):
    assert grpc_generate(gw, grpc_request({field: at_bound})).finish_reason
    with pytest.raises(grpc.RpcError) as error:
        grpc_generate(gw, grpc_request({field: past_bound}))
    assert_refused(error.value, f"sampling.{field}", bound)


def test_grpc_prompt_token_ids_and_chat_messages_at_and_past_their_bounds(gw):
    at_len = generate_pb2.TokenIds(ids=[504] * (MAX_MODEL_LEN - 1))
    assert grpc_generate(gw, grpc_request({}, token_ids=at_len)).finish_reason
    with pytest.raises(grpc.RpcError) as error:
        grpc_generate(gw, grpc_request({}, token_ids=generate_pb2.TokenIds(ids=[504] * MAX_MODEL_LEN)))
    assert_refused(error.value, "prompt", MAX_MODEL_LEN)
    messages = generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(**MESSAGE)] * MAX_CHAT_MESSAGES)
    assert grpc_generate(gw, grpc_request({}, messages=messages)).finish_reason
    messages.messages.append(generate_pb2.ChatMessage(**MESSAGE))
    with pytest.raises(grpc.RpcError) as error:
        grpc_generate(gw, grpc_request({}, messages=messages))
    assert_refused(error.value, "messages", MAX_CHAT_MESSAGES)


def post(gw, path: str, body: dict) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(*gw.http_address.split(":"), timeout=30)
    try:
        connection.request("POST", path, body=json.dumps(body).encode(), headers={"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def assert_http_refused(reply: tuple[int, dict], param: str, bound: int) -> None:
    status, body = reply
    assert status == 400, body
    assert body["error"]["param"] == param and str(bound) in body["error"]["message"], body


@pytest.mark.parametrize("field, at_bound, past_bound, bound", SAMPLING_BOUNDS)
def test_http_sampling_lists_at_the_bound_are_served_and_past_it_refused(gw, field, at_bound, past_bound, bound):
    base = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    status, body = post(gw, "/v1/completions", {**base, field: at_bound})
    assert status == 200, body
    param = f"{field}[0]" if bound == MAX_STOP_STRING_CHARS else field
    assert_http_refused(post(gw, "/v1/completions", {**base, field: past_bound}), param, bound)


def test_http_top_logprobs_prompt_ids_and_messages_at_and_past_their_bounds(gw):
    chat = {"model": MODEL, "max_tokens": 1, "messages": [MESSAGE]}
    assert post(gw, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": MAX_LOGPROBS})[0] == 200
    assert_http_refused(post(gw, "/v1/chat/completions", {**chat, "logprobs": True,
                                                          "top_logprobs": MAX_LOGPROBS + 1}),
                        "top_logprobs", MAX_LOGPROBS)
    assert post(gw, "/v1/chat/completions", {**chat, "messages": [MESSAGE] * MAX_CHAT_MESSAGES})[0] == 200
    assert_http_refused(post(gw, "/v1/chat/completions", {**chat, "messages": [MESSAGE] * (MAX_CHAT_MESSAGES + 1)}),
                        "messages", MAX_CHAT_MESSAGES)
    completion = {"model": MODEL, "max_tokens": 1}
    assert post(gw, "/v1/completions", {**completion, "prompt": [504] * (MAX_MODEL_LEN - 1)})[0] == 200
    assert_http_refused(post(gw, "/v1/completions", {**completion, "prompt": [504] * MAX_MODEL_LEN}),
                        "prompt", MAX_MODEL_LEN)


def post_raw(gw, path: str, raw: bytes) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(*gw.http_address.split(":"), timeout=30)
    try:
        connection.request("POST", path, body=raw, headers={"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.parametrize("raw, problem", [
    (b"[" * 100_000 + b"]" * 100_000, f"more than {MAX_JSON_DEPTH} levels deep"),
    (b'{"model": "m", "metadata": ' + b'{"a": ' * MAX_JSON_DEPTH + b"1" + b"}" * (MAX_JSON_DEPTH + 1),
     f"more than {MAX_JSON_DEPTH} levels deep"),
    (b'{"model": "m", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "integer of 5000 digits"),
    (b'{"model": "m", "prompt": "hi", "seed": -' + b"1" * (MAX_INTEGER_DIGITS + 1) + b"}",
     f"at most {MAX_INTEGER_DIGITS}"),
])
def test_hostile_json_is_400_naming_the_problem(gw, raw, problem):
    status, body = post_raw(gw, "/v1/completions", raw)
    assert status == 400 and problem in body["error"]["message"], body
    assert body["error"]["code"] == "invalid_json"


def test_json_at_the_depth_and_number_bounds_parses():
    nested = b'{"a": ' * (MAX_JSON_DEPTH - 1) + b"[" + b"9" * MAX_INTEGER_DIGITS + b"]" + b"}" * (MAX_JSON_DEPTH - 1)
    value = parse_body(nested)
    for _ in range(MAX_JSON_DEPTH - 1):
        value = value["a"]
    assert value == [int("9" * MAX_INTEGER_DIGITS)]
    brackets_in_strings = json.dumps({"prompt": "[{" * 10_000, "stop": ["]}\\\""]}).encode()
    assert parse_body(brackets_in_strings)["prompt"] == "[{" * 10_000

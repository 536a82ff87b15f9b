"""The OpenAI HTTP front on a real in-process gateway (real gRPC, real uvicorn on
127.0.0.1) with the synthetic decode instance (bench.fakes.fake_decode): the official
`openai` client's calls, error statuses and bodies over HTTP, n fan-out, client
disconnects cancelling the decode call, draining, and `pdserve bench serve
--backend openai`. The real model is in tests/integration/test_openai_stack.py."""
from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import time
from contextlib import contextmanager

import grpc
import pytest

from bench.fakes.fake_decode import Failure
from common.text.chat_template import ChatTemplateOptions
from gateway.client import Client
from gateway.core import GatewaySettings
from gateway.openai_api.server import OpenAIServer
from tests.support.background_gateway import BackgroundGateway

openai = pytest.importorskip("openai")

TOKENS = [504, 3458, 314, 4649, 30]  # detokenize to English text with the bundled tokenizer
MODEL = "SmolLM2-135M-Instruct"


@contextmanager
def http_gateway(max_body_bytes: int | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, model=None, response_role: str = "assistant",
                 with_metrics: bool = False, allow_runtime_lora_updating: bool = False, **fake_kwargs):
    """A BackgroundGateway with one fake decode instance (unless fake_kwargs is None-like)
    and the OpenAI server on a free port (with_metrics: and its metrics endpoint); yields the
    BackgroundGateway."""
    server_kwargs = {"metrics_port": 0} if with_metrics else {}
    with BackgroundGateway(GatewaySettings(heartbeat_timeout_s=30.0), model=model, **server_kwargs) as gw:
        gw.fake = gw.add_fake_decode("decode-0", **fake_kwargs) if fake_kwargs else None
        kwargs = {"max_body_bytes": max_body_bytes} if max_body_bytes else {}
        kwargs.update(tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                      response_role=response_role, allow_runtime_lora_updating=allow_runtime_lora_updating)
        server = gw.server.openai_http = gw.call(lambda: OpenAIServer(gw.gateway, port=0, **kwargs))
        gw.http_address = gw.call(server.start())
        try:
            yield gw
        finally:
            gw.call(server.stop())


@pytest.fixture(scope="module")
def gw():
    with http_gateway(token_ids=TOKENS, delay_s=0.002) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def client(gw):
    return openai.OpenAI(base_url=f"http://{gw.http_address}/v1", api_key="unused", max_retries=0, timeout=30)


def post(address: str, path: str, body: bytes | dict, method: str = "POST") -> tuple[int, dict]:
    connection = http.client.HTTPConnection(*address.split(":"), timeout=30)
    try:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        connection.request(method, path, body=raw if method == "POST" else None,
                           headers={"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def wait_for(condition, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_models_health_and_unknown_routes(gw, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "pdserve")
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.body["code"] == "model_not_found"
    import importlib.metadata
    assert post(gw.http_address, "/version", b"", method="GET") == (
        200, {"version": importlib.metadata.version("pdserve")})
    assert post(gw.http_address, "/health", b"", method="GET") == (200, {"status": "ok"})
    status, body = post(gw.http_address, "/v1/audio/speech", {"model": MODEL})
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body = post(gw.http_address, "/v1/completions", b"", method="GET")
    assert status == 405 and body["error"]["type"] == "invalid_request_error"


def test_tokenize_gives_the_ids_generation_counts_and_detokenize_their_text(gw, client):
    tokenizer, address = gw.gateway.model.tokenizer, gw.http_address
    status, body = post(address, "/tokenize", {"model": MODEL, "prompt": "Hello there", "return_token_strs": True})
    ids = tokenizer.encode("Hello there")
    assert status == 200 and body == {"count": len(ids), "max_model_len": gw.gateway.max_model_len, "tokens": ids,
                                      "token_strs": [tokenizer.decode([t], skip_special_tokens=False) for t in ids]}
    assert client.completions.create(model=MODEL, prompt="Hello there", max_tokens=1).usage.prompt_tokens == len(ids)
    messages = [{"role": "user", "content": "Hi"}]
    status, chat = post(address, "/tokenize", {"messages": messages})
    assert status == 200 and chat["tokens"] == tokenizer.apply_chat_template(messages) and chat["token_strs"] is None
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens == \
        chat["count"]
    _, without_header = post(address, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert chat["tokens"][:without_header["count"]] == without_header["tokens"] < chat["tokens"]
    assert post(address, "/detokenize", {"model": MODEL, "tokens": TOKENS}) == (
        200, {"prompt": tokenizer.decode(TOKENS, skip_special_tokens=False)})


def test_chat_template_options_shape_the_prompt_and_echo_the_prefilled_answer(gw, client):
    tokenizer, address = gw.gateway.model.tokenizer, gw.http_address
    started = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "One colour is"}]
    options = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    expected = tokenizer.apply_chat_template(started, options)
    assert tokenizer.decode(expected, skip_special_tokens=False).endswith("One colour is")
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    _, tokenized = post(address, "/tokenize", {"messages": started, **flags})
    assert tokenized["tokens"] == expected
    text = tokenizer.decode(TOKENS)
    chat = client.chat.completions.create(model=MODEL, messages=started, max_tokens=5, extra_body=flags)
    assert chat.usage.prompt_tokens == len(expected)
    assert chat.choices[0].message.content == text and chat.choices[0].message.role == "assistant"
    echoed = client.chat.completions.create(model=MODEL, messages=started, max_tokens=5,
                                            extra_body={**flags, "echo": True})
    assert echoed.choices[0].message.content == "One colour is" + text
    stream = list(client.chat.completions.create(model=MODEL, messages=started, max_tokens=5, stream=True,
                                                 extra_body={**flags, "echo": True}))
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "One colour is" + text
    # echo repeats only a message of the answer's role: after a user's turn there is nothing to repeat
    asked = client.chat.completions.create(model=MODEL, messages=started[:1], max_tokens=5, extra_body={"echo": True})
    assert asked.choices[0].message.content == text
    # no generation prompt after a user's turn: the answer speaks as the user (vLLM's rule)
    as_user = client.chat.completions.create(model=MODEL, messages=started[:1], max_tokens=5,
                                             extra_body={"add_generation_prompt": False})
    assert as_user.choices[0].message.role == "user"
    assert as_user.usage.prompt_tokens == len(tokenizer.apply_chat_template(
        started[:1], ChatTemplateOptions(add_generation_prompt=False)))
    with_bos = client.chat.completions.create(model=MODEL, messages=started[:1], max_tokens=5,
                                              extra_body={"add_special_tokens": True})
    assert with_bos.usage.prompt_tokens == len(tokenizer.apply_chat_template(started[:1], add_special_tokens=True))


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
HERMES_ANSWER = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_auto_tool_choice_reads_the_models_calls_with_the_servers_parser(gw):
    from gateway.validation import load_served_model
    token_ids = load_served_model(None).tokenizer.encode(HERMES_ANSWER, add_special_tokens=False)
    with http_gateway(tool_call_parser="hermes", token_ids=token_ids, delay_s=0.001) as hermes:
        client = openai.OpenAI(base_url=f"http://{hermes.http_address}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL],
                                                max_tokens=len(token_ids))
        choice = answer.choices[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", "Let me look. ")
        (call,) = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        sent = hermes.fake.servicer.requests[-1]
        assert not sent.sampling.HasField("structured_output")  # "auto" constrains nothing
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL],
                                                     max_tokens=len(token_ids), stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me look. "
        assert all(c.choices[0].delta.tool_calls is None for c in chunks[:-1])
        (streamed,) = chunks[-1].choices[0].delta.tool_calls
        assert (streamed.index, streamed.function.name, streamed.function.arguments) == (
            0, "get_weather", call.function.arguments)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # an answer cut short inside its call: what was held back comes out as content
        cut = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=8)
        assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None
        assert cut.choices[0].message.content == load_served_model(None).tokenizer.decode(token_ids[:8])
    # the module's server has no parser: "auto" is refused, saying what to send instead
    status, error = post(gw.http_address, "/v1/chat/completions",
                         {"model": MODEL, "messages": messages, "tools": [WEATHER_TOOL]})
    assert (status, error["error"]["param"], error["error"]["code"]) == (400, "tool_choice", "unsupported_value")
    assert "--tool-call-parser" in error["error"]["message"]


def test_the_mistral_parser_keeps_special_tokens_and_gives_mistral_call_ids():
    from gateway.validation import load_served_model
    answer = 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    token_ids = load_served_model(None).tokenizer.encode(answer, add_special_tokens=False)
    with http_gateway(tool_call_parser="mistral", token_ids=token_ids, delay_s=0.001) as mistral:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                "tools": [WEATHER_TOOL], "max_tokens": len(token_ids)}
        status, reply = post(mistral.http_address, "/v1/chat/completions", body)
        message = reply["choices"][0]["message"]
        assert status == 200 and message["content"] == "Checking."
        (call,) = message["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        assert len(call["id"]) == 9 and call["id"].isalnum()  # the only ids Mistral's templates take back
        sent = mistral.call(lambda: mistral.fake.servicer.requests[-1])
        assert sent.sampling.skip_special_tokens is False  # [TOOL_CALLS] is a special token


def test_the_servers_reasoning_parser_splits_the_thinking_off():
    from gateway.main import build_parser
    from gateway.validation import load_served_model
    answer = "<think>\nThe capital of France.\n</think>\n\nParis."
    token_ids = load_served_model(None).tokenizer.encode(answer, add_special_tokens=False)
    with http_gateway(reasoning_parser="deepseek_r1", token_ids=token_ids, delay_s=0.001) as r1:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Capital of France?"}],
                "max_tokens": len(token_ids)}
        status, reply = post(r1.http_address, "/v1/chat/completions", body)
        assert status == 200 and reply["choices"][0]["message"] == {
            "role": "assistant", "reasoning": "\nThe capital of France.\n", "content": "\n\nParis."}
        status, plain = post(r1.http_address, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                                   "max_tokens": len(token_ids)})
        assert plain["choices"][0]["text"] == answer  # completions are text as generated
    assert build_parser().parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"


def test_a_structured_output_waits_for_the_reasoning_to_end():
    from gateway.validation import load_served_model
    tokenizer = load_served_model(None).tokenizer
    answer = '<think>\nAn object.\n</think>\n\n{"a": 1}'
    token_ids = tokenizer.encode(answer, add_special_tokens=False)
    end_ids = tokenizer.encode("</think>", add_special_tokens=False)
    ask = [{"role": "user", "content": "Some JSON?"}]
    with http_gateway(reasoning_parser="qwen3", token_ids=token_ids, delay_s=0.001) as r:
        def sent_constraint(body: dict, stream: bool = False):
            if not stream:
                status, reply = post(r.http_address, "/v1/chat/completions", body)
                assert status == 200, reply
                return reply["choices"][0]["message"], r.call(lambda: r.fake.servicer.requests[-1])
            client = openai.OpenAI(base_url=f"http://{r.http_address}/v1", api_key="unused", max_retries=0)
            deltas = [c.choices[0].delta.model_dump(exclude_none=True)
                      for c in client.chat.completions.create(**body, stream=True) if c.choices]
            message = {"reasoning": "".join(d.get("reasoning", "") for d in deltas),
                       "content": "".join(d.get("content") or "" for d in deltas)}
            return message, r.call(lambda: r.fake.servicer.requests[-1])

        body = {"model": MODEL, "messages": ask, "max_tokens": len(token_ids),
                "response_format": {"type": "json_object"}}
        message, sent = sent_constraint(body)
        # the instance holds the constraint back until "</think>"; the answer splits as unconstrained ones do
        assert list(sent.sampling.structured_output.start_after_token_ids) == end_ids
        assert sent.sampling.structured_output.json_object
        assert message == {"role": "assistant", "reasoning": "\nAn object.\n", "content": '\n\n{"a": 1}'}
        message, sent = sent_constraint(body, stream=True)
        assert message == {"reasoning": "\nAn object.\n", "content": '\n\n{"a": 1}'}
        assert list(sent.sampling.structured_output.start_after_token_ids) == end_ids
        # the prompt closed the thinking (an answer continued after it): constrained from the first token
        closed = {**body, "messages": ask + [{"role": "assistant", "content": "<think>\n</think>\n"}],
                  "add_generation_prompt": False, "continue_final_message": True}
        message, sent = sent_constraint(closed)
        assert not sent.sampling.structured_output.start_after_token_ids and sent.sampling.structured_output.json_object
        assert message == {"role": "assistant", "content": answer}  # not read for reasoning
        # a forced tool call may think first too
        free = {k: v for k, v in body.items() if k != "response_format"}
        forced = {**free, "tools": [WEATHER_TOOL],
                  "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        _, sent = sent_constraint(forced)
        assert sent.sampling.structured_output.json
        assert list(sent.sampling.structured_output.start_after_token_ids) == end_ids
        _, sent = sent_constraint(free)
        assert not sent.sampling.HasField("structured_output")


PIRATE_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
                   "{% if add_generation_prompt %}<pirate>{% endif %}")


def test_a_requests_own_chat_template_runs_only_where_the_gateway_trusts_them(gw, client):
    from gateway.main import build_parser
    from gateway.validation import load_served_model
    ask = [{"role": "user", "content": "Ahoy?"}]
    body = {"model": MODEL, "messages": ask, "max_tokens": 2, "chat_template": PIRATE_TEMPLATE}
    status, error = post(gw.http_address, "/v1/chat/completions", body)
    assert (status, error["error"]["param"]) == (400, "chat_template")
    assert "--trust-request-chat-template" in error["error"]["message"]
    status, error = post(gw.http_address, "/tokenize", {"messages": ask, "chat_template": PIRATE_TEMPLATE})
    assert (status, error["error"]["param"]) == (400, "chat_template")
    status, document = post(gw.http_address, "/openapi.json", b"", method="GET")
    assert "chat_template" not in document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    pirate = ChatTemplateOptions(chat_template=PIRATE_TEMPLATE)
    with Client(gw.address, timeout=10) as grpc_client, pytest.raises(grpc.RpcError) as refused:
        grpc_client.generate(messages=ask, chat_options=pirate, max_tokens=2)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--trust-request-chat-template" in refused.value.details()
    trusting = load_served_model(None, trust_request_chat_template=True)
    with http_gateway(model=trusting, response_role="captain", token_ids=TOKENS) as trusted:
        tokenizer = trusted.gateway.model.tokenizer
        status, tokens = post(trusted.http_address, "/tokenize", {"messages": ask, "chat_template": PIRATE_TEMPLATE})
        assert status == 200 and tokens["tokens"] == tokenizer.encode("<user>Ahoy?</user><pirate>",
                                                                       add_special_tokens=False)
        status, reply = post(trusted.http_address, "/v1/chat/completions", body)
        assert status == 200 and reply["choices"][0]["message"]["role"] == "captain"  # --response-role
        sent = trusted.call(lambda: trusted.fake.servicer.requests[-1])
        assert list(sent.prompt_token_ids) == tokens["tokens"]
        with Client(trusted.address, timeout=10) as grpc_client:
            by_grpc = grpc_client.generate(messages=ask, chat_options=pirate, max_tokens=2, return_token_ids=True)
        assert by_grpc.prompt_token_ids == tokens["tokens"]
        status, error = post(trusted.http_address, "/v1/chat/completions", {**body, "chat_template": "{% if %}"})
        assert status == 400 and error["error"]["param"] == "messages"  # a template that does not parse
        status, document = post(trusted.http_address, "/openapi.json", b"", method="GET")
        assert "chat_template" in document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    args = build_parser().parse_args(["--trust-request-chat-template", "--response-role", "captain"])
    assert args.trust_request_chat_template and args.response_role == "captain"


def test_vllms_auto_tool_flag_needs_a_parser(capsys):
    from gateway.main import build_parser, main
    with pytest.raises(SystemExit) as exited:
        main(["--enable-auto-tool-choice"])
    assert exited.value.code == 2 and "needs --tool-call-parser" in capsys.readouterr().err
    args = build_parser().parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.tool_call_parser == "hermes"


def test_truncate_prompt_tokens_keeps_the_prompts_end_and_echo_shows_it(gw, client):
    tokenizer = gw.gateway.model.tokenizer
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(prompt)
    kept = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"truncate_prompt_tokens": 3})
    assert kept.usage.prompt_tokens == 3 and list(gw.fake.servicer.requests[-1].prompt_token_ids) == ids[-3:]
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True,
                                       extra_body={"truncate_prompt_tokens": 3})
    kept_text = tokenizer.decode(ids[-3:], skip_special_tokens=False)
    assert echoed.choices[0].text == kept_text + tokenizer.decode(TOKENS[:2])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    for body in ({"prompt": prompt}, {"prompt": prompt, "echo": True}):
        status, error = post(gw.http_address, "/v1/completions",
                             {"model": MODEL, **body, "max_tokens": 2, "truncate_prompt_tokens": 10**6})
        assert (status, error["error"]["param"]) == (400, "truncate_prompt_tokens"), error
        assert "is more than the model's maximum length" in error["error"]["message"]


def test_tokenize_lists_tools_and_documents_as_generation_does(gw, client):
    tokenizer, address = gw.gateway.model.tokenizer, gw.http_address
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    documents = [{"title": "Paris", "text": "Sunny."}]
    options = ChatTemplateOptions(tools=tools, documents=documents)
    status, body = post(address, "/tokenize", {"messages": messages, "tools": tools, "documents": documents})
    assert status == 200 and body["tokens"] == tokenizer.apply_chat_template(messages, options)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                          extra_body={"documents": documents})
    assert chat.usage.prompt_tokens == len(tokenizer.apply_chat_template(
        messages, ChatTemplateOptions(documents=documents)))
    for path in ("/v1/chat/completions", "/tokenize"):
        status, error = post(address, path, {"model": MODEL, "messages": messages, "documents": [{"title": 1}]})
        assert (status, error["error"]["param"]) == (400, "documents"), error
    status, error = post(address, "/tokenize", {"prompt": "hi", "documents": documents})
    assert (status, error["error"]["param"]) == (400, "documents")


@pytest.mark.parametrize("body, param", [
    ({"continue_final_message": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"a b": 1}}, "chat_template_kwargs"),
])
def test_bad_chat_template_options_name_the_field(gw, body, param):
    messages = [{"role": "user", "content": "Hi"}]
    for path in ("/v1/chat/completions", "/tokenize"):
        status, error = post(gw.http_address, path, {"model": MODEL, "messages": messages, **body})
        assert (status, error["error"]["param"]) == (400, param), error
    status, error = post(gw.http_address, "/tokenize", {"prompt": "Hi", **body})
    assert (status, error["error"]["param"]) == (400, next(iter(body))), error


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
    ("/tokenize", {"prompt": ""}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"prompt": "a" * 262_145}, 400, "prompt"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
    ("/tokenize", {"prompt": "a", "truncate": 3}, 400, "truncate"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [5, -1]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [5, 49_152]}, 400, "tokens[1]"),
    ("/detokenize", {"model": "other", "tokens": [5]}, 404, "model"),
])
def test_bad_tokenize_and_detokenize_requests_name_the_field(gw, path, body, status, param):
    got, error = post(gw.http_address, path, body)
    assert (got, error["error"]["param"]) == (status, param), error


def test_completion_and_chat_unary_and_streamed_agree(gw, client):
    tokenizer = gw.gateway.model.tokenizer
    text = tokenizer.decode(TOKENS)
    unary = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5)
    assert unary.choices[0].text == text and unary.choices[0].finish_reason == "length"
    num_prompt = len(tokenizer.encode("Hello there"))
    assert (unary.usage.prompt_tokens, unary.usage.completion_tokens, unary.usage.total_tokens) == (
        num_prompt, 5, num_prompt + 5)
    chunks = list(client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5)
    assert chat.choices[0].message.content == text and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(tokenizer.apply_chat_template(messages))
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == text
    assert stream[-1].choices[0].finish_reason == "length"


def test_return_token_ids_gives_the_prompts_and_each_choices_ids_in_vllms_places(gw, client):
    tokenizer = gw.gateway.model.tokenizer
    asked = {"return_token_ids": True}
    prompt_ids = tokenizer.encode("Hello there")
    unary = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, n=2, extra_body=asked)
    for choice in unary.choices:
        assert (choice.prompt_token_ids, choice.token_ids) == (prompt_ids, TOKENS[:5])
    chunks = [c.choices[0] for c in client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5,
                                                              stream=True, extra_body=asked)]
    assert chunks[0].prompt_token_ids == prompt_ids and not any(hasattr(c, "prompt_token_ids") for c in chunks[1:])
    assert [t for c in chunks for t in c.token_ids] == TOKENS[:5]
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, extra_body=asked)
    assert chat.prompt_token_ids == tokenizer.apply_chat_template(messages) and chat.choices[0].token_ids == TOKENS[:5]
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, stream=True,
                                                 extra_body=asked))
    assert stream[0].prompt_token_ids == chat.prompt_token_ids and not hasattr(stream[1], "prompt_token_ids")
    assert [t for c in stream for t in c.choices[0].token_ids] == TOKENS[:5]
    plain = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5)
    assert "token_ids" not in plain.choices[0].model_dump(exclude_unset=True)  # only when asked


def test_what_reaches_decode_is_the_requests_sampling(gw, client):
    client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, temperature=0.5, top_p=0.9,
                              seed=3, extra_body={"top_k": 5, "ignore_eos": True, "min_tokens": 2})
    sent = gw.call(lambda: gw.fake.servicer.requests[-1])
    assert list(sent.prompt_token_ids) == [1, 2, 3] and sent.request_id.startswith("cmpl-")
    s = sent.sampling
    assert (s.max_tokens, s.top_k, s.seed, s.min_tokens, s.ignore_eos) == (4, 5, 3, 2, True)
    assert (round(s.temperature, 3), round(s.top_p, 3)) == (0.5, 0.9)


def test_n_fans_out_into_seeded_requests_and_usage_counts_the_prompt_once(gw, client):
    before = gw.call(lambda: len(gw.fake.servicer.requests))
    result = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, n=3, seed=40,
                                       temperature=1.0)
    sent = gw.call(lambda: gw.fake.servicer.requests[before:])
    assert sorted(r.request_id.rsplit("-", 1)[1] for r in sent) == ["0", "1", "2"]
    assert sorted(r.sampling.seed for r in sent) == [40, 41, 42]
    assert [c.index for c in result.choices] == [0, 1, 2]
    num_prompt = len(gw.gateway.model.tokenizer.encode("Hello there"))
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (num_prompt, 9)
    streamed = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=3, n=2, stream=True,
                                                   stream_options={"include_usage": True}))
    assert {c.choices[0].index for c in streamed[:-1]} == {0, 1}
    assert sum(1 for c in streamed[:-1] if c.choices[0].delta.role) == 2  # each choice's first chunk
    assert streamed[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("body", [
    b'{"model": "SmolLM2-135M-Instruct", "prompt": "hi", ',
    {"model": MODEL, "prompt": "hi", "max_tokenz": 3},
    {"model": MODEL, "prompt": "hi", "max_tokens": "3"},
    {"model": MODEL, "prompt": "hi", "top_p": 1.5},
])
def test_bad_requests_are_400_with_openais_error_body_over_http(gw, body):
    status, response = post(gw.http_address, "/v1/completions", body)
    assert status == 400 and set(response["error"]) == {"message", "type", "param", "code"}
    assert response["error"]["type"] == "invalid_request_error"
    expected_param = None if isinstance(body, bytes) else [k for k in body if k not in ("model", "prompt")][0]
    assert response["error"]["param"] == expected_param
    if expected_param:
        assert expected_param in response["error"]["message"]


def test_gateway_validation_errors_keep_their_400_and_name_the_field(gw, client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
    assert error.value.body["param"] == "max_tokens" and error.value.body["code"] == "invalid_argument"
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt=[10**6])  # not in the vocabulary
    assert error.value.body["param"] == "prompt"
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-4o", prompt="hi")
    assert error.value.body["code"] == "model_not_found" and error.value.body["param"] == "model"
    status, body = post(gw.http_address, "/v1/completions", b"x" * (5 << 20))
    assert status == 413 and body["error"]["code"] == "body_too_large"


@pytest.mark.parametrize("code, http_status", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 500)])
def test_grpc_statuses_become_their_http_codes_unary_and_before_the_first_chunk(code, http_status):
    with http_gateway(token_ids=TOKENS, failure=Failure(code, after_tokens=0)) as gw:
        for stream in (False, True):
            status, body = post(gw.http_address, "/v1/completions",
                                {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": stream})
            assert status == http_status, body
            assert "decode-0" in body["error"]["message"] and body["error"]["code"] == code.name.lower()


@pytest.mark.parametrize("constraint, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json")])
def test_a_constraint_the_engine_refuses_is_a_400_naming_its_field(constraint, field):
    refusal = 'structured_outputs.json is not supported: Unsupported type "nonsense"'
    with http_gateway(token_ids=TOKENS, failure=Failure(grpc.StatusCode.INVALID_ARGUMENT, details=refusal)) as gw:
        for stream in (False, True):
            status, body = post(gw.http_address, "/v1/chat/completions",
                                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream,
                                 **constraint})
            assert status == 400
            assert body["error"] == {"message": refusal, "type": "invalid_request_error", "param": field,
                                     "code": "invalid_argument"}


def test_a_failure_mid_stream_ends_it_with_an_error_event():
    with http_gateway(token_ids=TOKENS, failure=Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, after_tokens=2)) as gw:
        client = openai.OpenAI(base_url=f"http://{gw.http_address}/v1", api_key="x", max_retries=0)
        received = []
        with pytest.raises(openai.APIError) as error:
            for chunk in client.completions.create(model=MODEL, prompt="hi", max_tokens=5, stream=True):
                received.append(chunk.choices[0].text)
        assert received and "injected failure" in str(error.value.message)


def test_no_decode_instance_is_503_and_draining_is_503_on_health_too():
    with http_gateway() as gw:  # no decode instance registered
        status, body = post(gw.http_address, "/v1/chat/completions",
                            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert status == 503 and body["error"]["type"] == "service_unavailable_error"
        gw.call(lambda: setattr(gw.gateway, "draining", True))
        assert post(gw.http_address, "/health", b"", method="GET")[0] == 503
        assert post(gw.http_address, "/v1/completions", {"model": MODEL, "prompt": "hi"})[0] == 503


def raw_request(address: str, body: dict) -> socket.socket:
    """Send a POST on a bare socket (so the test decides when the connection drops)."""
    host, port = address.split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    raw = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_the_decode_call(stream):
    with http_gateway(token_ids=TOKENS, delay_s=0.05) as gw:  # 400 tokens: 20 s unless cancelled
        servicer = gw.fake.servicer
        sock = raw_request(gw.http_address, {"model": MODEL, "prompt": "hi", "max_tokens": 400, "stream": stream})
        wait_for(lambda: gw.call(lambda: len(servicer.running)) == 1, what="the decode call")
        received = b""
        while stream and b"data: " not in received:  # tokens are flowing
            received += sock.recv(65536)
        sock.close()
        wait_for(lambda: gw.call(lambda: len(servicer.cancelled)) == 1, what="the decode call's cancellation")
        assert gw.call(lambda: (len(servicer.running), len(gw.gateway.request_ids))) == (0, 0)


def test_a_client_gone_in_the_middle_of_its_body_leaves_nothing_behind(caplog):
    with http_gateway(token_ids=TOKENS) as gw:
        host, port = gw.http_address.split(":")
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\":")
        connections = gw.server.openai_http._server.server_state.connections
        wait_for(lambda: gw.call(lambda: len(connections)) == 1, what="the connection")
        sock.close()
        wait_for(lambda: gw.call(lambda: len(connections)) == 0, what="the connection to close")
        assert post(gw.http_address, "/health", b"", method="GET")[0] == 200
        assert gw.call(lambda: len(gw.fake.servicer.requests)) == 0
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text


def test_each_chunk_is_sent_the_moment_its_token_arrives():
    # The fake sends its first token at once and the second 30 s later: the first chunk
    # must not wait for the second.
    with http_gateway(token_ids=TOKENS, delay_s=30.0) as gw:
        sock = raw_request(gw.http_address, {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True})
        received = b""
        while b"data: " not in received:
            received += sock.recv(65536)  # the socket's 10 s timeout fails the test
        sock.close()
        wait_for(lambda: gw.call(lambda: len(gw.fake.servicer.cancelled)) == 1, what="the cancellation")


def test_bench_serve_openai_backend_counts_tokens_exactly(tmp_path):
    """Three tokens per decode message: one text chunk carries three tokens, and the
    usage chunk makes the count exact anyway."""
    from bench.serve.main import main
    out = tmp_path / "openai.json"
    with http_gateway(token_ids=TOKENS, tokens_per_message=3, delay_s=0.001) as gw:
        rc = main(["--backend", "openai", "--base-url", f"http://{gw.http_address}/v1", "--tokenizer", "bundled",
                   "--random-input-len", "16", "--random-output-len", "7", "--num-prompts", "6",
                   "--max-concurrency", "3", "--disable-tqdm", "--json", str(out)])
        sent = gw.call(lambda: list(gw.fake.servicer.requests))
    assert rc == 0
    run = json.loads(out.read_text())["runs"][0]
    assert (run["completed"], run["failed"]) == (6, 0) and run["output_lens"] == [7] * 6
    assert run["total_input_tokens"] == 6 * 16 and all(t > 0 for t in run["ttfts"])
    assert {len(r.prompt_token_ids) for r in sent[1:]} == {16}  # token ids sent as the prompt: exact
    assert {(r.sampling.max_tokens, r.sampling.ignore_eos) for r in sent[1:]} == {(7, True)}
    assert main(["--backend", "openai", "--base-url", "http://127.0.0.1:1", "--num-prompts", "1",
                 "--disable-tqdm"]) == 1


def test_the_models_generation_config_fills_what_a_request_leaves_unset(tmp_path):
    """vLLM's --generation-config auto: the model's sampling where a request leaves a field
    unset, its max_new_tokens a bound on every request; 'vllm' leaves requests as sent."""
    from gateway.validation import load_served_model
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 3}))
    messages = [{"role": "user", "content": "Hi"}]
    with http_gateway(model=load_served_model(None, generation_config=str(tmp_path)), token_ids=TOKENS) as gw:
        client = openai.OpenAI(base_url=f"http://{gw.http_address}/v1", api_key="unused", max_retries=0)

        def sent():
            sampling = gw.call(lambda: gw.fake.servicer.requests[-1].sampling)
            return (pytest.approx(sampling.temperature), pytest.approx(sampling.top_p), sampling.top_k,
                    sampling.max_tokens)
        client.chat.completions.create(model=MODEL, messages=messages)
        assert sent() == (0.6, 0.95, 20, 3)
        client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=10)
        assert sent() == (0.0, 0.95, 20, 3)  # the request's own value wins; the bound holds
        client.completions.create(model=MODEL, prompt="Hi", top_p=0.5, max_tokens=2)
        assert sent() == (0.6, 0.5, 20, 2)
        assert client.responses.create(model=MODEL, input="Hi").temperature == pytest.approx(0.6)
    with http_gateway(model=load_served_model(None, generation_config="vllm"), token_ids=TOKENS) as plain:
        client = openai.OpenAI(base_url=f"http://{plain.http_address}/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        sampling = plain.call(lambda: plain.fake.servicer.requests[-1].sampling)
        assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens) == (1.0, 1.0, -1, 4)


def test_several_served_model_names_are_each_listed_and_each_answered():
    """vLLM's --served-model-name A B: requests may use either, answers name the first,
    /v1/models lists both; any other name is still a 404."""
    from gateway.validation import load_served_model
    with http_gateway(model=load_served_model(None, served_model_name=["gpt-4o", "smol"]), token_ids=TOKENS) as gw:
        client = openai.OpenAI(base_url=f"http://{gw.http_address}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["gpt-4o", "smol"]
        assert client.models.retrieve("smol").id == "smol"
        for name in ("gpt-4o", "smol"):
            assert client.completions.create(model=name, prompt="Hi", max_tokens=2).model == "gpt-4o"
        status, error = post(gw.http_address, "/v1/completions", {"model": "other", "prompt": "Hi"})
        assert (status, error["error"]["code"]) == (404, "model_not_found")
        assert post(gw.http_address, "/v1/models/other", b"", method="GET")[0] == 404


def test_sagemakers_routes_dispatch_by_the_body_as_vllm_serves_them(gw):
    """POST /invocations: messages -> chat, prompt -> completions, input -> embeddings; /ping
    is liveness."""
    address = gw.http_address
    status, chat = post(address, "/invocations", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 2})
    assert status == 200 and chat["object"] == "chat.completion"
    status, completion = post(address, "/invocations", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert status == 200 and completion["object"] == "text_completion"
    status, embedding = post(address, "/invocations", {"model": MODEL, "input": "Hi"})
    assert status == 200 and embedding["data"][0]["object"] == "embedding"
    status, error = post(address, "/invocations", {"model": MODEL})
    assert (status, error["error"]["param"], error["error"]["code"]) == (400, "messages", "missing_field")
    status, error = post(address, "/invocations", {"model": MODEL, "prompt": "Hi", "temperature": 9})
    assert (status, error["error"]["param"]) == (400, "temperature")  # the completions parser's own refusal
    assert post(address, "/ping", b"", method="GET") == (200, {"status": "ok"})
    assert post(address, "/ping", b"")[0] == 200


def test_beam_search_over_the_fake_and_an_instance_that_drops_its_logprobs(gw, monkeypatch):
    """The fake instance sends logprobs as an engine does, so an HTTP beam search runs over it;
    a step that comes back without them is the instance's fault: a 500 saying so, never an
    IndexError (schemathesis found that one through /invocations)."""
    import gateway.beam_search as beam_search_module
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "n": 2, "use_beam_search": True}
    status, beams = post(gw.http_address, "/v1/completions", body)
    assert status == 200 and len(beams["choices"]) == 2
    real = beam_search_module.generate_choices

    async def without_logprobs(gateway, requests):
        return [dataclasses.replace(result, logprobs=[]) for result in await real(gateway, requests)]
    monkeypatch.setattr(beam_search_module, "generate_choices", without_logprobs)
    status, error = post(gw.http_address, "/v1/completions", body)
    assert status == 500 and "without the logprobs it asked for" in error["error"]["message"]

"""The Python clients, `pdserve generate` and `pdserve up`'s flag routing, against the
in-process gateway with a synthetic decode (these test the client side only; real
decode behaviour is in test_gateway_streaming.py and tests/integration)."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from common.cli import generate as cli_client
from common.cli.processes import route_flags
from common.text.chat_template import ChatTemplateOptions
from gateway.api import generate_input_from_pb
from gateway.client import AsyncClient, Client, build_generate_request
from tests.support.background_gateway import BackgroundGateway

TOKENS = [1000, 1001, 1002]


@pytest.fixture(scope="module")
def gateway():
    with BackgroundGateway() as gw:
        gw.fake = gw.add_fake_decode("decode-0", token_ids=TOKENS, delay_s=0.01)
        yield gw


def wait_for(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_prompt_forms_and_sampling_reach_decode(gateway):
    with Client(gateway.address, timeout=10) as client:
        client.generate("hello", max_tokens=3)
        client.generate([5, 6, 7], max_tokens=3)
        client.generate(token_ids=[8, 9], max_tokens=3, top_k=5, seed=7)
        client.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    sent = gateway.fake.servicer.requests[-4:]
    assert list(sent[1].prompt_token_ids) == [5, 6, 7] and list(sent[2].prompt_token_ids) == [8, 9]
    assert (sent[2].sampling.top_k, sent[2].sampling.seed) == (5, 7)
    chat_ids = gateway.gateway.model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert list(sent[3].prompt_token_ids) == chat_ids


def test_chat_template_options_travel_over_grpc(gateway):
    tokenizer = gateway.gateway.model.tokenizer
    started = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}]
    options = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True,
                                  chat_template_kwargs={"persona": "pirate", "year": 2026})
    with Client(gateway.address, timeout=10) as client:
        client.generate(messages=started, max_tokens=3, chat_options=options)
        client.generate(messages=started[:1], max_tokens=3, add_special_tokens=True)
        client.generate("hello", max_tokens=3, add_special_tokens=False)
    continued, with_special, text = gateway.fake.servicer.requests[-3:]
    assert list(continued.prompt_token_ids) == tokenizer.apply_chat_template(started, options)
    assert list(with_special.prompt_token_ids) == tokenizer.apply_chat_template(started[:1], add_special_tokens=True)
    assert list(text.prompt_token_ids) == tokenizer.encode("hello", add_special_tokens=False)
    request = build_generate_request(started, chat_options=options)
    assert generate_input_from_pb(request).chat_options == options  # integers stay integers
    with_tools = [*started[:1], {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                  {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"}]
    tools = ChatTemplateOptions(tools=[{"type": "function", "function": {"name": "get_weather"}}])
    received = generate_input_from_pb(build_generate_request(with_tools, chat_options=tools))
    assert (received.messages, received.chat_options) == (with_tools, tools)


def test_bad_chat_template_options_are_invalid_argument(gateway):
    request = build_generate_request([{"role": "user", "content": "hi"}])
    request.messages.continue_final_message = True  # with the default generation prompt
    with Client(gateway.address, timeout=10) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client._stub.Generate(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("messages.continue_final_message: cannot be true")
        request.messages.continue_final_message = False
        request.messages.chat_template_kwargs_json = "{not json"
        with pytest.raises(grpc.RpcError) as refused:
            client._stub.Generate(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "chat_template_kwargs_json: not JSON" in refused.value.details()
    with pytest.raises(ValueError, match="only to a prompt of chat messages"):
        build_generate_request("hi", chat_options=ChatTemplateOptions())


def test_bad_arguments_raise_before_sending(gateway):
    with Client(gateway.address) as client:
        with pytest.raises(ValueError, match="exactly one prompt"):
            client.generate("hi", token_ids=[1])
        with pytest.raises(ValueError, match="temperature"):
            client.generate("hi", temperature=-1)


def test_closing_a_stream_cancels_the_decode_call(gateway):
    with Client(gateway.address, timeout=10) as client:
        stream = client.generate_stream("hi", max_tokens=500, request_id="sync-close")
        assert next(stream).text  # the request is under way
        stream.close()
    wait_for(lambda: "sync-close" in gateway.fake.servicer.cancelled)


def sent_prompt_ids(gateway) -> list[int]:
    return [list(r.prompt_token_ids) for r in gateway.call(lambda: list(gateway.fake.servicer.requests))][-1]


def test_async_client_streams_and_cancels(gateway):
    async def scenario():
        async with AsyncClient(gateway.address, timeout=10) as client:
            info = await client.model_info()
            chunks = [c async for c in client.generate_stream("hi", max_tokens=5, return_token_ids=True)]
            whole = await client.generate("hi", max_tokens=5, return_token_ids=True)
            async with client.generate_stream("hi", max_tokens=500, request_id="async-close") as stream:
                await stream.__anext__()
        return info, chunks, whole
    info, chunks, whole = asyncio.run(scenario())
    assert info.num_decode_instances == 1
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids == (TOKENS * 2)[:5]
    assert "".join(c.text for c in chunks) == whole.text
    # the prompt's ids as the gateway tokenized them: in the first message only
    prompt_ids = sent_prompt_ids(gateway)
    assert whole.prompt_token_ids == chunks[0].prompt_token_ids == prompt_ids and prompt_ids
    assert not any(c.prompt_token_ids for c in chunks[1:])
    wait_for(lambda: "async-close" in gateway.fake.servicer.cancelled)


def test_cli_generate_prints_the_completion(gateway, capsys):
    assert cli_client.main(["--gateway", gateway.address, "--raw", "--max-tokens", "3", "--usage", "hi"]) == 0
    out, err = capsys.readouterr()
    assert out == gateway.gateway.model.tokenizer.decode(TOKENS) + "\n"
    assert "completion=3" in err and "decode=decode-0" in err
    assert cli_client.main(["--gateway", gateway.address, "--stream", "--max-tokens", "3", "hi"]) == 0
    assert capsys.readouterr().out.strip() == out.strip()
    assert cli_client.main(["--gateway", gateway.address, "--top-p", "0", "hi"]) == 2


def test_up_routes_each_flag_to_the_commands_that_define_it():
    routed = route_flags(["--kv-cache-memory", "256MiB", "--policy=round_robin", "--no-prefix-caching",
                          "--model", "m.gguf", "--heartbeat-timeout", "3"])
    assert routed["gateway"] == ["--policy=round_robin", "--model", "m.gguf", "--heartbeat-timeout", "3"]
    assert routed["prefill"] == routed["decode"] == ["--kv-cache-memory", "256MiB", "--no-prefix-caching",
                                                     "--model", "m.gguf"]
    # A flag of several values (vLLM's --served-model-name A B) takes them all, to the next flag.
    routed = route_flags(["--served-model-name", "gpt-4o", "smol", "--policy", "round_robin"])
    assert routed["gateway"] == ["--served-model-name", "gpt-4o", "smol", "--policy", "round_robin"]
    assert routed["decode"] == ["--served-model-name", "gpt-4o", "smol"]
    for flags, error in [(["--bogus"], "unknown flag"), (["--instance-id", "x"], "differs per process"),
                         (["--model"], "needs a value"), (["--served-model-name"], "needs a value"),
                         (["--served-model-name", "--policy", "round_robin"], "needs a value")]:
        with pytest.raises(ValueError, match=error):
            route_flags(flags)

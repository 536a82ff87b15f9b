"""The OpenAI-compatible HTTP API of a real stack (`LocalStack`: gateway + 1 prefill + 1
decode processes, the bundled model), driven with the official `openai` client:
greedy outputs equal the gRPC path's for the same prompt, usage figures are right,
streaming with include_usage, chat, logprobs, n > 1, and a client that disconnects
(mid-stream, during prefill, or waiting on a non-streamed answer) frees every block
on decode and prefill."""
from __future__ import annotations

import json
import socket
import time

import pytest

from common.engine.sampling_params import SamplingParams
from tests.integration.test_stack import LONG_PROMPT, stats, wait_until_idle
from tests.support.scrape import scrape, total

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

MAX_TOKENS = 12
PROMPTS = ["The capital of France is", LONG_PROMPT]  # short: decode prefills; long: the prefill instance
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def test_completions_greedy_equal_the_grpc_path_with_right_usage(client, grpc_client, model):
    for prompt in PROMPTS:
        expected = grpc_client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, return_token_ids=True)
        unary = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert unary.choices[0].text == expected.text and unary.choices[0].finish_reason == expected.finish_reason
        usage = unary.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (expected.usage.prompt_tokens,
                                                                  len(expected.token_ids))
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
        assert chunks[-1].usage.prompt_tokens == expected.usage.prompt_tokens
        assert chunks[-2].choices[0].finish_reason == expected.finish_reason
    # Token ids as the prompt give the same completion as the text they encode.
    from gateway.validation import load_served_model
    prompt_ids = load_served_model(None).tokenizer.encode(PROMPTS[0])
    by_ids = client.completions.create(model=model, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0)
    assert by_ids.choices[0].text == grpc_client.generate(prompt_ids, max_tokens=MAX_TOKENS, temperature=0).text


def test_chat_greedy_equals_the_grpc_path_streamed_and_not(client, grpc_client, model):
    expected = grpc_client.generate(messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, return_token_ids=True)
    unary = client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=MAX_TOKENS,
                                           temperature=0)
    assert unary.choices[0].message.content == expected.text
    assert (unary.usage.prompt_tokens, unary.usage.completion_tokens) == (expected.usage.prompt_tokens,
                                                                          len(expected.token_ids))
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_a_response_and_its_continuation_are_the_chat_answers_of_the_bundled_model(client, grpc_client, model):
    """The Responses API over the real stack: greedy text equal to the gRPC path's chat answer,
    streamed and not, and a follow-up by previous_response_id prompted with the first turn."""
    expected = grpc_client.generate(messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, return_token_ids=True)
    response = client.responses.create(model=model, input=CHAT[0]["content"], max_output_tokens=MAX_TOKENS,
                                       temperature=0)
    assert response.output_text == expected.text
    assert (response.usage.input_tokens, response.usage.output_tokens) == (expected.usage.prompt_tokens,
                                                                            len(expected.token_ids))
    events = list(client.responses.create(model=model, input=CHAT, max_output_tokens=MAX_TOKENS, temperature=0,
                                          stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected.text
    assert events[-1].response.output_text == expected.text
    follow_up = [*CHAT, {"role": "assistant", "content": expected.text}, {"role": "user", "content": "And two more?"}]
    continued = grpc_client.generate(messages=follow_up, max_tokens=MAX_TOKENS, temperature=0)
    assert client.responses.create(model=model, input="And two more?", previous_response_id=response.id,
                                   max_output_tokens=MAX_TOKENS, temperature=0).output_text == continued.text


def test_a_responses_logprobs_are_the_chat_answers(client, model):
    """include message.output_text.logprobs: the same tokens, logprobs and alternatives as the
    chat answer to the same turn, whole and as the stream's deltas carry them."""
    chat = client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=MAX_TOKENS,
                                          temperature=0, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    expected = [(e.token, round(e.logprob, 4), [t.token for t in e.top_logprobs]) for e in chat]
    asked = dict(model=model, input=CHAT, max_output_tokens=MAX_TOKENS, temperature=0, top_logprobs=2,
                 include=["message.output_text.logprobs"])
    part = client.responses.create(**asked).output[0].content[0]
    assert [(e.token, round(e.logprob, 4), [t.token for t in e.top_logprobs]) for e in part.logprobs] == expected
    events = list(client.responses.create(**asked, stream=True))
    streamed = [e.token for event in events if event.type == "response.output_text.delta" for e in event.logprobs]
    assert streamed == [token for token, _, _ in expected]


def test_logprobs_and_n_samples(client, grpc_client, model):
    result = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens == 8
    assert "".join(t.token for t in content) == result.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-4 for t in content)  # greedy took the best
    legacy = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=1)
    legacy_logprobs = legacy.choices[0].logprobs
    assert len(legacy_logprobs.tokens) == 4 and all(lp <= 0 for lp in legacy_logprobs.token_logprobs)
    samples = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, n=3, seed=5,
                                        temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in samples.choices] == [0, 1, 2] and len({c.text for c in samples.choices}) > 1
    prompt_tokens = grpc_client.generate(PROMPTS[0], max_tokens=1).usage.prompt_tokens
    assert (samples.usage.prompt_tokens, samples.usage.completion_tokens) == (prompt_tokens, 36)  # prompt once
    again = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, n=3, seed=5,
                                      temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in samples.choices]  # seed + i per choice


def test_bad_requests_get_400s_naming_the_field(client, model):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model, prompt="hi", max_tokens=10**6)
    assert error.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model, prompt="hi", extra_body={"top_kk": 3})
    assert error.value.body["param"] == "top_kk" and error.value.body["code"] == "unknown_field"


def test_logit_bias_and_allowed_token_ids_hold_on_prefill_and_decode(client, grpc_client, model):
    """The first token is sampled where the prompt was prefilled (the prefill instance for the
    long prompt), the others on decode: both take the request's bias and allowed set."""
    from gateway.validation import load_served_model
    tokenizer = load_served_model(None).tokenizer
    forced, allowed = 1000, [100, 200, 300, 400]
    for prompt in PROMPTS:
        biased = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                           logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
        assert biased.choices[0].text == tokenizer.decode([forced] * 6)
        result = grpc_client.generate(prompt, sampling=SamplingParams(
            max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=allowed), return_token_ids=True)
        assert len(result.token_ids) == 8 and set(result.token_ids) <= set(allowed)
    vocab_size = load_served_model(None).vocab_size
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model, prompt="hi", logit_bias={str(vocab_size): 1})
    assert error.value.body["param"] == "logit_bias" and f"vocab size {vocab_size}" in error.value.body["message"]


def test_bad_words_hold_on_prefill_and_decode(client, grpc_client, model):
    """A word the greedy answer holds is never written once banned, whether the first token
    is sampled on the prefill instance (the long prompt) or on decode."""
    from common.engine.bad_words import bad_words_token_ids
    from gateway.validation import load_served_model
    tokenizer = load_served_model(None).tokenizer
    for prompt in PROMPTS:
        free = grpc_client.generate(prompt, max_tokens=12, temperature=0, return_token_ids=True)
        # the answer's first token that is a word of its own
        word = next(text for t in free.token_ids if (text := tokenizer.decode([t]).strip()).isalpha())
        banned = grpc_client.generate(prompt, max_tokens=12, temperature=0, return_token_ids=True,
                                      sampling=SamplingParams(max_tokens=12, temperature=0, bad_words=[word]))
        sequences = bad_words_token_ids([word], lambda text: tokenizer.encode(text, add_special_tokens=False))
        ids = banned.token_ids
        assert not any(ids[i:i + len(seq)] == seq for seq in sequences for i in range(len(ids))), (word, banned.text)
        assert ids != free.token_ids
        over_http = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                              extra_body={"bad_words": [word]})
        assert over_http.choices[0].text == banned.text
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model, prompt="hi", extra_body={"bad_words": [" x" * 70]})
    assert error.value.body["param"] == "bad_words" and "tokens long" in error.value.body["message"]


def test_prompt_logprobs_from_prefill_and_decode_agree_with_the_sampled_tokens(grpc_client):
    """A prompt's logprobs come from whichever instance computed it (the prefill instance for
    the long prompt, decode for the short one); the logprob the prompt gives its own last
    token is the one generation gave that token after the shorter prompt."""
    from gateway.validation import load_served_model
    tokenizer = load_served_model(None).tokenizer
    for prompt in PROMPTS:
        prompt_ids = tokenizer.encode(prompt)
        first = grpc_client.generate(prompt_ids, sampling=SamplingParams(max_tokens=1, temperature=0, logprobs=0),
                                     return_token_ids=True)
        extended = prompt_ids + first.token_ids
        result = grpc_client.generate(extended, sampling=SamplingParams(max_tokens=2, temperature=0,
                                                                        prompt_logprobs=3))
        assert [token_id for token_id, _ in result.prompt_logprobs] == extended[1:]
        assert result.prefill_instance_id.startswith("prefill-") == (prompt == LONG_PROMPT)
        assert all(lp.token_logprob <= 0 and len(lp.top_token_ids) == 3 for _, lp in result.prompt_logprobs)
        assert all(lp.top_logprobs == sorted(lp.top_logprobs, reverse=True) for _, lp in result.prompt_logprobs)
        assert result.prompt_logprobs[-1][1].token_logprob == pytest.approx(first.logprobs[0][1].token_logprob,
                                                                            abs=0.05)
        # The greedy token is the best there: the last entry's top alternative, of rank 1.
        assert result.prompt_logprobs[-1][1].top_token_ids[0] == first.token_ids[0]
        assert result.prompt_logprobs[-1][1].token_rank == 1
        # a token among the top alternatives ranks where it stands there; any other below them
        for token_id, lp in result.prompt_logprobs:
            if token_id in lp.top_token_ids:
                assert lp.token_rank == lp.top_token_ids.index(token_id) + 1
            else:
                assert lp.token_rank > 3


def test_echo_with_logprobs_gives_the_prompts_tokens_first_as_evaluation_harnesses_read_them(client, model):
    """lm-evaluation-harness' loglikelihood request: echo, logprobs=1, max_tokens=1 over token ids."""
    from gateway.validation import load_served_model
    tokenizer = load_served_model(None).tokenizer
    for prompt in PROMPTS:
        prompt_ids = tokenizer.encode(prompt)
        result = client.completions.create(model=model, prompt=prompt_ids, max_tokens=1, temperature=0, logprobs=1,
                                           echo=True)
        choice = result.choices[0]
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt_ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) >= 1 for t in lp.top_logprobs[1:])
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert choice.text.startswith(tokenizer.decode(prompt_ids, skip_special_tokens=False))
        assert choice.text == "".join(lp.tokens)
        chunks = list(client.completions.create(model=model, prompt=prompt_ids, max_tokens=1, temperature=0,
                                                logprobs=1, echo=True, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == choice.text
        assert [v for c in chunks for v in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
        text = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, echo=True)
        assert text.choices[0].text.startswith(prompt) and text.choices[0].logprobs is None


def open_stream(address: str, body: dict) -> socket.socket:
    host, port = address.split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    raw = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    return sock


def test_a_client_gone_mid_beam_search_stops_the_search(stack, grpc_client, model):
    decode = stack.instances["decode-0"].address
    before = stats(decode, "decode").num_finished_requests
    sock = open_stream(stack.http_address, {"model": model, "prompt": PROMPTS[0], "max_tokens": 300, "n": 3,
                                            "use_beam_search": True, "ignore_eos": True})
    deadline = time.monotonic() + 60
    while stats(decode, "decode").num_finished_requests < before + 6:  # two steps of three beams are done
        assert time.monotonic() < deadline, "the search's steps never finished on decode-0"
        time.sleep(0.01)
    sock.close()
    # The search has stopped once the gateway serves no step of it and decode-0 runs none. Either
    # alone can be seen between two steps: the decode in the moment the gateway starts the next
    # step, the gateway's count while the last step's tokens are still on their way to it.
    deadline = time.monotonic() + 30
    while total(scrape(stack.gateway.metrics_address), "pdserve_num_requests_in_flight") != 0:
        assert time.monotonic() < deadline, "the gateway still serves the search's steps"
        time.sleep(0.01)
    wait_until_idle(stack, timeout_s=30)
    # nothing runs any more but what is sent now: a search still stepping would finish requests beside it
    finished = stats(decode, "decode").num_finished_requests
    grpc_client.generate(PROMPTS[0], max_tokens=8, temperature=0)
    # The last token reaches the client before the instance counts its request finished.
    wait_until_idle(stack, timeout_s=30)
    assert stats(decode, "decode").num_finished_requests == finished + 1


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}


def test_beam_search_of_width_one_is_greedy_and_wider_ones_give_distinct_beams(client, grpc_client, model):
    beam = {"use_beam_search": True, "ignore_eos": True}
    greedy = grpc_client.generate(PROMPTS[0], max_tokens=6, temperature=0, ignore_eos=True)
    one = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, extra_body=beam)
    assert one.choices[0].text == greedy.text and one.choices[0].finish_reason == "length"
    wide = client.completions.create(model=model, prompt=PROMPTS, max_tokens=4, n=3, extra_body=beam)
    assert [c.index for c in wide.choices] == list(range(6))
    for first in (0, 3):  # each prompt's three beams
        assert len({c.text for c in wide.choices[first:first + 3]}) == 3
    assert wide.usage.completion_tokens == 6 * 4
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, n=2, extra_body=beam)
    assert len({c.message.content for c in chat.choices}) == 2

    def logprob(prompt_ids: list[int], token_ids: list[int]) -> float:
        """The model's logprob of token_ids after prompt_ids (the prompt's logprobs of both)."""
        scored = grpc_client.generate(prompt_ids + token_ids, sampling=SamplingParams(max_tokens=1, prompt_logprobs=0))
        return sum(lp.token_logprob for _, lp in scored.prompt_logprobs[len(prompt_ids) - 1:])
    ranked = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, n=3,
                                       extra_body={**beam, "return_token_ids": True})
    prompt_ids = ranked.choices[0].prompt_token_ids
    totals = [logprob(prompt_ids, c.token_ids) for c in ranked.choices]
    # best first (equal lengths: by logprob; the prompt logprobs differ from a step's by bf16 noise)
    assert all(better >= worse - 0.05 for better, worse in zip(totals, totals[1:])), totals
    greedy_ids = grpc_client.generate(prompt_ids, max_tokens=4, temperature=0, ignore_eos=True,
                                      return_token_ids=True).token_ids
    assert totals[0] >= logprob(prompt_ids, greedy_ids) - 0.05  # the search found no worse than greedy


def test_grpc_beam_search_finds_the_http_searchs_beams_ranked_by_their_logprobs(client, grpc_client, model):
    http = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, n=3,
                                     extra_body={"use_beam_search": True, "ignore_eos": True,
                                                 "return_token_ids": True})
    result = grpc_client.beam_search(PROMPTS[0], beam_width=3, max_tokens=4, ignore_eos=True,
                                     request_id="beams-of-france")
    assert [s.text for s in result.sequences] == [c.text for c in http.choices]
    assert [s.token_ids for s in result.sequences] == [c.token_ids for c in http.choices]
    assert {s.finish_reason for s in result.sequences} == {"length"}
    cum_logprobs = [s.cum_logprob for s in result.sequences]
    assert cum_logprobs == sorted(cum_logprobs, reverse=True) and all(lp < 0 for lp in cum_logprobs)
    assert result.request_id == "beams-of-france"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (http.usage.prompt_tokens, 3 * 4)
    greedy = grpc_client.generate(PROMPTS[0], max_tokens=4, temperature=0, ignore_eos=True)
    assert grpc_client.beam_search(PROMPTS[0], beam_width=1, max_tokens=4, ignore_eos=True).sequences[0].text \
        == greedy.text


@pytest.mark.parametrize("kwargs, message", [
    (dict(beam_width=0), "beam_width must be 1 to 10, got 0"),
    (dict(beam_width=11), "beam_width must be 1 to 10, got 11"),
    (dict(beam_width=2, length_penalty=float("nan")), "length_penalty must be a finite number, got nan"),
    (dict(beam_width=2, top_p=0.5), "sampling.top_p is not supported with beam search"),
    (dict(beam_width=2, n=2), "sampling.n is not supported with beam search"),
    (dict(beam_width=2, return_logprobs=True), "output.return_logprobs is not supported with beam search"),
    (dict(beam_width=2, request_id="r" * 240), "at most 232 for a beam search"),
])
def test_a_grpc_beam_search_it_cannot_honour_is_refused_naming_the_field(grpc_client, kwargs, message):
    import grpc
    with pytest.raises(grpc.RpcError) as refused:
        grpc_client.beam_search(PROMPTS[0], max_tokens=4, **kwargs)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in refused.value.details()


def test_forced_tool_calls_follow_the_functions_schema(client, model):
    import jsonschema
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    named = client.chat.completions.create(
        model=model, messages=messages, max_tokens=48, temperature=0, tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert named.choices[0].finish_reason == "stop" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    streamed = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=48, temperature=0, tools=[WEATHER_TOOL], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert "".join(c.choices[0].delta.tool_calls[0].function.arguments for c in streamed
                   if c.choices and c.choices[0].delta.tool_calls) == call.function.arguments
    required = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0,
                                              tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False)
    (call,) = required.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    # the call's result goes back as a tool turn, and the model answers in text
    answer = client.chat.completions.create(model=model, max_tokens=16, temperature=0, messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, sunny"}])
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=messages, max_tokens=8, tools=[WEATHER_TOOL])
    assert refused.value.body["param"] == "tool_choice" and "auto" in refused.value.body["message"]


@pytest.mark.parametrize("when", ["mid-stream", "during prefill", "waiting on a non-streamed answer"])
def test_client_disconnect_frees_every_block_on_decode_and_prefill(stack, model, when):
    prompt = f"[disconnect {when}] " + LONG_PROMPT * (8 if when == "during prefill" else 1)
    sock = open_stream(stack.http_address, {"model": model, "prompt": prompt, "max_tokens": 300, "ignore_eos": True,
                                            "stream": when != "waiting on a non-streamed answer"})
    deadline = time.monotonic() + 60
    if when == "mid-stream":
        received = b""
        while received.count(b"data: ") < 3:
            received += sock.recv(65536)
            assert time.monotonic() < deadline, "no tokens arrived"
    else:
        role = "prefill" if when == "during prefill" else "decode"
        address = stack.instances[f"{role}-0"].address
        while not (load := stats(address, role).load).num_running_requests + load.num_waiting_requests:
            assert time.monotonic() < deadline, f"the request never ran on {role}-0"
            time.sleep(0.02)
    sock.close()
    wait_until_idle(stack, timeout_s=30)

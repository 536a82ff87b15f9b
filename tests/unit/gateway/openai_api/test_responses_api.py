"""OpenAI's Responses API (responses_api.py) on a real in-process gateway and HTTP server
with the synthetic decode instance: the official `openai` client's responses.create
(whole and streamed), retrieve and delete; the prompt each request reaches the instance
with (the chat template over the conversation it means, stored turns included); function
calls out and their outputs back; refusals naming the Responses field."""
from __future__ import annotations

import json
import time

import grpc
import pytest

from common.text.chat_template import ChatTemplateOptions
from tests.unit.gateway.openai_api.test_server import HERMES_ANSWER, MODEL, TOKENS, http_gateway, post, wait_for
from tests.unit.gateway.openai_api.test_server import client, gw  # noqa: F401 (this module's own instances)

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def sent_prompt(gw) -> list[int]:
    return gw.call(lambda: list(gw.fake.servicer.requests[-1].prompt_token_ids))


def template(gw, messages: list[dict]) -> list[int]:
    return gw.gateway.model.tokenizer.apply_chat_template(messages, ChatTemplateOptions())


def test_a_response_is_the_chat_answer_to_the_instructions_and_input(gw, client):
    text = gw.gateway.model.tokenizer.decode(TOKENS)
    response = client.responses.create(model=MODEL, instructions="Be brief.", input="Capital of France?",
                                       max_output_tokens=len(TOKENS), metadata={"team": "a"})
    assert sent_prompt(gw) == template(gw, [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Capital of France?"}])
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.output_text == text
    (message,) = response.output
    assert (message.type, message.role, message.content[0].type) == ("message", "assistant", "output_text")
    # The fake instance stops at max_tokens: cut short, as OpenAI says it.
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == len(sent_prompt(gw)) and response.usage.output_tokens == len(TOKENS)
    assert response.usage.total_tokens == response.usage.input_tokens + len(TOKENS)
    assert (response.instructions, response.max_output_tokens, response.metadata) == ("Be brief.", len(TOKENS),
                                                                                      {"team": "a"})
    # A stop string ends it early: completed.
    stopped = client.responses.create(model=MODEL, input="Capital?", extra_body={"stop": ["France"]})
    assert (stopped.status, stopped.incomplete_details, stopped.output_text) == ("completed", None, "Therong is ")
    assert gw.call(lambda: gw.fake.servicer.requests[-1].request_id) == stopped.id


def test_stored_responses_are_retrieved_continued_and_deleted(gw, client):
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(model=MODEL, input=[{"role": "user", "content": "And then?"}],
                                     previous_response_id=first.id, instructions="New rules.", max_output_tokens=2)
    assert second.previous_response_id == first.id
    # The stored turn, then the new input; the earlier instructions do not carry over.
    assert sent_prompt(gw) == template(gw, [{"role": "system", "content": "New rules."},
                                            {"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": first.output_text},
                                            {"role": "user", "content": "And then?"}])
    client.responses.create(model=MODEL, input="Once more", previous_response_id=second.id, max_output_tokens=1)
    assert sent_prompt(gw) == template(gw, [{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": first.output_text},
                                            {"role": "user", "content": "And then?"},
                                            {"role": "assistant", "content": second.output_text},
                                            {"role": "user", "content": "Once more"}])
    assert post(gw.http_address, f"/v1/responses/{first.id}", b"", method="DELETE") == (
        200, {"id": first.id, "object": "response", "deleted": True})
    status, error = post(gw.http_address, f"/v1/responses/{first.id}", b"", method="GET")
    assert (status, error["error"]["code"]) == (404, "response_not_found")
    status, error = post(gw.http_address, "/v1/responses", {"model": MODEL, "input": "x",
                                                            "previous_response_id": first.id})
    assert (status, error["error"]["param"]) == (404, "previous_response_id")
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False)
    assert post(gw.http_address, f"/v1/responses/{unstored.id}", b"", method="GET")[0] == 404


def test_a_streamed_response_sends_openais_events_in_order(gw, client):
    events = list(client.responses.create(model=MODEL, input="Capital of France?", max_output_tokens=len(TOKENS),
                                          stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    text = gw.gateway.model.tokenizer.decode(TOKENS)
    assert len(deltas) > 1 and "".join(deltas) == text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == len(TOKENS)
    assert client.responses.retrieve(final.id).output_text == text  # stored when it ended


def test_function_calls_go_out_as_items_and_their_outputs_come_back_as_tool_messages():
    from gateway.validation import load_served_model
    tokenizer = load_served_model(None).tokenizer
    token_ids = tokenizer.encode(HERMES_ANSWER, add_special_tokens=False)
    with http_gateway(tool_call_parser="hermes", token_ids=token_ids, delay_s=0.001) as hermes:
        client = openai.OpenAI(base_url=f"http://{hermes.http_address}/v1", api_key="unused", max_retries=0)
        asked = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                        max_output_tokens=len(token_ids))
        message, call = asked.output
        assert message.content[0].text == "Let me look. "
        assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather",
                                                                       {"city": "Paris"})
        assert asked.tools[0].name == "get_weather" and asked.status == "completed"
        answered = client.responses.create(
            model=MODEL, previous_response_id=asked.id, tools=[WEATHER], max_output_tokens=1,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        assert answered.previous_response_id == asked.id
        tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
        conversation = [{"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "content": "Let me look. ", "tool_calls": [
                            {"id": call.call_id, "type": "function",
                             "function": {"name": "get_weather", "arguments": call.arguments}}]},
                        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
        # As the chat API would prompt for the same turns (its /tokenize).
        _, chat = post(hermes.http_address, "/tokenize", {"messages": conversation, "tools": tools})
        assert sent_prompt(hermes) == chat["tokens"]
        # The same call streamed: text, then the call's item with its arguments.
        events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                              max_output_tokens=len(token_ids), stream=True))
        added = [e.item for e in events if e.type == "response.output_item.added"]
        assert [item.type for item in added] == ["message", "function_call"]
        arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert json.loads(arguments) == {"city": "Paris"}
        assert events[-1].type == "response.completed"
        assert [item.type for item in events[-1].response.output] == ["message", "function_call"]


def test_a_json_schema_format_constrains_the_answer(gw, client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    client.responses.create(model=MODEL, input="A city as JSON", max_output_tokens=2,
                            text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    sent = gw.call(lambda: gw.fake.servicer.requests[-1])
    assert json.loads(sent.sampling.structured_output.json) == schema


@pytest.mark.parametrize("body, param, code", [
    ({"input": "x", "modalities": ["text"]}, "modalities", "unknown_field"),
    ({}, "input", "missing_field"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0]",
     "unsupported_value"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "unsupported_value"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_value"),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name", "invalid_value"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "unsupported_value"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include[0]", "unsupported_value"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format", "invalid_value"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "invalid_value"),
    ({"input": "x" * 300_000}, "input", "invalid_argument"),  # the gateway's "messages", named as sent
])
def test_a_bad_request_is_a_400_naming_the_responses_field(gw, body, param, code):
    status, error = post(gw.http_address, "/v1/responses", {"model": MODEL, **body})
    assert (status, error["error"]["param"], error["error"]["code"]) == (400, param, code), error
    if code != "invalid_argument":  # refused at the edge: the message starts with the field
        assert error["error"]["message"].startswith(param)


def test_a_reasoning_models_thinking_is_a_reasoning_item_whole_and_streamed():
    from gateway.validation import load_served_model
    answer = "<think>\nThe capital of France.\n</think>\n\nParis."
    token_ids = load_served_model(None).tokenizer.encode(answer, add_special_tokens=False)
    with http_gateway(reasoning_parser="deepseek_r1", token_ids=token_ids, delay_s=0.001) as r1:
        client = openai.OpenAI(base_url=f"http://{r1.http_address}/v1", api_key="unused", max_retries=0)
        whole = client.responses.create(model=MODEL, input="Capital of France?", max_output_tokens=len(token_ids))
        thought, message = whole.output
        assert (thought.type, thought.content[0].text) == ("reasoning", "\nThe capital of France.\n")
        assert whole.output_text == "\n\nParis."
        events = list(client.responses.create(model=MODEL, input="Capital of France?",
                                              max_output_tokens=len(token_ids), stream=True))
        reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert (reasoning, text) == ("\nThe capital of France.\n", "\n\nParis.")
        kinds = [e.type for e in events]
        # The reasoning item closes before the message opens.
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
        assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]


def test_a_failure_mid_stream_ends_it_with_response_failed_and_stores_nothing():
    import grpc

    from bench.fakes.fake_decode import Failure
    with http_gateway(token_ids=TOKENS, failure=Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, after_tokens=2)) as gw:
        client = openai.OpenAI(base_url=f"http://{gw.http_address}/v1", api_key="x", max_retries=0)
        events = list(client.responses.create(model=MODEL, input="hi", max_output_tokens=5, stream=True))
        assert events[-1].type == "response.failed"
        failed = events[-1].response
        assert failed.status == "failed" and "injected failure" in failed.error.message
        assert failed.output_text  # the two tokens that came, in the message item it closed
        assert post(gw.http_address, f"/v1/responses/{failed.id}", b"", method="GET")[0] == 404


def test_a_stored_responses_input_items_are_listed_as_openai_lists_them(gw, client):
    items = [{"role": "user", "content": "Weather?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks"}]}]
    response = client.responses.create(model=MODEL, input=items, max_output_tokens=1)
    newest_first = client.responses.input_items.list(response.id)
    assert [i.type for i in newest_first.data] == ["message", "function_call_output", "function_call", "message"]
    oldest = newest_first.data[-1]
    assert (oldest.role, oldest.content[0].type, oldest.content[0].text) == ("user", "input_text", "Weather?")
    first = client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [i.type for i in first.data] == ["message", "function_call"] and first.has_more
    rest = client.responses.input_items.list(response.id, order="asc", after=first.data[-1].id)
    assert [i.type for i in rest.data] == ["function_call_output", "message"] and not rest.has_more
    assert rest.data[0].output == "sunny" and rest.data[0].call_id == "c1"
    status, error = post(gw.http_address, f"/v1/responses/{response.id}/input_items?order=sideways", b"", "GET")
    assert (status, error["error"]["param"]) == (400, "order")
    assert post(gw.http_address, "/v1/responses/resp_nope/input_items", b"", "GET")[0] == 404


def test_truncation_auto_drops_the_oldest_turns_until_the_prompt_fits():
    limit, room = 200, 4
    turns = []
    for i in range(6):
        turns += [{"role": "user", "content": f"question {i}: " + "word " * 15},
                  {"role": "assistant", "content": f"answer {i}: " + "word " * 15}]
    turns.append({"role": "user", "content": "the last question"})
    with http_gateway(token_ids=TOKENS, max_model_len=limit) as small:
        client = openai.OpenAI(base_url=f"http://{small.http_address}/v1", api_key="unused", max_retries=0)
        status, error = post(small.http_address, "/v1/responses",
                             {"model": MODEL, "input": turns, "max_output_tokens": room})
        assert (status, error["error"]["param"]) == (400, "input")  # disabled, the default: too long
        response = client.responses.create(model=MODEL, input=turns, max_output_tokens=room, truncation="auto")
        assert response.truncation == "auto"
        sent = sent_prompt(small)
        prompt = small.gateway.model.tokenizer.decode(sent)
        kept = [i for i in range(6) if f"question {i}:" in prompt]
        assert len(sent) + room <= limit and "the last question" in prompt
        assert kept and kept == list(range(kept[0], 6)) and kept[0] > 0  # the newest turns, whole
        assert all(f"answer {i}:" in prompt for i in kept)
        # The fewest dropped: one more turn kept would not fit.
        _, one_more = post(small.http_address, "/tokenize", {"messages": turns[2 * (kept[0] - 1):]})
        assert one_more["count"] + room > limit
        # A last turn that does not fit alone is still refused.
        status, _ = post(small.http_address, "/v1/responses", {"model": MODEL, "input": "word " * 400,
                                                               "max_output_tokens": room, "truncation": "auto"})
        assert status == 400


def _until_finished(client, response_id: str, timeout_s: float = 10.0):
    """The response once it left queued / in_progress (polled, as a client does)."""
    deadline = time.monotonic() + timeout_s
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"still {response.status}"
        time.sleep(0.02)
    return response


def test_a_background_response_answers_queued_at_once_and_is_read_back_completed(gw, client):
    foreground = client.responses.create(model=MODEL, input="Capital of France?", max_output_tokens=len(TOKENS))
    queued = client.responses.create(model=MODEL, input="Capital of France?", max_output_tokens=len(TOKENS),
                                     background=True)
    assert queued.status in ("queued", "in_progress") and queued.background and queued.output == []
    done = _until_finished(client, queued.id)
    assert (done.status, done.background, done.output_text) == ("incomplete", True, foreground.output_text)
    assert done.usage.output_tokens == len(TOKENS)
    # Finished, it is continued like any stored response; cancelling it changes nothing.
    client.responses.create(model=MODEL, input="And then?", previous_response_id=done.id, max_output_tokens=1)
    assert sent_prompt(gw) == template(gw, [{"role": "user", "content": "Capital of France?"},
                                            {"role": "assistant", "content": done.output_text},
                                            {"role": "user", "content": "And then?"}])
    assert client.responses.cancel(done.id).status == "incomplete"


def test_cancelling_a_background_response_stops_its_decode_call_and_stores_it_cancelled():
    with http_gateway(token_ids=TOKENS, delay_s=0.2) as slow:
        client = openai.OpenAI(base_url=f"http://{slow.http_address}/v1", api_key="unused", max_retries=0, timeout=30)
        queued = client.responses.create(model=MODEL, input="Hi", max_output_tokens=500, background=True)
        wait_for(lambda: slow.call(lambda: bool(slow.fake.servicer.running)), what="the decode call")
        # Running: a continuation is refused until it finishes.
        status, error = post(slow.http_address, "/v1/responses", {"model": MODEL, "input": "x",
                                                                  "previous_response_id": queued.id})
        assert (status, error["error"]["param"]) == (400, "previous_response_id") and "in_progress" in str(error)
        cancelled = client.responses.cancel(queued.id)
        assert cancelled.status == "cancelled" and client.responses.retrieve(queued.id).status == "cancelled"
        wait_for(lambda: slow.call(lambda: queued.id in slow.fake.servicer.cancelled), what="the call cancelled")
        assert slow.call(lambda: not slow.fake.servicer.running)
        # A background response deleted while it runs stops too.
        running = client.responses.create(model=MODEL, input="Hi", max_output_tokens=500, background=True)
        wait_for(lambda: slow.call(lambda: running.id in slow.fake.servicer.running), what="the decode call")
        assert post(slow.http_address, f"/v1/responses/{running.id}", b"", method="DELETE")[0] == 200
        wait_for(lambda: slow.call(lambda: running.id in slow.fake.servicer.cancelled), what="the call cancelled")


def test_a_background_response_that_fails_is_stored_failed_with_the_error():
    from bench.fakes.fake_decode import Failure
    with http_gateway(token_ids=TOKENS, failure=Failure(grpc.StatusCode.INTERNAL, after_tokens=2)) as failing:
        client = openai.OpenAI(base_url=f"http://{failing.http_address}/v1", api_key="unused", max_retries=0,
                               timeout=30)
        queued = client.responses.create(model=MODEL, input="Hi", max_output_tokens=8, background=True)
        failed = _until_finished(client, queued.id)
        assert failed.status == "failed" and "injected failure" in failed.error.message
        assert failed.output == []


@pytest.mark.parametrize("body, param, words", [
    ({"background": True, "store": False}, "background", "needs store"),
    ({"background": True, "stream": True}, "background", "poll"),
])
def test_background_refusals_name_the_field(gw, body, param, words):
    status, error = post(gw.http_address, "/v1/responses", {"model": MODEL, "input": "x", **body})
    assert (status, error["error"]["param"]) == (400, param) and words in error["error"]["message"]


def test_only_a_background_response_can_be_cancelled(gw, client):
    foreground = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    status, error = post(gw.http_address, f"/v1/responses/{foreground.id}/cancel", b"")
    assert status == 400 and "background" in error["error"]["message"]
    assert post(gw.http_address, "/v1/responses/resp_nope/cancel", b"")[0] == 404

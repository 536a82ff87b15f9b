"""Bad requests get a precise status from the real gateway server (in-process, 127.0.0.1)
and never reach a decode instance: the fake decode registered here records every
Decode call, and none may arrive. ModelInfo and the length limit learnt from
registrations are checked too."""
from __future__ import annotations

import json

import grpc
import pytest

from common.text.chat_template import ChatTemplateOptions
from gateway.core import GatewaySettings
from protos.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.support.background_gateway import BackgroundGateway

MAX_PROMPT_CHARS = 2000
DECODE_MAX_MODEL_LEN = 64  # what the fake decode registers: below the model's own 8192
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def gateway():
    with BackgroundGateway(GatewaySettings(max_prompt_chars=MAX_PROMPT_CHARS)) as gw:
        gw.fake = gw.add_fake_decode("decode-fake", token_ids=[28, 29, 30],
                                     max_model_len=DECODE_MAX_MODEL_LEN)
        yield gw


@pytest.fixture(scope="module")
def stub(gateway):
    with grpc.insecure_channel(gateway.address) as channel:
        yield generate_pb2_grpc.GenerateServiceStub(channel)


def request(text=None, ids=None, messages=None, chat_template_kwargs_json="", **sampling
            ) -> generate_pb2.GenerateRequest:
    msg = generate_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling))
    if chat_template_kwargs_json:
        msg.messages.chat_template_kwargs_json = chat_template_kwargs_json
    if text is not None:
        msg.text = text
    if ids is not None:
        msg.token_ids.ids.extend(ids)
    if messages is not None:
        msg.messages.messages.extend(generate_pb2.ChatMessage(role=r, content=c) for r, c in messages)
    return msg


def status_of(call, msg) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as error:
        result = call(msg, timeout=10)
        if not isinstance(result, generate_pb2.GenerateResponse):
            list(result)  # a stream's status arrives when it is read
    return error.value.code(), error.value.details()


BAD_REQUESTS = {
    "no prompt": (request(), INVALID, "prompt is missing"),
    "empty text": (request(text=""), INVALID, "prompt text is empty"),
    "empty token ids": (request(ids=[]), INVALID, "must not be empty"),
    "empty messages": (request(messages=[]), INVALID, "non-empty list"),
    "unknown chat role": (request(messages=[("wizard", "hi")]), INVALID, "role"),
    "token id out of vocabulary": (request(ids=[5, 49152]), INVALID, "token id 49152 is out of range"),
    "prompt too long": (request(ids=[5] * DECODE_MAX_MODEL_LEN), INVALID, f"at most {DECODE_MAX_MODEL_LEN}"),
    "prompt + max_tokens too long": (request(ids=[5] * 60, max_tokens=10), INVALID,
                                     "set max_tokens to at most 4"),
    "text over the character limit": (request(text="a" * (MAX_PROMPT_CHARS + 1)), INVALID,
                                      "--max-prompt-chars"),
    "negative temperature": (request(text="hi", temperature=-1), INVALID, "temperature must be >= 0"),
    "top_p zero": (request(text="hi", top_p=0.0), INVALID, "top_p must be in (0, 1]"),
    "top_k zero": (request(text="hi", top_k=0), INVALID, "top_k"),
    "too many logprobs": (request(text="hi", logprobs=50), INVALID, "logprobs"),
    "min_tokens over max_tokens": (request(text="hi", max_tokens=2, min_tokens=3), INVALID, "min_tokens"),
    "stop token out of vocabulary": (request(text="hi", stop_token_ids=[10**6]), INVALID, "stop_token_ids"),
    "empty stop string": (request(text="hi", stop=[""]), INVALID, "stop"),
    "n > 1": (request(text="hi", n=2), INVALID, "send n separate requests"),
    "logit bias out of vocabulary": (request(text="hi", logit_bias={10**6: 1.0}), INVALID,
                                     "sampling.logit_bias: token id 1000000 is out of range"),
    "allowed id out of vocabulary": (request(text="hi", allowed_token_ids=[5, 49152]), INVALID,
                                     "sampling.allowed_token_ids: token id 49152"),
    "logit bias past 100": (request(text="hi", logit_bias={5: 150.0}), INVALID, "logit_bias[5] must be"),
    "too many prompt logprobs": (request(text="hi", prompt_logprobs=21), INVALID, "prompt_logprobs"),
    "truncation past the model's length": (request(ids=[5] * 10, truncate_prompt_tokens=DECODE_MAX_MODEL_LEN + 1),
                                           INVALID, "sampling.truncate_prompt_tokens: 65 is more than"),
    "truncation to nothing": (request(text="hi", truncate_prompt_tokens=0), INVALID, "truncate_prompt_tokens"),
    "template variables over the character limit": (
        request(messages=[("user", "hi")], chat_template_kwargs_json=json.dumps({"persona": "a" * MAX_PROMPT_CHARS})),
        INVALID, "--max-prompt-chars"),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_bad_request_gets_its_status_and_never_reaches_decode(gateway, stub, name, method):
    msg, code, text = BAD_REQUESTS[name]
    before = len(gateway.fake.servicer.requests)
    actual_code, details = status_of(getattr(stub, method), msg)
    assert (actual_code, text in details) == (code, True), details
    assert len(gateway.fake.servicer.requests) == before


def test_unknown_model_long_request_id_and_oversized_message(stub):
    msg = request(text="hi")
    msg.model = "gpt-17"
    code, details = status_of(stub.Generate, msg)
    assert code == INVALID and "SmolLM2-135M-Instruct" in details
    msg.model = "SmolLM2-135M-Instruct"
    msg.request_id = "r" * 300
    code, details = status_of(stub.Generate, msg)
    assert code == INVALID and "request_id" in details
    # Past the 4 MiB receive limit gRPC itself refuses the message, before any parsing.
    huge = request(text="x" * (5 << 20))
    assert status_of(stub.Generate, huge)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_model_info_reports_the_deployment_and_the_registered_length_limit(stub):
    info = stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=5)
    assert info.model_name == "SmolLM2-135M-Instruct"
    assert info.max_model_len == DECODE_MAX_MODEL_LEN  # the decode's, not the model's 8192
    assert (info.vocab_size, info.block_size, list(info.eos_token_ids)) == (49152, 16, [2])
    assert info.has_chat_template and info.placement_policy == "prefix_aware"
    assert (info.num_prefill_instances, info.num_decode_instances) == (0, 1)


def test_valid_request_right_at_the_limit_is_served(stub):
    reply = stub.Generate(request(ids=[5] * 60, max_tokens=4, temperature=0), timeout=10)
    assert reply.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert reply.usage.prompt_tokens == 60 and reply.usage.completion_tokens == 4


def test_truncation_keeps_the_prompts_last_tokens(gateway, stub):
    ids = list(range(100, 200))  # longer than the decode instance's 64 tokens
    reply = stub.Generate(request(ids=ids, max_tokens=2, truncate_prompt_tokens=10), timeout=10)
    assert reply.usage.prompt_tokens == 10
    assert list(gateway.fake.servicer.requests[-1].prompt_token_ids) == ids[-10:]
    reply = stub.Generate(request(ids=list(range(100, 120)), max_tokens=2, truncate_prompt_tokens=50), timeout=10)
    assert reply.usage.prompt_tokens == 20  # shorter than the truncation: all of it


def test_no_decode_instance_means_unavailable_and_the_model_limit_applies():
    with BackgroundGateway() as gw, grpc.insecure_channel(gw.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for method in (stub.Generate, stub.GenerateStream):
            code, details = status_of(method, request(text="hi"))
            assert code == grpc.StatusCode.UNAVAILABLE and "no decode instance" in details
        assert stub.ModelInfo(generate_pb2.ModelInfoRequest()).max_model_len == 8192
        # Validation comes first: a bad request is INVALID_ARGUMENT even with no instances.
        assert status_of(stub.Generate, request(ids=[5] * 8192))[0] == INVALID


def test_a_chat_template_and_default_variables_from_the_command_line(tmp_path):
    from gateway.types import GenerateInput
    from gateway.validation import load_served_model, read_chat_template, tokenize_prompt
    template = ("{% if persona is defined %}[{{ persona }}]{% endif %}"
                "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    (tmp_path / "chat.jinja").write_text(template)
    assert read_chat_template(str(tmp_path / "chat.jinja")) == template == read_chat_template(template)
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    model = load_served_model(None, chat_template=str(tmp_path / "chat.jinja"),
                              default_chat_template_kwargs={"persona": "pirate"})
    messages = GenerateInput(messages=[{"role": "user", "content": "hi"}])
    ids = tokenize_prompt(messages, model, MAX_PROMPT_CHARS)
    assert model.tokenizer.decode(ids, skip_special_tokens=False) == "[pirate]user: hi\n"
    own = GenerateInput(messages=messages.messages, chat_options=ChatTemplateOptions(
        chat_template_kwargs={"persona": "parrot"}))  # a request's own value wins
    assert model.tokenizer.decode(tokenize_prompt(own, model, MAX_PROMPT_CHARS), skip_special_tokens=False) == \
        "[parrot]user: hi\n"
    # the model's own template is untouched for everyone else
    assert load_served_model(None).tokenizer.chat_template != template
    with pytest.raises(ValueError, match="is set by the server"):
        load_served_model(None, default_chat_template_kwargs={"messages": []})


def test_the_chat_template_is_rendered_once_at_start_up_and_a_refusing_one_still_loads(tmp_path, monkeypatch):
    from common.text.prompt_tokenizer import PromptTokenizer
    from gateway.validation import load_served_model
    rendered = []
    real_render = PromptTokenizer.render_chat_template

    def render(self, messages, *args, **kwargs):
        rendered.append((self.chat_template, messages))
        return real_render(self, messages, *args, **kwargs)
    monkeypatch.setattr(PromptTokenizer, "render_chat_template", render)
    model = load_served_model(None)
    assert rendered == [(model.tokenizer.chat_template, [{"role": "user", "content": "hi"}])]
    refusing = "{{ raise_exception('a system message first') }}"
    model = load_served_model(None, chat_template=refusing)
    assert model.tokenizer.chat_template == refusing and len(rendered) == 2
    with pytest.raises(ValueError, match="a system message first"):
        model.tokenizer.render_chat_template([{"role": "user", "content": "hi"}])
    assert load_served_model(None, chat_template="{{ 1 / 0 }}").tokenizer.chat_template == "{{ 1 / 0 }}"

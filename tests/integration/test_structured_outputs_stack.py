"""Structured outputs through a real stack (gateway + 1 prefill + 1 decode processes,
the bundled model): gRPC and the official `openai` client get JSON valid against a
schema, a regex match and one of the choices, on a short prompt (prefilled on decode)
and a long one (prefilled remotely: the first token is sampled on the prefill
instance); bad constraints are rejected naming the field and leave every pool free."""
from __future__ import annotations

import json
import re

import grpc
import pytest

from tests.integration.test_stack import LONG_PROMPT, wait_until_idle

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "moons": {"type": "integer", "minimum": 0, "maximum": 200},
                         "kind": {"enum": ["rocky", "gas giant"]}},
          "required": ["name", "moons", "kind"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,10} has [0-9]{1,3} moons"
CHOICES = ["Jupiter", "Saturn", "Earth"]
PROMPTS = ["Describe a planet:", LONG_PROMPT]  # short: decode prefills; long: the prefill instance does


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "moons", "kind"} and len(value["name"]) <= 16
    assert 0 <= value["moons"] <= 200 and value["kind"] in ("rocky", "gas giant")


@pytest.mark.parametrize("prompt", PROMPTS, ids=["decode-prefilled", "remote-prefilled"])
def test_grpc_schema_regex_and_choice(grpc_client, stack, prompt):
    for constraint, check in [({"json": SCHEMA}, check_schema),
                              ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)),
                              ({"choice": CHOICES}, lambda text: text in CHOICES or pytest.fail(text))]:
        result = grpc_client.generate(prompt, max_tokens=60, temperature=0, structured_outputs=constraint)
        assert result.finish_reason == "stop", result.text
        check(result.text)
        again = grpc_client.generate(prompt, max_tokens=60, temperature=0, structured_outputs=constraint)
        assert again.text == result.text  # greedy constrained output is deterministic
    wait_until_idle(stack)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["decode-prefilled", "remote-prefilled"])
def test_grpc_constraint_held_back_until_its_start_sequence(grpc_client, stack, prompt):
    from gateway.validation import load_served_model
    tokenizer = load_served_model(None).tokenizer
    free = grpc_client.generate(prompt, max_tokens=3, temperature=0, return_token_ids=True, ignore_eos=True).token_ids
    # the marker from the first token (the one a remote prefill samples) and from the second
    for start in (0, 1):
        marker = list(free[start:start + 2])
        held = grpc_client.generate(prompt, max_tokens=60, temperature=0, return_token_ids=True,
                                    structured_outputs={"regex": REGEX, "start_after_token_ids": marker})
        end = next(i + 2 for i in range(len(free)) if list(free[i:i + 2]) == marker)
        assert held.finish_reason == "stop" and list(held.token_ids[:end]) == list(free[:end])
        assert re.fullmatch(REGEX, tokenizer.decode(list(held.token_ids[end:]))), held.text
    wait_until_idle(stack)


def test_openai_client_response_format_and_vllm_extensions(client, model, stack):
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe Jupiter as JSON."}], max_tokens=80,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "planet", "schema": SCHEMA, "strict": True}})
    assert chat.choices[0].finish_reason == "stop"
    check_schema(chat.choices[0].message.content)
    anything = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Any JSON object."}], max_tokens=60, temperature=0,
        response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    regex = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=30, temperature=0.8, seed=1,
                                      n=2, extra_body={"guided_regex": REGEX})
    for choice in regex.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(REGEX, choice.text), choice.text
    choice = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": CHOICES}})
    assert choice.choices[0].text in CHOICES
    wait_until_idle(stack)


def test_bad_constraints_are_rejected_naming_the_field(client, grpc_client, model, stack):
    with pytest.raises(openai.BadRequestError) as error:  # the gateway's own check
        client.completions.create(model=model, prompt="hi", extra_body={"guided_regex": "a("})
    assert error.value.body["param"] == "guided_regex"
    # Python's re takes a lookahead, xgrammar does not: the instance rejects it.
    for prompt in PROMPTS:
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=model, prompt=prompt, extra_body={"guided_regex": "(?=a)a"})
        assert "structured_outputs.regex" in error.value.body["message"]
        with pytest.raises(grpc.RpcError) as rpc_error:
            grpc_client.generate(prompt, max_tokens=5, structured_outputs={"grammar": "root ::= nothing"})
        assert rpc_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_outputs.grammar" in rpc_error.value.details()
    wait_until_idle(stack)
    assert grpc_client.generate(PROMPTS[0], max_tokens=3, temperature=0).text  # still serving

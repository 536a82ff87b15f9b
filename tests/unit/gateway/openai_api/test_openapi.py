"""The OpenAPI document (openapi.py) against protocol.py's checks: the same fields, and
every bound the document states is where the parser's starts refusing (at the bound:
accepted; one past: a 400 naming the field)."""
from __future__ import annotations

import json

import pytest

from gateway.openai_api.errors import ApiError
from gateway.openai_api.openapi import openapi_document
from gateway.openai_api.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    STREAM_OPTIONS,
    TOKENIZE_FIELDS,
    parse_request,
)

MODEL = "served-model"
DOCUMENT = openapi_document([MODEL], request_chat_templates=True)  # every field the parser takes
SCHEMAS = DOCUMENT["components"]["schemas"]
MINIMAL = {"completion": {"model": MODEL, "prompt": "hi"},
           "chat": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}}
REQUESTS = [("completion", "CompletionRequest", COMPLETION_FIELDS), ("chat", "ChatCompletionRequest", CHAT_FIELDS)]
# Fields whose value is only valid together with another one: value -> the other fields.
COMPANIONS = {"top_logprobs": lambda value: {"logprobs": True}, "best_of": lambda value: {"n": value},
              "min_tokens": lambda value: {"max_tokens": max(value, 1)}}


def not_null(schema: dict) -> dict:
    """The property's schema without the null that means unset."""
    if "anyOf" in schema and {"type": "null"} in schema["anyOf"]:
        (schema,) = [s for s in schema["anyOf"] if s != {"type": "null"}]
    if isinstance(schema.get("type"), list):
        schema = {**schema, "type": next(t for t in schema["type"] if t != "null")}
    return schema


def parse(kind: str, fields: dict):
    body = {**fields, **MINIMAL[kind]}
    return parse_request(json.dumps(body).encode(), chat=kind == "chat")


def with_companions(name: str, value) -> dict:
    """`name` first: its own check runs first, so a refusal names it."""
    return {name: value, **COMPANIONS.get(name, lambda _: {})(value)}


@pytest.mark.parametrize("kind, schema_name, fields", REQUESTS)
def test_the_document_names_exactly_the_fields_the_parser_accepts(kind, schema_name, fields):
    schema = SCHEMAS[schema_name]
    assert set(schema["properties"]) == set(fields) and schema["additionalProperties"] is False
    assert set(not_null(schema["properties"]["stream_options"])["properties"]) == set(STREAM_OPTIONS)
    assert schema["properties"]["model"]["enum"] == [MODEL]
    assert all(hasattr(check, "json_schema") for check in fields.values())


def test_a_request_template_is_described_only_where_the_gateway_runs_them():
    untrusting = openapi_document([MODEL])["components"]["schemas"]
    for schema_name in ("ChatCompletionRequest", "TokenizeRequest"):
        assert "chat_template" in SCHEMAS[schema_name]["properties"]
        described = set(SCHEMAS[schema_name]["properties"]) - {"chat_template"}
        assert set(untrusting[schema_name]["properties"]) == described


def bound_cases():
    for kind, schema_name, _ in REQUESTS:
        for name, schema in SCHEMAS[schema_name]["properties"].items():
            schema = not_null(schema)
            for key, past in (("minimum", -1), ("maximum", 1), ("exclusiveMinimum", 0)):
                if key in schema:
                    yield pytest.param(kind, name, key, schema[key], past, id=f"{kind}-{name}-{key}")


@pytest.mark.parametrize("kind, name, key, bound, past", list(bound_cases()))
def test_each_numeric_bound_in_the_document_is_the_parsers(kind, name, key, bound, past):
    if key != "exclusiveMinimum":
        parse(kind, with_companions(name, bound))  # at the bound: accepted
    beyond = bound + past if isinstance(bound, int) else bound + (past or 0) * 1e-6
    with pytest.raises(ApiError) as refused:
        parse(kind, with_companions(name, beyond))
    assert refused.value.status == 400 and refused.value.param == name


@pytest.mark.parametrize("name, item", [("stop", "x"), ("stop_token_ids", 1)])
def test_list_bounds_in_the_document_are_the_parsers(name, item):
    schema = not_null(SCHEMAS["CompletionRequest"]["properties"][name])
    limit = schema["anyOf"][1]["maxItems"] if name == "stop" else schema["maxItems"]  # stop: a string or a list
    parse("completion", {name: [item] * limit})
    with pytest.raises(ApiError) as refused:
        parse("completion", {name: [item] * (limit + 1)})
    assert refused.value.param == name


def test_the_logit_bias_bounds_in_the_document_are_the_parsers():
    schema = not_null(SCHEMAS["CompletionRequest"]["properties"]["logit_bias"])
    limit, values = schema["maxProperties"], schema["additionalProperties"]
    logit_bias = {str(i): values["maximum"] for i in range(limit - 1)} | {"7": values["minimum"]}
    parse("completion", {"logit_bias": logit_bias})
    for refused_body, param in (({str(i): 0 for i in range(limit + 1)}, "logit_bias"),
                                ({"7": values["maximum"] + 1e-6}, "logit_bias.7"),
                                ({"7": values["minimum"] - 1e-6}, "logit_bias.7"), ({"x7": 0}, "logit_bias")):
        with pytest.raises(ApiError) as refused:
            parse("completion", {"logit_bias": refused_body})
        assert refused.value.param == param


def test_the_tokenize_requests_in_the_document_name_the_parsers_fields():
    assert set(SCHEMAS["TokenizeRequest"]["properties"]) == set(TOKENIZE_FIELDS)
    assert set(SCHEMAS["DetokenizeRequest"]["properties"]) == set(DETOKENIZE_FIELDS)
    assert SCHEMAS["DetokenizeRequest"]["required"] == ["tokens"]
    assert {"/tokenize", "/detokenize"} <= set(DOCUMENT["paths"])


def test_the_message_count_bound_in_the_document_is_the_parsers():
    limit = SCHEMAS["ChatCompletionRequest"]["properties"]["messages"]["maxItems"]
    message = {"role": "user", "content": "hi"}
    parse_request(json.dumps({"model": MODEL, "messages": [message] * limit}).encode(), chat=True)
    with pytest.raises(ApiError) as refused:
        parse_request(json.dumps({"model": MODEL, "messages": [message] * (limit + 1)}).encode(), chat=True)
    assert refused.value.param == "messages"


@pytest.mark.parametrize("kind, schema_name, _", REQUESTS)
def test_required_fields_are_refused_when_missing(kind, schema_name, _):
    for name in SCHEMAS[schema_name]["required"]:
        body = {k: v for k, v in MINIMAL[kind].items() if k != name}
        with pytest.raises(ApiError) as refused:
            parse_request(json.dumps(body).encode(), chat=kind == "chat")
        assert refused.value.param == name

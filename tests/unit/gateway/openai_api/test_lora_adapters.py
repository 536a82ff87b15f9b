"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter at the HTTP edge: served only with
--allow-runtime-lora-updating (and then in the OpenAPI document), bodies checked as vLLM's
with a 400 naming the field, and the deployment's refusals mapped to statuses (no instance
runs with LoRA: 400; nothing to unload: 404). Loads on real instances: the LoRA stack test."""
from __future__ import annotations

import json

import pytest

from gateway.openai_api.errors import ApiError
from gateway.openai_api.lora_adapters import (LOAD_PATH, UNLOAD_PATH, LoadLoRAAdapter, parse_load_request,
                                              parse_unload_request)
from gateway.openai_api.openapi import openapi_document
from tests.unit.gateway.openai_api.test_server import TOKENS, http_gateway, post


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_bodies_are_read_as_vllm_s():
    assert parse_load_request(body(lora_name="sea", lora_path="/a/sea")) == LoadLoRAAdapter("sea", "/a/sea", False)
    assert parse_load_request(body(lora_name="sea", lora_path="/a", load_inplace=True, is_3d_lora_weight=False,
                                   )).load_inplace
    assert parse_unload_request(body(lora_name="sea", lora_int_id=3)) == "sea"  # the id is vLLM's, unused


@pytest.mark.parametrize("raw, param", [
    (body(lora_path="/a"), "lora_name"), (body(lora_name="sea"), "lora_path"),
    (body(lora_name="", lora_path="/a"), "lora_name"), (body(lora_name="s" * 257, lora_path="/a"), "lora_name"),
    (body(lora_name="sea", lora_path="/a\x00b"), "lora_path"), (body(lora_name=3, lora_path="/a"), "lora_name"),
    (body(lora_name="sea", lora_path="/a", load_inplace="yes"), "load_inplace"),
    (body(lora_name="sea", lora_path="/a", is_3d_lora_weight=True), "is_3d_lora_weight"),
    (body(lora_name="sea", lora_path="/a", rank=8), "rank")])
def test_a_bad_load_body_is_a_400_naming_its_field(raw, param):
    with pytest.raises(ApiError) as error:
        parse_load_request(raw)
    assert error.value.status == 400 and error.value.param == param


def test_the_routes_and_their_document_exist_only_when_allowed():
    assert LOAD_PATH not in openapi_document(["m"])["paths"]
    document = openapi_document(["m"], runtime_lora_updating=True)
    assert {LOAD_PATH, UNLOAD_PATH} <= set(document["paths"])
    assert document["components"]["schemas"]["LoadLoRAAdapterRequest"]["required"] == ["lora_name", "lora_path"]
    with http_gateway(token_ids=TOKENS) as gw:
        assert post(gw.http_address, LOAD_PATH, {"lora_name": "a", "lora_path": "/a"})[0] == 404


def test_without_a_lora_instance_a_load_is_refused_and_an_unload_finds_nothing():
    with http_gateway(token_ids=TOKENS, allow_runtime_lora_updating=True) as gw:
        status, answer = post(gw.http_address, LOAD_PATH, {"lora_name": "a", "lora_path": "/a"})
        assert status == 400 and "--enable-lora" in answer["error"]["message"]
        status, answer = post(gw.http_address, UNLOAD_PATH, {"lora_name": "a"})
        assert status == 404 and "'a' cannot be found" in answer["error"]["message"]
        status, answer = post(gw.http_address, LOAD_PATH, {"lora_name": "sea"})
        assert status == 400 and answer["error"]["param"] == "lora_path"

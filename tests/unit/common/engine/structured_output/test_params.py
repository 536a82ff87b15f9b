"""The constraint as plain data: checked torch-free, carried through SamplingParams."""
from __future__ import annotations

import json

import pytest

from common.engine.sampling_params import SamplingParams
from common.engine.structured_output.params import StructuredOutputsParams


def test_each_kind_round_trips_through_sampling_params():
    for constraint in ({"json": {"type": "object", "properties": {"b": {}, "a": {}}}},
                       {"json_object": True}, {"regex": "[a-z]+"}, {"choice": ["x", "y"]},
                       {"grammar": 'root ::= "a"'}, {"regex": "[0-9]", "start_after_token_ids": [7, 8]}):
        params = SamplingParams(structured_outputs=constraint)
        again = SamplingParams.from_dict(params.to_dict())
        assert again == params
        assert again.clone(seed=1).structured_outputs == params.structured_outputs


def test_a_structural_tag_in_vllms_first_form_is_written_as_xgrammars_triggered_tags():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    first = StructuredOutputsParams(structural_tag={
        "type": "structural_tag", "triggers": ["<function="],
        "structures": [{"begin": "<function=get_weather>", "schema": schema, "end": "</function>"}]})
    current = StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<function="], "tags": [
            {"type": "tag", "begin": "<function=get_weather>", "end": "</function>",
             "content": {"type": "json_schema", "json_schema": schema}}]}}))
    assert first == current and first.cache_key == ("structural_tag", current.structural_tag)
    assert SamplingParams.from_dict(SamplingParams(structured_outputs=first).to_dict()).structured_outputs == first


def test_schema_text_keeps_property_order_and_is_the_cache_key():
    a = StructuredOutputsParams(json={"properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{"properties": {"b": {}, "a": {}}}')
    assert a.json == '{"properties":{"b":{},"a":{}}}'
    assert a.cache_key == b.cache_key == ("json", a.json)


@pytest.mark.parametrize("constraint, message", [
    ({}, "exactly one of json, json_object, regex, choice, grammar, structural_tag; got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": "[1]"}, "structured_outputs.json must be a JSON schema"),
    ({"regex": "a(b"}, "structured_outputs.regex is not a valid regular expression"),
    ({"regex": "a{99999999999}"}, "structured_outputs.regex is not a valid regular expression"),
    ({"choice": []}, "structured_outputs.choice must be a list"),
    ({"choice": ["a", ""]}, "structured_outputs.choice must be a list"),
    ({"grammar": ""}, "structured_outputs.grammar must be a non-empty string"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be true"),
    ({"xml": "a"}, "structured_outputs has unknown fields: ['xml']"),
    ({"structural_tag": "{no"}, "structured_outputs.structural_tag is not valid JSON"),
    ({"structural_tag": {"type": "json_schema"}}, 'structural_tag must be an object of type "structural_tag"'),
    ({"structural_tag": {"type": "structural_tag"}}, "structural_tag needs a format (an object) or structures"),
    ({"structural_tag": {"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": []}},
     "structural_tag.triggers must be a list of non-empty strings"),
    ({"structural_tag": {"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a"]}},
     "structural_tag.structures[0] must be {begin, schema, end}"),
    ({"structural_tag": {"structures": [{"begin": "<a>", "schema": 1, "end": "</a>"}], "triggers": ["<a"]}},
     "structural_tag.structures[0].schema must be a JSON schema"),
    ({"regex": "a", "start_after_token_ids": [-1]}, "start_after_token_ids must be a list of at most 64 token ids"),
    ({"regex": "a", "start_after_token_ids": [1] * 65}, "start_after_token_ids must be a list of at most 64"),
    ({"regex": "a", "start_after_token_ids": "</think>"}, "start_after_token_ids must be a list"),
])
def test_bad_constraints_name_the_field(constraint, message):
    with pytest.raises(ValueError, match="structured_outputs") as info:
        SamplingParams(structured_outputs=constraint)
    assert message in str(info.value)


def test_start_after_token_ids_are_checked_against_the_vocabulary():
    params = SamplingParams(structured_outputs={"regex": "a", "start_after_token_ids": [5, 100]})
    params.validate_token_ids(101)
    with pytest.raises(ValueError, match=r"structured_outputs.start_after_token_ids: token id 100 is out of range"):
        params.validate_token_ids(100)

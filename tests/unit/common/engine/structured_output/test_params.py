"""The constraint as plain data: checked torch-free, carried through SamplingParams."""
from __future__ import annotations

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


def test_schema_text_keeps_property_order_and_is_the_cache_key():
    a = StructuredOutputsParams(json={"properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{"properties": {"b": {}, "a": {}}}')
    assert a.json == '{"properties":{"b":{},"a":{}}}'
    assert a.cache_key == b.cache_key == ("json", a.json)


@pytest.mark.parametrize("constraint, message", [
    ({}, "exactly one of json, json_object, regex, choice, grammar; got none"),
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

"""The constraint as plain data: checked torch-free, carried through SamplingParams."""
from __future__ import annotations

import pytest

from common.engine.sampling_params import SamplingParams
from common.engine.structured_output.params import StructuredOutputsParams


def test_each_kind_round_trips_through_sampling_params():
    for constraint in ({"json": {"type": "object", "properties": {"b": {}, "a": {}}}},
                       {"json_object": True}, {"regex": "[a-z]+"}, {"choice": ["x", "y"]},
                       {"grammar": 'root ::= "a"'}):
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
])
def test_bad_constraints_name_the_field(constraint, message):
    with pytest.raises(ValueError, match="structured_outputs") as info:
        SamplingParams(structured_outputs=constraint)
    assert message in str(info.value)

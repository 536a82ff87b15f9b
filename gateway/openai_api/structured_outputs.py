"""The OpenAI request fields that constrain the output -> one StructuredOutputsParams.

OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name", "schema", "strict", "description"}}; vLLM's {"type":
"structural_tag", ...} too: a structural tag, in either of its forms) and vLLM's extensions:
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and the newer
`structured_outputs` object. At most one constraint per request; what can be checked
here (torch-free) is: the schema is JSON, the regex compiles with `re`. A constraint
the grammar backend refuses comes back from the instance as a 400 too.

`strict` is accepted either way: the output always follows the schema exactly.
"""
from __future__ import annotations

from typing import Any

from common.engine.structured_output.params import (
    KINDS,
    MAX_CHOICES,
    MAX_CONSTRAINT_CHARS,
    StructuredOutputsParams,
)
from gateway.openai_api.errors import invalid_field

# vLLM's extension fields and the kind each one gives.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")
JSON_SCHEMA_FIELDS = ("name", "schema", "strict", "description")


def checked_later(schema: dict):
    """A field's check at parse time: none (structured_outputs_of sees every constraint
    field at once); `json_schema` is what it accepts, for the OpenAPI document."""
    def check(param: str, value: Any) -> Any:
        return value
    check.json_schema = schema
    return check


_NON_EMPTY_TEXT = {"type": "string", "minLength": 1, "maxLength": MAX_CONSTRAINT_CHARS}
_JSON_SCHEMA = {"anyOf": [{"type": "object"}, {"type": "boolean"}, _NON_EMPTY_TEXT],
                "description": "a JSON schema, or its JSON text"}
_CHOICES = {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES,
            "items": {"type": "string", "minLength": 1}}
_STRUCTURAL_TAG = {"anyOf": [{"type": "object"}, _NON_EMPTY_TEXT],
                   "description": "xgrammar's structural tag ({\"type\": \"structural_tag\", \"format\": {...}}, or "
                                  "{\"structures\": [{\"begin\", \"schema\", \"end\"}], \"triggers\": [...]}), "
                                  "or its JSON text"}
SCHEMA_BY_KIND = {"json": _JSON_SCHEMA, "json_object": {"type": "boolean"}, "regex": _NON_EMPTY_TEXT,
                  "choice": _CHOICES, "grammar": _NON_EMPTY_TEXT, "structural_tag": _STRUCTURAL_TAG}
_RESPONSE_FORMAT = {"anyOf": [
    {"type": "object", "additionalProperties": False, "required": ["type"],
     "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "additionalProperties": False, "required": ["type", "json_schema"], "properties": {
        "type": {"enum": ["json_schema"]},
        "json_schema": {"type": "object", "additionalProperties": False, "required": ["schema"], "properties": {
            "name": {"type": ["string", "null"]}, "description": {"type": ["string", "null"]},
            "strict": {"type": ["boolean", "null"]}, "schema": _JSON_SCHEMA}}}},
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["structural_tag"]}},
     "description": "vLLM's: {\"format\": {...}} or {\"structures\": [...], \"triggers\": [...]}"}]}

FIELDS = {
    "response_format": checked_later(_RESPONSE_FORMAT),
    "structured_outputs": checked_later({
        "type": "object", "additionalProperties": False, "description": "exactly one of these",
        "properties": {kind: {"anyOf": [schema, {"type": "null"}]} for kind, schema in SCHEMA_BY_KIND.items()}}),
    **{name: checked_later(SCHEMA_BY_KIND[kind]) for name, kind in GUIDED_FIELDS.items()},
}


def structured_outputs_of(values: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field that set it (response_format, a guided_* field
    or structured_outputs: what a 400 names when the engine's grammar compiler refuses the
    constraint); (None, None) unconstrained. A 400 naming the field when it is bad."""
    given: list[tuple[str, str, Any]] = []  # (param, kind, value)
    if "response_format" in values:
        given += _response_format(values["response_format"])
    given += [(name, kind, values[name]) for name, kind in GUIDED_FIELDS.items() if name in values]
    if "structured_outputs" in values:
        given += _structured_outputs(values["structured_outputs"])
    if not given:
        return None, None
    if len(given) > 1:
        raise invalid_field(given[1][0], f"conflicts with {given[0][0]}: send one output constraint")
    param, kind, value = given[0]
    try:
        return StructuredOutputsParams(**{kind: value}), param.split(".", 1)[0]
    except OverflowError as e:  # re.compile's for a repeat count past its limit (a{99999999999}), not re.error
        raise invalid_field(param, f"is not a valid regular expression: {e}") from None
    except ValueError as e:  # "structured_outputs.<kind>[.<part>] <what is wrong>"
        message = str(e)
        prefix = f"structured_outputs.{kind}"
        if message.startswith(prefix + "."):  # a part of it: named under the request's field
            part, _, what = message[len(prefix) + 1:].partition(" ")
            raise invalid_field(f"{param}.{part}", what) from None
        raise invalid_field(param, message[len(prefix) + 1:] if message.startswith(prefix + " ") else message) \
            from None


def _response_format(value: Any) -> list[tuple[str, str, Any]]:
    if not isinstance(value, dict):
        raise invalid_field("response_format", "must be an object with a type")
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise invalid_field("response_format.type", f"must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, "
                                                    f"got {kind!r}")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"},
               "structural_tag": {"type", "format", "structures", "triggers"}}[kind]
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise invalid_field(f"response_format.{unknown[0]}", f"unknown field for type {kind}",
                            code="unknown_field")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_object", True)]
    if kind == "structural_tag":
        return [("response_format", "structural_tag", value)]
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid_field("response_format.json_schema", "is required: an object with a schema")
    unknown = sorted(set(spec) - set(JSON_SCHEMA_FIELDS))
    if unknown:
        raise invalid_field(f"response_format.json_schema.{unknown[0]}",
                            f"unknown field; this API accepts {', '.join(JSON_SCHEMA_FIELDS)}", code="unknown_field")
    if spec.get("strict") not in (None, True, False):
        raise invalid_field("response_format.json_schema.strict", "must be a boolean")
    for name in ("name", "description"):
        if spec.get(name) is not None and not isinstance(spec[name], str):
            raise invalid_field(f"response_format.json_schema.{name}", "must be a string")
    if "schema" not in spec:
        raise invalid_field("response_format.json_schema.schema", "is required", code="missing_field")
    return [("response_format.json_schema.schema", "json", spec["schema"])]


def _structured_outputs(value: Any) -> list[tuple[str, str, Any]]:
    if not isinstance(value, dict):
        raise invalid_field("structured_outputs", f"must be an object with one of {', '.join(KINDS)}")
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        raise invalid_field(f"structured_outputs.{unknown[0]}", f"unknown field; this API accepts "
                                                                f"{', '.join(KINDS)}", code="unknown_field")
    return [(f"structured_outputs.{kind}", kind, v) for kind, v in value.items() if v not in (None, False)]

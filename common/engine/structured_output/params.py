"""A request's output constraint, as plain data (vLLM's `structured_outputs` shape).

Exactly one kind is given: `json` (a JSON schema, as a dict or its JSON text),
`json_object` (any JSON object), `regex`, `choice` (one of these strings), `grammar`
(EBNF) or `structural_tag` (xgrammar's structural tag, vLLM's: free text in which tags hold
constrained content; either form vLLM takes, {"format": {...}} or the first one's
{"structures": [{"begin", "schema", "end"}], "triggers": [...]}, which is written as the
first: a `triggered_tags` format). What can be checked without the grammar backend is checked here
(and so in the torch-free gateway): one kind, well-typed, the schema is JSON, the
regex compiles with `re`. The backend rejects the rest when it compiles.

`start_after_token_ids` (a reasoning model's end-of-thinking marker, set by a gateway with a
reasoning parser) holds the constraint back: the output is free until it first holds these
tokens, and the constraint applies to what follows them (vLLM's structured outputs after
reasoning). Empty: the constraint applies from the first token.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# Bounds so one request cannot make the engine compile something huge.
MAX_CONSTRAINT_CHARS = 64 * 1024
MAX_CHOICES = 256
MAX_START_AFTER_TOKENS = 64


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema
    json_object: bool | None = None  # True: any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's dialect of GBNF)
    structural_tag: str | dict | None = None  # a structural tag, as a dict or its JSON text
    start_after_token_ids: tuple[int, ...] = ()  # the constraint starts after these output tokens

    def __post_init__(self) -> None:
        self._check_start_after()
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must give exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) if given else 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        field = f"structured_outputs.{kind}"
        if kind == "json":
            object.__setattr__(self, "json", _schema_text(value, field))
        elif kind == "structural_tag":
            object.__setattr__(self, "structural_tag", _structural_tag_text(value, field))
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"{field} must be true, got {value!r}")
        elif kind == "choice":
            if isinstance(value, tuple):
                object.__setattr__(self, "choice", list(value))
                value = self.choice
            if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in value)):
                raise ValueError(f"{field} must be a list of 1 to {MAX_CHOICES} non-empty strings")
            _check_length(sum(len(c) for c in value), field)
        else:
            if not isinstance(value, str) or not value:
                raise ValueError(f"{field} must be a non-empty string, got {type(value).__name__}")
            _check_length(len(value), field)
            if kind == "regex":
                try:
                    re.compile(value)
                except (re.error, OverflowError) as e:  # a{99999999999} overflows rather than errs
                    raise ValueError(f"{field} is not a valid regular expression: {e}") from None

    def _check_start_after(self) -> None:
        token_ids = self.start_after_token_ids
        if not isinstance(token_ids, (list, tuple)) or len(token_ids) > MAX_START_AFTER_TOKENS or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids):
            raise ValueError(f"structured_outputs.start_after_token_ids must be a list of at most "
                             f"{MAX_START_AFTER_TOKENS} token ids (integers >= 0)")
        object.__setattr__(self, "start_after_token_ids", tuple(token_ids))

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def value(self) -> str | bool | list[str]:
        return getattr(self, self.kind)

    @property
    def cache_key(self) -> tuple[str, str]:
        """(kind, text): equal constraints compile once."""
        value = self.value
        return self.kind, value if isinstance(value, str) else json.dumps(value)

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the given kind (json as its text) and start_after_token_ids if any."""
        value = self.value
        plain: dict[str, Any] = {self.kind: list(value) if isinstance(value, list) else value}
        if self.start_after_token_ids:
            plain["start_after_token_ids"] = list(self.start_after_token_ids)
        return plain

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StructuredOutputsParams":
        if not isinstance(data, dict):
            raise ValueError(f"structured_outputs must be an object with one of {', '.join(KINDS)}")
        unknown = set(data) - set(KINDS) - {"start_after_token_ids"}
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields: {sorted(map(str, unknown))}")
        return cls(**data)


def _check_length(num_chars: int, field: str) -> None:
    if num_chars > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"{field} must be at most {MAX_CONSTRAINT_CHARS} characters, got {num_chars}")


def _structural_tag_text(value: Any, field: str) -> str:
    """The tag as compact JSON text in xgrammar's current form ({"type": "structural_tag",
    "format": {...}}); the older {"structures", "triggers"} becomes its `triggered_tags` format."""
    value = _from_json_text(value, field)
    if not isinstance(value, dict) or value.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f'{field} must be an object of type "structural_tag"')
    if "structures" in value or "triggers" in value:
        value = {"type": "structural_tag", "format": _triggered_tags(value, field)}
    elif not isinstance(value.get("format"), dict):
        raise ValueError(f"{field} needs a format (an object) or structures and triggers")
    else:
        value = {"type": "structural_tag", "format": value["format"]}
    return _compact_json(value, field)


def _triggered_tags(value: dict, field: str) -> dict:
    """vLLM's first structural tag form as xgrammar's format: after any trigger, one of the
    tags that start with it, its content valid against its schema."""
    structures, triggers = value.get("structures"), value.get("triggers")
    if set(value) - {"type", "structures", "triggers"}:
        raise ValueError(f"{field} has unknown fields: {sorted(set(value) - {'type', 'structures', 'triggers'})}")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{field}.triggers must be a list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{field}.structures must be a non-empty list of {{begin, schema, end}}")
    tags = []
    for i, structure in enumerate(structures):
        if (not isinstance(structure, dict) or set(structure) != {"begin", "schema", "end"}
                or not all(isinstance(structure[k], str) for k in ("begin", "end"))):
            raise ValueError(f"{field}.structures[{i}] must be {{begin, schema, end}} with begin and end strings")
        schema = json.loads(_schema_text(structure["schema"], f"{field}.structures[{i}].schema"))
        tags.append({"type": "tag", "begin": structure["begin"], "end": structure["end"],
                     "content": {"type": "json_schema", "json_schema": schema}})
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags}


def _schema_text(schema: Any, field: str) -> str:
    """The schema as compact JSON text; key order is kept (it is the order properties are generated in)."""
    schema = _from_json_text(schema, field)
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{field} must be a JSON schema (an object), got {type(schema).__name__}")
    return _compact_json(schema, field)


def _from_json_text(value: Any, field: str) -> Any:
    """value, parsed where it is JSON text (bounded before parsing)."""
    if not isinstance(value, str):
        return value
    _check_length(len(value), field)
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{field} is not valid JSON: {e}") from None


def _compact_json(value: Any, field: str) -> str:
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"{field} is not JSON data: {e}") from None
    _check_length(len(text), field)
    return text

"""Options given as a JSON object, as vLLM takes them (--speculative-config, --pooler-config):
a flag's text or an LLM(...) dict, checked for its shape and keys before each option reads
its fields. Plain Python."""
from __future__ import annotations

import json
from collections.abc import Iterable


def json_object_option(value: dict | str, name: str, known_keys: Iterable[str]) -> dict:
    """`value` as a dict (text parsed as JSON); ValueError naming the option (name, as in
    LLM(name=...); the flag is --name with dashes) where it is no JSON object or holds a key
    outside known_keys."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--{name.replace('_', '-')} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object; got {type(value).__name__}")
    known = sorted(set(known_keys))
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"unknown {name} keys {unknown}; known: {known}")
    return value

"""Structured outputs with the offline API on the bundled model: JSON valid against a
schema, a regex match and one of the choices, greedy (deterministic) and seeded."""
from __future__ import annotations

import json
import re

import pytest

from common import LLM, SamplingParams

# The offline engine in this process only: the parallel part runs it, its tests on one worker
# (they share the module's engine).
pytestmark = [pytest.mark.slow, pytest.mark.in_process]

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]},
                         "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
          "required": ["name", "age", "city", "pets"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe so"]
PROMPTS = ["Give me a person as JSON:", "Describe a user in JSON:", "Is the sky blue?"]


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert list(value) == ["name", "age", "city", "pets"]  # the schema's property order
    assert len(value["name"]) <= 20 and 0 <= value["age"] <= 120 and value["city"] in ("Paris", "Rome", "Oslo")
    assert len(value["pets"]) <= 2 and set(value["pets"]) <= {"cat", "dog"}


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=256, max_num_seqs=8)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=3)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("constraint, check", [
    ({"json": SCHEMA}, check_schema),
    ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)),
    ({"choice": CHOICES}, lambda text: text in CHOICES or pytest.fail(text)),
], ids=["json", "regex", "choice"])
def test_bundled_model_outputs_obey_the_constraint(llm, constraint, check, sampling):
    params = SamplingParams(max_tokens=80, structured_outputs=constraint, **sampling)
    outputs = llm.generate(PROMPTS, params)
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop", output.outputs[0].text
        check(output.outputs[0].text)
    again = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]
    assert llm.engine.kv_cache_manager.num_free_blocks == 256

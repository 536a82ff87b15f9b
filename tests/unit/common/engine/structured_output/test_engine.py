"""Guided decoding through the real engine on a tiny random Llama (bundled tokenizer):
outputs obey their constraint whatever the sampling, the batch or preemption."""
from __future__ import annotations

import json
import re

import pytest

import xgrammar as xgr

from common import LLM, SamplingParams
from common.engine.request import Request
from common.engine.structured_output.params import StructuredOutputsParams

SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"},
                         "size": {"type": "integer", "minimum": 1, "maximum": 99},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["ok", "size", "color", "tags"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["yes", "no", "not sure"]
PROMPTS = [{"prompt_token_ids": [5, 17, 300 + i, 4000 + 7 * i]} for i in range(4)]


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"ok", "size", "color", "tags"}
    assert isinstance(value["ok"], bool) and 1 <= value["size"] <= 99
    assert value["color"] in {"red", "green", "blue"}
    assert len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"}


CASES = [({"json": SCHEMA}, check_schema),
         ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)),
         ({"choice": CHOICES}, lambda text: text in CHOICES or pytest.fail(text)),
         ({"grammar": 'root ::= "(" [a-c]+ ")"'}, lambda text: re.fullmatch(r"\([a-c]+\)", text) or pytest.fail(text)),
         ({"json_object": True}, lambda text: isinstance(json.loads(text), dict) or pytest.fail(text)),
         # A tag's JSON content admits any whitespace (xgrammar's structural tags), which a random
         # model pads forever: regex content here, JSON content in the matcher test below.
         ({"structural_tag": {"type": "structural_tag", "format": {
             "type": "tag", "begin": "<answer>", "end": "</answer>", "content": {"type": "regex", "pattern": REGEX}}}},
          lambda text: re.fullmatch(f"<answer>{REGEX}</answer>", text) or pytest.fail(text))]


@pytest.fixture
def llm(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=8)
    yield llm
    assert llm.engine.kv_cache_manager.num_free_blocks == 64
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=11)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("constraint, check", CASES, ids=[next(iter(c)) for c, _ in CASES])
def test_outputs_obey_the_constraint_and_end_with_stop(llm, constraint, check, sampling):
    params = SamplingParams(max_tokens=200, structured_outputs=constraint, **sampling)
    outputs = llm.generate(PROMPTS, params)
    for output in outputs:
        completion = output.outputs[0]
        if completion.finish_reason == "length":  # json_object may run on: what came is a prefix
            assert "json_object" in constraint
            continue
        assert completion.finish_reason == "stop"
        check(completion.text)
    assert llm.generate(PROMPTS, params)[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_unconstrained_rows_are_unchanged_by_a_constrained_neighbour(llm):
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], [free, seeded])]
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[2:], [free, seeded] + [
        SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"choice": CHOICES})] * 2)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert all(o.outputs[0].text in CHOICES for o in mixed[2:])


def test_preemption_does_not_change_constrained_outputs(tiny_llama_dir):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs={"json": SCHEMA})
    prompts = [{"prompt_token_ids": list(range(10 + i, 30 + i))} for i in range(6)]
    roomy = LLM(model=str(tiny_llama_dir), num_kv_blocks=128, block_size=4).generate(prompts, params)
    tight = LLM(model=str(tiny_llama_dir), num_kv_blocks=24, block_size=4)
    cramped = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in cramped] == [o.outputs[0].token_ids for o in roomy]


def _first_end(token_ids: list[int], sequence: tuple[int, ...]) -> int:
    """The index just past the sequence's first occurrence in token_ids."""
    return next(i + len(sequence) for i in range(len(token_ids)) if tuple(token_ids[i:i + len(sequence)]) == sequence)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=11)], ids=["greedy", "seeded"])
def test_a_held_back_constraint_applies_after_its_start_sequence(llm, sampling):
    free = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=8, **sampling))]
    # each prompt's own marker: two tokens its free output writes (a reasoning model's "</think>")
    params = [SamplingParams(max_tokens=60, structured_outputs={"regex": REGEX, "start_after_token_ids": ids[3:5]},
                             **sampling) for ids in free]
    held = llm.generate(PROMPTS, params)
    for ids, output in zip(free, held):
        end = _first_end(ids, tuple(ids[3:5]))
        completion = output.outputs[0]
        assert completion.token_ids[:end] == ids[:end]  # free until the marker, as without a constraint
        assert completion.finish_reason == "stop"
        assert re.fullmatch(REGEX, llm.tokenizer.decode(completion.token_ids[end:])), completion.text
    never = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, structured_outputs={
        "regex": REGEX, "start_after_token_ids": [llm.engine.model_config.vocab_size - 1] * 3}, **sampling))
    assert never[0].outputs[0].token_ids == free[0]  # the marker never came: unconstrained to max_tokens
    assert never[0].outputs[0].finish_reason == "length"


def test_preemption_replays_a_held_back_constraint(tiny_llama_dir):
    prompts = [{"prompt_token_ids": list(range(10 + i, 30 + i))} for i in range(6)]
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=6)
    markers = [o.outputs[0].token_ids[4:6] for o in LLM(model=str(tiny_llama_dir)).generate(prompts, free)]
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=60,
                             structured_outputs={"json": SCHEMA, "start_after_token_ids": marker})
              for marker in markers]
    roomy = LLM(model=str(tiny_llama_dir), num_kv_blocks=128, block_size=4).generate(prompts, params)
    tight = LLM(model=str(tiny_llama_dir), num_kv_blocks=24, block_size=4)
    cramped = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in cramped] == [o.outputs[0].token_ids for o in roomy]
    finished = [(marker, o.outputs[0].token_ids) for marker, o in zip(markers, roomy)
                if o.outputs[0].finish_reason == "stop"]
    assert finished  # the grammar started (and completed) after the markers
    for marker, ids in finished:
        check_schema(tight.tokenizer.decode(ids[_first_end(ids, tuple(marker)):]))


def test_a_resumed_request_continues_its_constrained_output_where_it_stopped(llm):
    # A request migrated from a lost instance: its grammar is advanced over the output it brings.
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=200, structured_outputs={"json": SCHEMA})
    whole = llm.generate(PROMPTS[:1], params)[0].outputs[0]
    num_resumed = len(whole.token_ids) // 2
    llm.engine.add_request(Request("resumed", PROMPTS[0]["prompt_token_ids"], params,
                                   output_token_ids=whole.token_ids[:num_resumed]))
    continued = []
    while llm.engine.has_unfinished_requests():
        continued += [t for output in llm.engine.step() for t in output.new_token_ids]
    assert whole.token_ids[:num_resumed] + continued == whole.token_ids
    check_schema(whole.text)


def test_a_structural_tag_lets_text_run_free_until_a_trigger_then_holds_the_tags_schema(llm):
    """vLLM's first form: after "<function=", one of the listed tags with content valid
    against its schema; before it, any text."""
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
               "additionalProperties": False}
    tag = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=get_weather>", "schema": weather, "end": "</function>"}]}
    compiled = llm.engine.structured_output.backend.compile(StructuredOutputsParams(structural_tag=tag))
    for text, accepted in [('Let me look. <function=get_weather>{"city": "Paris"}</function> Done.', True),
                           ("No call at all.", True),
                           ('<function=get_weather>{"town": "Paris"}</function>', False),
                           ('<function=get_time>{"city": "Paris"}</function>', False)]:
        assert xgr.GrammarMatcher(compiled).accept_string(text) is accepted, text


@pytest.mark.parametrize("constraint, message", [
    ({"grammar": "root ::= undefined_rule"}, 'structured_outputs.grammar is not supported: EBNF parser error'),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>",
                                                              "content": {"type": "nonsense"}}}},
     "structured_outputs.structural_tag is not supported"),
    ({"regex": "(?=a)b"}, "structured_outputs.regex is not supported: Regex parsing error"),
    ({"json": {"type": "objectx"}}, 'structured_outputs.json is not supported: Unsupported type "objectx"'),
])
def test_constraints_the_backend_rejects_fail_before_any_kv(llm, constraint, message):
    params = SamplingParams(max_tokens=5, structured_outputs=constraint)
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.engine.add_request(Request("bad", [5, 6, 7], params))
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv_cache_manager.num_free_blocks == 64
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=3))[0].outputs[0].token_ids  # still serving


def test_a_constraint_compiles_once(llm):
    params = SamplingParams(temperature=0.0, max_tokens=10, structured_outputs={"regex": "[a-z]{4}"})
    llm.generate(PROMPTS, params)
    llm.engine.structured_output.compile(params)  # what a service does off the engine loop
    stats = llm.engine.stats()
    assert stats["structured_output_compiles"] == 1 and stats["structured_output_requests"] == 4
    assert stats["structured_output_bitmask_steps"] > 0


def test_worker_metrics_export_constrained_requests_compiles_and_mask_time(llm):
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from common.service.metrics import WorkerMetrics
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"choice": CHOICES}))
    load = SimpleNamespace(num_running_requests=0, num_waiting_requests=0, num_free_blocks=1, num_total_blocks=1,
                           num_queued_prefill_tokens=0)
    text = generate_latest(WorkerMetrics("decode", "d0", lambda: load, llm.engine.stats).registry).decode()
    labels = '{instance_id="d0",role="decode"}'
    assert f"pdserve_structured_output_requests_total{labels} 2.0" in text
    assert f'pdserve_structured_output_compile_seconds_bucket{{instance_id="d0",le="+Inf",role="decode"}} 1.0' in text
    assert f"pdserve_structured_output_compile_seconds_count{labels} 1.0" in text
    assert float(re.search(rf"pdserve_structured_output_bitmask_seconds_total{re.escape(labels)} (\S+)", text)[1]) > 0

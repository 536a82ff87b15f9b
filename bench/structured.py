"""`pdserve bench structured`: JSON-schema constrained generation on the bundled model.

Runs one batch of requests over a set of schemas (nested objects, arrays, enums, numbers
with ranges) through `LLM.generate` with `structured_outputs={"json": schema}`, checks
every output that was not cut by max_tokens against its schema (jsonschema), then runs
the same prompts unconstrained with each request's output length fixed to what the
constrained run produced (ignore_eos), so both arms generate the same number of tokens.
Prefix caching is off and a warm-up (which also compiles every schema once) runs first,
so neither arm gets the other's cache.
Reports the validity rate, both throughputs and their ratio, and compile times.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

NAME = {"type": "string", "maxLength": 16}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "moons": {"type": "integer", "minimum": 0, "maximum": 200}},
     "required": ["name", "moons"], "additionalProperties": False},
    {"type": "object", "properties": {"city": NAME, "country": NAME,
                                      "population_millions": {"type": "number", "minimum": 0, "maximum": 40}},
     "required": ["city", "country", "population_millions"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue", "yellow"]},
                                      "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
     "required": ["colour", "hex"], "additionalProperties": False},
    {"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                      "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action"]},
                                                 "minItems": 1, "maxItems": 3}},
     "required": ["title", "year", "genres"], "additionalProperties": False},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "first": NAME, "last": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["first", "last", "age"], "additionalProperties": False}},
     "required": ["person"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "boolean"}, "confidence": {
        "type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"],
     "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "name": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["name", "qty"],
        "additionalProperties": False}, "minItems": 1, "maxItems": 3}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"weekday": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                                      "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
     "required": ["weekday", "hour"], "additionalProperties": False},
    {"type": "object", "properties": {"element": NAME, "symbol": {"type": "string", "maxLength": 3},
                                      "number": {"type": "integer", "minimum": 1, "maximum": 118}},
     "required": ["element", "symbol", "number"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"], "additionalProperties": False}, "label": NAME},
     "required": ["point", "label"], "additionalProperties": False},
]
TOPICS = ["a planet", "a city", "a colour", "a film", "a person", "a yes/no question", "a shopping list",
          "a meeting time", "a chemical element", "a point on a map"]
ASKS = ["Describe {} as JSON.", "Give me {} in JSON.", "Answer with JSON about {}.", "JSON for {}, please.",
        "Write {} as a JSON object."]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench structured", description=__doc__.split("\n")[0])
    parser.add_argument("--requests-per-schema", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    import jsonschema

    from common import LLM, SamplingParams

    # No prefix cache: the second arm would otherwise find the first arm's prompts cached.
    llm = LLM(enable_prefix_caching=False)
    prompts, schemas = [], []
    for index, schema in enumerate(SCHEMAS):
        for ask in ASKS[:args.requests_per_schema]:
            prompts.append(ask.format(TOPICS[index]))
            schemas.append(schema)
    constrained = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs={"json": s})
                   for s in schemas]
    # Warm-up, untimed: the first forward passes, and each schema's compile (cached by its text,
    # as a service caches it across requests); compile time is reported on its own.
    t0 = time.perf_counter()
    llm.generate(prompts[::args.requests_per_schema], [p.clone(max_tokens=1) for p in
                                                        constrained[::args.requests_per_schema]])
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, constrained)
    constrained_s = time.perf_counter() - t0
    num_valid = num_truncated = 0
    for output, schema in zip(outputs, schemas):
        completion = output.outputs[0]
        if completion.finish_reason == "length":
            num_truncated += 1
            continue
        try:
            jsonschema.validate(json.loads(completion.text), schema)
            num_valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            print(f"invalid: {completion.text!r}: {e}")
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    free = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in lengths]
    t0 = time.perf_counter()
    llm.generate(prompts, free)
    free_s = time.perf_counter() - t0
    num_tokens = sum(lengths)
    figures = {
        "machine": platform.processor() or platform.machine(), "num_requests": len(prompts),
        "num_schemas": len(SCHEMAS), "num_not_truncated": len(prompts) - num_truncated,
        "num_valid": num_valid, "num_output_tokens": num_tokens,
        "constrained_tokens_per_s": round(num_tokens / constrained_s, 1),
        "unconstrained_tokens_per_s": round(num_tokens / free_s, 1),
        "throughput_ratio": round(free_s / constrained_s, 3),
        "warmup_s_incl_compiling_every_schema": round(warmup_s, 2),
        "command": "pdserve bench structured " + " ".join(argv if argv is not None else []),
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0 if num_valid == len(prompts) - num_truncated else 1

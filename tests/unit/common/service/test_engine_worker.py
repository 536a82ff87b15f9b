"""An engine service's worker in-process (the decode role, a tiny random Llama): what its
flags make of the engine it starts."""
from __future__ import annotations

import asyncio

import pytest

from common.engine.sampling_params import SamplingParams
from decode_service.main import build_parser
from decode_service.server import DecodeWorker


@pytest.mark.parametrize("flag, warm", [("--grammar-warm-up", True), ("--no-grammar-warm-up", False)])
def test_the_grammar_backend_is_built_at_start_up_unless_left_to_the_first_constraint(tiny_llama_dir, flag, warm):
    args = build_parser().parse_args(["--model", str(tiny_llama_dir), "--kv-cache-memory", "16MiB", flag])
    worker = DecodeWorker(args, "decode-grammar-warm-up")
    try:
        structured_output = worker.core.structured_output
        assert structured_output.is_warm == warm
        # Left to it, the first constraint builds the backend (off the engine loop, as admission does).
        structured_output.compile(SamplingParams(structured_outputs={"choice": ["yes", "no"]}))
        assert structured_output.is_warm
        assert structured_output.stats()["structured_output_compiles"] == 1
    finally:
        asyncio.run(worker.close())

"""An eager engine given the native decode loop by hand, as a compiled one builds it at
warm-up: the suite runs eagerly (compiling each model would cost it minutes), and what the
loop reads is the packed linears' decode weights, not a compiled graph. test_compilation
checks that warm-up builds the loops itself."""
from __future__ import annotations

from common.engine.llm import LLM
from common.engine.models.prepacked_linear import prepack_linears
from common.engine.native_decode import NativeDecodeLoop


def with_native_loop(llm: LLM) -> NativeDecodeLoop | None:
    """The engine's loop (None where its model is not one the loop serves), and its
    proposer's own where it has one (build_native_loop)."""
    runner = llm.engine.executor.runner
    prepack_linears(runner.model)
    runner.native_decode = NativeDecodeLoop.build(runner.model, runner.kv_caches)
    if runner.native_decode is not None and runner.proposer is not None:
        runner.proposer.build_native_loop()
    return runner.native_decode

"""An eager engine given the native decode loop by hand, as a compiled one builds it at
warm-up: the suite runs eagerly (compiling each model would cost it minutes), and what the
loop reads is the packed linears' decode weights, not a compiled graph. test_compilation
checks that warm-up builds the loops itself."""
from __future__ import annotations

import functools

import torch

from common.engine.llm import LLM
from common.engine.models.prepacked_linear import prepack_linears, prepacking_available
from common.engine.native_decode import NativeDecodeLoop

# Why a bf16 test skips on a CPU whose oneDNN runs no bf16 linears.
NO_PACKED_BF16 = ("oneDNN packs no bf16 linears on this CPU (no AVX512-BF16 or AMX): a bf16 model keeps torch's "
                  "linears, so it has no native decode loop and no packed head")


@functools.cache
def bf16_is_packed() -> bool:
    """Whether prepack_linears packs a bf16 model here; where it does not (AVX2-only CPUs) the
    loop serves no bf16 model."""
    return prepacking_available(torch.bfloat16)


def packed_dtype() -> str:
    """The dtype for tests of what the loop does with a GGUF model's packed head: bf16 where
    oneDNN packs it, else fp32, which it packs everywhere."""
    return "bfloat16" if bf16_is_packed() else "float32"


def with_native_loop(llm: LLM) -> NativeDecodeLoop | None:
    """The engine's loop (None where its model is not one the loop serves), and its
    proposer's own where it has one (build_native_loop)."""
    runner = llm.engine.executor.runner
    prepack_linears(runner.model)
    runner.native_decode = NativeDecodeLoop.build(runner.model, runner.kv_caches)
    if runner.native_decode is not None and runner.proposer is not None:
        runner.proposer.build_native_loop()
    if runner.native_decode is not None and runner.lora_manager is not None:
        runner.lora_manager.register_with(runner.native_decode.register_adapter)
    return runner.native_decode

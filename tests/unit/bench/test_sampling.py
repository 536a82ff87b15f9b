"""bench sampling's switches between rows drawn in the native loop, after it by the sampler's
native ops, and by their torch forms, and its sampler timing: every arm draws the same
tokens' distribution, so only their cost differs."""
from __future__ import annotations

import pytest
import torch

from bench.sampling import CASES, DECODE_ARMS, sampler_ms, use_decode_arm, use_native
from common.engine.llm import LLM
from kernels.cpu_sampling import native_argmax_available, native_rows

pytestmark = pytest.mark.skipif(not native_argmax_available(), reason="no C++ compiler: nothing to compare")


def test_the_switch_turns_the_native_ops_off_and_back_on():
    logits = torch.zeros(2, 8)
    try:
        use_native(False)
        assert not native_rows(logits)
        use_native(True)
        assert native_rows(logits)
    finally:
        use_native(True)


def test_sampler_ms_times_both_arms_on_every_case():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0))  # [8, vocab]
    for case in CASES.values():
        timings = sampler_ms(logits, case, num_seqs=4, repeats=3)  # the last round's last arm: torch
        assert set(timings) == {"native", "torch"} and min(timings.values()) > 0
        assert native_rows(logits)  # left native


def test_the_decode_arms_move_the_draws(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16)
    sampler = llm.engine.executor.runner.sampler
    logits = torch.zeros(2, 8)
    try:
        seen = {}
        for arm in DECODE_ARMS:
            use_decode_arm(llm, arm)
            seen[arm] = (sampler.samples_in_loop, native_rows(logits))
        assert seen == {"in loop": (True, True), "after loop": (False, True), "torch": (False, False)}
    finally:
        use_decode_arm(llm, "in loop")
        llm.engine.shutdown()
    assert native_rows(logits)

"""LoRA adapters' deltas inside the native decode loop (kernels/cpu/lora_deltas.h): a decode
step whose rows mix two adapters and the base model gives, through the loop, the hidden
states the model's own forward pass gives with pdserve::add_lora_deltas, on the loop's
fork-per-projection path (fp32 rows) and in its parallel regions (bf16 panels, Q8_0 blocks),
on one thread and on two, at few rows and at many; an engine's greedy tokens with adapters
are the same with the loop as without it; a bad adapter id is refused with nothing written."""
from __future__ import annotations

import pytest
import torch

from common.engine.forward_context import forward_context
from common.engine.llm import LLM
from common.engine.outputs import ScheduledRequest
from common.engine.sampling_params import SamplingParams
from kernels.cpu_decode import native_decode_available
from tests.support.native_loop import NO_PACKED_BF16, bf16_is_packed, with_native_loop
from tests.support.peft_adapters import requires_peft

pytestmark = [pytest.mark.skipif(not native_decode_available(), reason="no native GEMV or attention here"),
              requires_peft]

# fp32: the loop and the model differ in summation order only.
FP32_ATOL = 1e-4
# bf16 and Q8_0 blocks: each rounds differently (the loop once per fused step, the model
# after each op), so both are held to the fp32 model's hidden states: the loop's mean
# relative error may exceed the model's own by this factor at most (measured on the tiny
# random model, whose bf16 states are 5-15% off fp32 on both paths: 1.05 at most).
ERROR_RATIO = 1.25


def engine(base_dir, adapters, dtype: str, quantization: str | None = None) -> LLM:
    llm = LLM(model=str(base_dir), dtype=dtype, quantization=quantization, enable_lora=True, max_loras=2,
              max_lora_rank=8, num_kv_blocks=256, block_size=8)
    for name, (path, _) in adapters.items():
        llm.engine.executor.runner.add_lora(name, path)
    return llm


def prompts(num_seqs: int) -> list[list[int]]:
    return [[(37 * i + 11 * n) % 900 + 50 for i in range(5 + 3 * n)] for n in range(num_seqs)]


@torch.inference_mode()
def decode_step(llm: LLM, seqs: list[list[int]], lora_names: list[str | None], through_loop: bool) -> torch.Tensor:
    """Prefill each sequence (its own blocks) through the model with its adapter, then one
    decode step, through the loop or the model: the normed hidden states [num_seqs, hidden]."""
    runner = llm.engine.executor.runner
    params = SamplingParams(temperature=0.0)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(seqs))]
    prefill = [ScheduledRequest(f"r{i}", p, 0, t, True, params, lora_name=name)
               for i, (p, t, name) in enumerate(zip(seqs, tables, lora_names))]
    decode = [ScheduledRequest(f"r{i}", [p[-1]], len(p), t, True, params, lora_name=name)
              for i, (p, t, name) in enumerate(zip(seqs, tables, lora_names))]
    for k_cache, v_cache in runner.kv_caches:
        k_cache.zero_()
        v_cache.zero_()
    ids, positions, meta, _, _ = runner.prepare_inputs(prefill)
    with forward_context(meta), runner.lora_manager.step(prefill):
        runner.model(ids, positions, runner.kv_caches, meta)
    ids, positions, meta, _, _ = runner.prepare_inputs(decode)
    if through_loop:
        loop = runner.native_decode
        assert loop.serves(ids.shape[0], meta)
        return loop.run(ids, positions, meta, runner.lora_manager.native_ids(decode))
    with forward_context(meta), runner.lora_manager.step(decode):
        return runner.model(ids, positions, runner.kv_caches, meta)


def relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    """The mean over sequences of |got - reference| / |reference|."""
    return ((got.float() - reference).norm(dim=-1) / reference.norm(dim=-1)).mean().item()


@pytest.mark.parametrize("dtype, quantization, in_regions", [
    ("float32", None, True),  # fp32 panels: in regions where built (else the test skips)
    pytest.param("bfloat16", None, True, marks=pytest.mark.skipif(not bf16_is_packed(), reason=NO_PACKED_BF16)),
    ("float32", "int8", True)])
def test_a_step_mixing_adapters_gives_the_models_hidden_states(base_dir, adapters, dtype, quantization, in_regions):
    exact = dtype == "float32" and quantization is None
    reference = None if exact else engine(base_dir, adapters, "float32")  # the fp32 model's own forward
    llm = engine(base_dir, adapters, dtype, quantization)
    loop = with_native_loop(llm)
    held = llm.engine.executor.runner.lora_manager.adapters.values()
    assert loop is not None and all(adapter.native_id is not None for adapter in held)
    if in_regions and not loop.in_regions:
        pytest.skip("this CPU runs the model's projections outside parallel regions")
    assert loop.in_regions == in_regions
    threads_before = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for num_seqs in (3, 18):  # 18: rows over the threads, in and out of the regions
                seqs = prompts(num_seqs)
                names = [("a", None, "b")[i % 3] for i in range(num_seqs)]
                if not loop.serves(num_seqs, _decode_meta(llm, seqs)):
                    continue  # dense fp32 rows: the loop takes up to DECODE_MAX_TOKENS
                got = decode_step(llm, seqs, names, through_loop=True)
                want = decode_step(llm, seqs, names, through_loop=False)
                if exact:
                    torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)
                else:
                    fp32 = decode_step(reference, seqs, names, through_loop=False)
                    assert relative_error(got, fp32) <= ERROR_RATIO * relative_error(want, fp32), num_seqs
                base = decode_step(llm, seqs, [None] * num_seqs, through_loop=False)
                adapted = [i for i, name in enumerate(names) if name is not None]
                assert not torch.allclose(got[adapted], base[adapted], atol=1e-2)  # the deltas are there
    finally:
        torch.set_num_threads(threads_before)
        llm.engine.shutdown()
        if reference is not None:
            reference.engine.shutdown()


def _decode_meta(llm: LLM, seqs: list[list[int]]):
    runner = llm.engine.executor.runner
    params = SamplingParams(temperature=0.0)
    decode = [ScheduledRequest(f"r{i}", [p[-1]], len(p), list(range(8 * i, 8 * i + 8)), True, params)
              for i, p in enumerate(seqs)]
    return runner.prepare_inputs(decode)[2]


def test_a_step_naming_an_adapter_the_loop_does_not_hold_is_refused(base_dir, adapters):
    llm = engine(base_dir, adapters, "float32")
    loop = with_native_loop(llm)
    runner = llm.engine.executor.runner
    seqs = prompts(2)
    decode = [ScheduledRequest(f"r{i}", [p[-1]], len(p), list(range(8 * i, 8 * i + 8)), True,
                               SamplingParams(temperature=0.0)) for i, p in enumerate(seqs)]
    try:
        with torch.inference_mode():
            ids, positions, meta, _, _ = runner.prepare_inputs(decode)
            caches = [k.clone() for k, _ in runner.kv_caches]
            for bad, message in ((torch.tensor([0, 10_000]), "not registered"),
                                 (torch.tensor([2**62, 0]), "not registered"),  # no table of 2^62 entries
                                 (torch.tensor([-1]), r"lora_ids must be contiguous \[num_tokens 2\]"),
                                 (torch.tensor([0.0, 1.0]), "int64")):
                with pytest.raises(ValueError, match=message):
                    loop.run(ids, positions, meta, bad)
            assert all(torch.equal(k, c) for (k, _), c in zip(runner.kv_caches, caches))  # nothing written
    finally:
        llm.engine.shutdown()

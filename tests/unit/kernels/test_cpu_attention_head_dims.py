"""The native attention's build holds what the engines of its process named before it
loaded: loops unrolled for their head dims (each costs ~10 s of g++ on a cold start; any
other head dim runs the generic loops, which compute the same function) and kernels for
their (query, cache) dtype pairs (any other pair takes the torch path)."""
from __future__ import annotations

import pytest
import torch

from common.engine.config import ModelConfig, SpeculativeConfig
from common.engine.model_files import load_hf_config
from common.engine.model_runner import attention_head_dims
from kernels.cpu_attention import (
    DTYPE_PAIRS,
    DTYPES_ENV,
    HEAD_DIMS_ENV,
    SPECIALISED_HEAD_DIMS,
    _parse_choice,
    dtype_pair,
)
from tests.support.fresh_process import run_python


def head_dims(value: str, preferred: set[int], monkeypatch) -> tuple[int, ...]:
    monkeypatch.setenv(HEAD_DIMS_ENV, value)
    return _parse_choice(HEAD_DIMS_ENV, preferred, SPECIALISED_HEAD_DIMS, int)


def dtype_pairs(value: str, preferred: set[str], monkeypatch) -> tuple[str, ...]:
    monkeypatch.setenv(DTYPES_ENV, value)
    return _parse_choice(DTYPES_ENV, preferred, tuple(DTYPE_PAIRS), str)


def test_the_environment_decides_where_set_else_what_was_named_else_all(monkeypatch):
    assert head_dims("", set(), monkeypatch) == SPECIALISED_HEAD_DIMS
    assert head_dims("", {64, 16}, monkeypatch) == (64,)  # 16 has no unrolled loops: generic
    assert head_dims("", {16}, monkeypatch) == ()
    assert head_dims("all", {64}, monkeypatch) == SPECIALISED_HEAD_DIMS
    assert head_dims(" 256,64 ", {128}, monkeypatch) == (64, 256)
    for bad in ("96", "64;128", "sixty-four"):
        with pytest.raises(ValueError, match=f"{HEAD_DIMS_ENV} must be 'all' or a comma-separated list of "
                                             "64, 128, 256, got"):
            head_dims(bad, set(), monkeypatch)
    assert dtype_pairs("", set(), monkeypatch) == tuple(DTYPE_PAIRS)
    assert dtype_pairs("", {"bfloat16"}, monkeypatch) == ("bfloat16",)
    assert dtype_pairs("BFloat16, float32/fp8", set(), monkeypatch) == ("float32/fp8", "bfloat16")
    with pytest.raises(ValueError, match=f"{DTYPES_ENV} must be 'all' or a comma-separated list of float32, "
                                         "float32/fp8, bfloat16, bfloat16/fp8, float16, got 'bf16'"):
        dtype_pairs("bf16", set(), monkeypatch)


def test_a_dtype_pair_is_named_by_the_query_dtype_and_fp8_caches():
    assert dtype_pair(torch.bfloat16, torch.bfloat16) == "bfloat16"
    assert dtype_pair(torch.float32, torch.float8_e5m2) == "float32/fp8"
    assert dtype_pair(torch.bfloat16, torch.float8_e4m3fn) == "bfloat16/fp8"
    assert dtype_pair(torch.float16, torch.float16) == "float16"
    assert set(DTYPE_PAIRS) == {"float32", "float32/fp8", "bfloat16", "bfloat16/fp8", "float16"}


def test_an_engine_names_its_models_head_dims_a_draft_models_too(tiny_model_factory, bundled_model_dir):
    target = ModelConfig.from_hf_config(load_hf_config(bundled_model_dir))
    assert attention_head_dims(target, None) == [64]
    assert attention_head_dims(target, SpeculativeConfig(method="ngram", num_speculative_tokens=2)) == [64]
    draft_dir = tiny_model_factory("tiny-llama-head-dim-128", "llama", hidden_size=256, num_attention_heads=2,
                                   num_key_value_heads=1)
    draft = SpeculativeConfig(method="draft_model", num_speculative_tokens=2, draft_model=str(draft_dir))
    assert attention_head_dims(target, draft) == [64, 128]


# A fresh process: the suite's own processes hold the build of everything.
NAMED_BUILD = """
import logging, torch
logging.basicConfig(level=logging.INFO)
from kernels.cpu_attention import (prefer_build, native_attention_available, native_attention_serves,
                                   prefill_attention_native)
from kernels.attention import prefill_attention
prefer_build([64, 16], ["bfloat16"])
assert native_attention_available()
assert list(torch.ops.pdserve_cpu.specialised_head_dims()) == [64], torch.ops.pdserve_cpu.specialised_head_dims()
assert list(torch.ops.pdserve_cpu.dtype_pairs()) == ["bfloat16"], torch.ops.pdserve_cpu.dtype_pairs()
assert native_attention_serves(torch.bfloat16, torch.bfloat16)
assert not native_attention_serves(torch.float32, torch.float32)
prefer_build([128], ["float32"])  # too late for the build: logged; 128 runs the generic loops, float32 torch's
gen = torch.Generator().manual_seed(0)
for head_dim, dtype in [(64, torch.bfloat16), (128, torch.bfloat16), (16, torch.bfloat16), (64, torch.float32)]:
    num_blocks, block_size, kv_heads, q_heads = 6, 16, 2, 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    block_tables = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([40, 20], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 24, 25], dtype=torch.int32)  # a prompt's chunk and a decode token
    q = torch.randn(25, q_heads, head_dim, generator=gen).to(dtype)
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, head_dim ** -0.5)
    reference = prefill_attention(*args, backend="torch").float()
    chosen = prefill_attention(*args).float()  # the default backend: native where the build serves it
    if dtype == torch.float32:
        assert torch.equal(chosen, reference)  # the torch path itself
        try:
            prefill_attention_native(*args)
        except ValueError as e:
            assert "has no kernel for Float queries over Float caches (PDSERVE_ATTENTION_DTYPES=all" in str(e), e
        else:
            raise AssertionError("the native kernel took a dtype pair its build lacks")
        continue
    native = prefill_attention_native(*args).float()
    assert torch.equal(chosen, native)
    err = ((native - reference).abs().max() / reference.abs().max()).item()
    assert err < 2e-2, (head_dim, dtype, err)
print("ok")
"""


def test_a_build_named_for_head_dim_64_and_bf16_holds_those_and_serves_the_rest():
    done = run_python(NAMED_BUILD, timeout_s=300, unset=(HEAD_DIMS_ENV, DTYPES_ENV))
    assert "ok" in done.stdout, done.stdout + done.stderr
    assert ("loops unrolled for head_dim 64 (others run the generic loops); kernels for bfloat16 queries"
            in done.stderr), done.stderr
    assert "built before head_dim 128 was named: those run its generic loops" in done.stderr
    assert "built before float32 was named: those take the torch path" in done.stderr

"""The native attention's build unrolls its loops for the head dims an engine names before
the library loads (each costs ~10 s of g++ on a cold start); any other head dim runs the
generic loops, which compute the same function."""
from __future__ import annotations

import pytest

from common.engine.config import ModelConfig, SpeculativeConfig
from common.engine.model_files import load_hf_config
from common.engine.model_runner import attention_head_dims
from kernels.cpu_attention import HEAD_DIMS_ENV, SPECIALISED_HEAD_DIMS, _parse_head_dims
from tests.support.fresh_process import run_python


def test_the_environment_decides_where_set_else_the_named_dims_else_all():
    assert _parse_head_dims("", set()) == SPECIALISED_HEAD_DIMS
    assert _parse_head_dims("", {64, 16}) == (64,)  # 16 has no unrolled loops: generic
    assert _parse_head_dims("", {16}) == ()
    assert _parse_head_dims("all", {64}) == SPECIALISED_HEAD_DIMS
    assert _parse_head_dims(" 256,64 ", {128}) == (64, 256)
    for bad in ("96", "64;128", "sixty-four"):
        with pytest.raises(ValueError, match=f"{HEAD_DIMS_ENV} must be 'all' or a comma-separated list of "
                                             "64, 128, 256, got"):
            _parse_head_dims(bad, set())


def test_an_engine_names_its_models_head_dims_a_draft_models_too(tiny_model_factory, bundled_model_dir):
    target = ModelConfig.from_hf_config(load_hf_config(bundled_model_dir))
    assert attention_head_dims(target, None) == [64]
    assert attention_head_dims(target, SpeculativeConfig(method="ngram", num_speculative_tokens=2)) == [64]
    draft_dir = tiny_model_factory("tiny-llama-head-dim-128", "llama", hidden_size=256, num_attention_heads=2,
                                   num_key_value_heads=1)
    draft = SpeculativeConfig(method="draft_model", num_speculative_tokens=2, draft_model=str(draft_dir))
    assert attention_head_dims(target, draft) == [64, 128]


# A fresh process: the suite's own processes hold the build of every head dim.
HEAD_DIM_64_BUILD = """
import logging, torch
logging.basicConfig(level=logging.INFO)
from kernels.cpu_attention import prefer_head_dims, native_attention_available, prefill_attention_native
from kernels.attention import prefill_attention
prefer_head_dims([64, 16])
assert native_attention_available()
assert list(torch.ops.pdserve_cpu.specialised_head_dims()) == [64], torch.ops.pdserve_cpu.specialised_head_dims()
prefer_head_dims([128])  # too late for the build: logged, and 128 runs the generic loops
gen = torch.Generator().manual_seed(0)
for head_dim, dtype in [(64, torch.float32), (128, torch.float32), (16, torch.float32),
                        (64, torch.bfloat16), (128, torch.bfloat16)]:
    num_blocks, block_size, kv_heads, q_heads = 6, 16, 2, 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    block_tables = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([40, 20], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 24, 25], dtype=torch.int32)  # a prompt's chunk and a decode token
    q = torch.randn(25, q_heads, head_dim, generator=gen).to(dtype)
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, head_dim ** -0.5)
    native = prefill_attention_native(*args).float()
    reference = prefill_attention(*args, backend="torch").float()
    err = ((native - reference).abs().max() / reference.abs().max()).item()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), (head_dim, dtype, err)
print("ok")
"""


def test_a_build_for_head_dim_64_unrolls_that_alone_and_serves_every_head_dim():
    done = run_python(HEAD_DIM_64_BUILD, timeout_s=300, unset=(HEAD_DIMS_ENV,))
    assert "ok" in done.stdout, done.stdout + done.stderr
    assert "loops unrolled for head_dim 64; others run the generic loops" in done.stderr
    assert "built before head_dim 128 was named: those run its generic loops" in done.stderr

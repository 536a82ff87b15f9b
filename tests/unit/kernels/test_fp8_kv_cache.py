"""8-bit float KV caches (kv_cache_dtype fp8_e4m3 / fp8_e5m2): the native kernel writes
torch's codes (rounded to nearest, saturated) and reads them as the torch reference does."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import decode_attention, prefill_attention
from kernels._backend import to_cache_dtype
from kernels.attention import attention_with_kv_write
from kernels.cache import write_kv_cache
from kernels.cpu_attention import native_attention_error
from tests.unit.kernels.test_kernels import make_paged, rel_err

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module", autouse=True)
def native_kernel():
    assert native_attention_error() is None, native_attention_error()


def _native_codes(values: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """values [num_tokens, num_kv_heads, head_dim] written by the native kernel into an fp8
    cache (one slot each), returned as the cache's bytes [num_tokens, num_kv_heads, head_dim]."""
    num_tokens, num_kv_heads, head_dim = values.shape
    k_cache = torch.zeros(num_tokens, 1, num_kv_heads, head_dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(num_tokens)
    lens = torch.ones(num_tokens, dtype=torch.int32)
    q = torch.zeros(num_tokens, num_kv_heads, head_dim, dtype=values.dtype)
    attention_with_kv_write(q, values, values, k_cache, v_cache, slots, slots.int()[:, None],
                            torch.arange(num_tokens + 1, dtype=torch.int32), lens, 1.0)
    assert torch.equal(k_cache.view(torch.uint8), v_cache.view(torch.uint8))
    return k_cache.view(torch.uint8)[:, 0]


@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_the_native_write_gives_torchs_codes_and_saturates(cache_dtype, dtype):
    gen = torch.Generator().manual_seed(3)
    limit = torch.finfo(cache_dtype).max
    # Every magnitude the formats have: subnormals, normals, past the largest finite, and
    # the specials; head_dim 72 takes the 16-wide path and a scalar tail.
    scales = torch.logspace(-12, 6, 9, base=2.0 ** 2)
    values = torch.randn(9, 2, 72, generator=gen) * scales[:, None, None]
    values[0, 0, :8] = torch.tensor([limit * 1.01, -limit * 3, float("inf"), -float("inf"), 0.0, -0.0,
                                     limit, -limit])
    values[0, 1, :2] = float("nan")
    values = values.to(dtype)
    codes = _native_codes(values, cache_dtype)
    expected = to_cache_dtype(values, cache_dtype)
    assert torch.equal(codes, expected.view(torch.uint8))
    widened = codes[0, 0, :4].view(cache_dtype).float()
    assert widened.tolist() == [limit, -limit, limit, -limit]  # saturated, never inf or NaN
    assert codes[0, 1, :2].view(cache_dtype).float().isnan().all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=64, max_size=64),
       st.sampled_from(FP8))
def test_every_float_rounds_to_torchs_nearest_code(floats, cache_dtype):
    values = torch.tensor(floats, dtype=torch.float32).view(1, 1, 64)
    assert torch.equal(_native_codes(values, cache_dtype), to_cache_dtype(values, cache_dtype).view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_torch_and_native_writes_store_the_same_bytes(cache_dtype, dtype):
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, num_tokens = 6, 16, 20
    key = (torch.randn(num_tokens, 2, 64, generator=gen) * 8).to(dtype)
    value = torch.randn(num_tokens, 2, 64, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[4, 9]] = -1  # padding
    caches = [torch.zeros(num_blocks, block_size, 2, 64, dtype=cache_dtype) for _ in range(4)]
    write_kv_cache(key, value, caches[0], caches[1], slots, backend="torch")
    lens = torch.ones(num_tokens, dtype=torch.int32)
    attention_with_kv_write(torch.zeros(num_tokens, 2, 64, dtype=dtype), key, value, caches[2], caches[3], slots,
                            torch.zeros(num_tokens, 1, dtype=torch.int32),
                            torch.arange(num_tokens + 1, dtype=torch.int32), lens, 1.0)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    written = caches[0].view(-1, 2, 64)[slots[slots >= 0]].float()
    assert torch.equal(written, to_cache_dtype(key[slots >= 0], cache_dtype).float())


def _fp8_paged(seq_lens, block_size, gen, cache_dtype, num_kv_heads, head_dim):
    """make_paged's cache as codes (K spread 3x wider than V, as a model's keys are)."""
    k_cache, v_cache, block_tables, _, _ = make_paged(seq_lens, block_size, gen, dtype=torch.float32,
                                                      num_kv_heads=num_kv_heads, head_dim=head_dim, device="cpu")
    return to_cache_dtype(k_cache * 3, cache_dtype), to_cache_dtype(v_cache, cache_dtype), block_tables


# (num_kv_heads, gqa ratio, block_size, head_dim): 64 and 128 take the vector specialisations
# (bf16 also the paired whole-rows form for prompts), 24 the generic loops.
GEOMETRIES = [(3, 3, 16, 64), (2, 4, 32, 128), (2, 3, 8, 24)]


@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "kv{}x{}-bs{}-d{}".format(*g))
@pytest.mark.parametrize("features", [dict(), dict(sliding_window=20, logit_softcap=5.0)],
                         ids=["plain", "window-softcap"])
def test_steps_over_fp8_caches_match_the_reference(cache_dtype, dtype, geometry, features):
    num_kv_heads, ratio, block_size, head_dim = geometry
    gen = torch.Generator().manual_seed(block_size + head_dim)
    # A fresh prompt of several 16-token tiles, a chunk with context, decodes (one long enough
    # to be split over its keys when the call has few items), an empty query.
    shapes = [(0, 45), (50, 20), (37, 1), (600, 1), (9, 0), (130, 1)]
    seq_lens = [c + n for c, n in shapes]
    k_cache, v_cache, block_tables = _fp8_paged(seq_lens, block_size, gen, cache_dtype, num_kv_heads, head_dim)
    query_lens = [n for _, n in shapes]
    q = torch.randn(sum(query_lens), num_kv_heads * ratio, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    args = (q, k_cache, v_cache, block_tables, starts, lens, head_dim ** -0.5)
    out = prefill_attention(*args, backend="native", **features)
    ref = prefill_attention(*args, backend="torch", **features)
    assert out.dtype == dtype and rel_err(out, ref) < TOLERANCE[dtype]
    # The decodes alone: two long ones on two threads are split over their keys.
    decode_ids = torch.tensor([2, 3])
    args = (q[starts[decode_ids].long()], k_cache, v_cache, block_tables[decode_ids], lens[decode_ids],
            head_dim ** -0.5)
    assert rel_err(decode_attention(*args, backend="native", **features),
                   decode_attention(*args, backend="torch", **features)) < TOLERANCE[dtype]


@pytest.mark.parametrize("cache_dtype, tolerance", [(torch.float8_e4m3fn, 0.06), (torch.float8_e5m2, 0.12)],
                         ids=FP8_IDS)
def test_attention_over_codes_stays_near_attention_over_the_values(cache_dtype, tolerance):
    # The codes' rounding (a relative 2^-4 for E4M3, 2^-3 for E5M2 at most) moves the output
    # by about that much, no more: the kernel reads what was written, nothing else.
    gen = torch.Generator().manual_seed(11)
    seq_lens = [200, 31]
    k_cache, v_cache, block_tables, _, _ = make_paged(seq_lens, 16, gen, dtype=torch.float32, num_kv_heads=2,
                                                      head_dim=64, device="cpu")
    q = torch.randn(2, 6, 64, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    exact = decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125, backend="native")
    coded = decode_attention(q, to_cache_dtype(k_cache, cache_dtype), to_cache_dtype(v_cache, cache_dtype),
                             block_tables, lens, 0.125, backend="native")
    assert 0 < rel_err(coded, exact) < tolerance


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_mismatched_dtypes_are_refused(backend):
    k_cache = torch.zeros(2, 16, 1, 64, dtype=torch.float8_e4m3fn)
    block_tables = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="fp8 codes"):  # fp16 models keep fp16 caches
        decode_attention(torch.zeros(1, 2, 64, dtype=torch.float16), k_cache, k_cache, block_tables, lens, 1.0,
                         backend=backend)
    with pytest.raises(ValueError, match="dtype mismatch"):
        decode_attention(torch.zeros(1, 2, 64), k_cache, k_cache.view(torch.float8_e5m2), block_tables, lens, 1.0,
                         backend=backend)
    with pytest.raises(ValueError, match="fp8 codes"):
        write_kv_cache(torch.zeros(1, 1, 64, dtype=torch.float16), torch.zeros(1, 1, 64, dtype=torch.float16),
                       k_cache, k_cache.clone(), torch.zeros(1, dtype=torch.int64))


def test_the_native_op_refuses_an_fp16_query_over_fp8_caches():
    k_cache = torch.zeros(2, 16, 1, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8 codes for float32 and bfloat16"):
        torch.ops.pdserve_cpu.paged_attention(torch.zeros(1, 2, 64, dtype=torch.float16), k_cache, k_cache,
                                              torch.zeros(1, 1, dtype=torch.int32),
                                              torch.arange(2, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                              1.0, 0, 0.0)

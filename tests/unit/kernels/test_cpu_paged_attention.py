"""The native CPU paged-attention kernel against the torch reference (kernels/torch_attention.py).

Tolerances (max |a - b| / max |b|): fp32 1e-5; bf16 1e-2 (both paths sum in fp32 and round
the output to bf16 once; the native prefill tiles, vector or AMX (kernels/cpu/attention_amx.h,
on CPUs with AMX), also round P to bf16 for P.V, as flash attention does on GPUs: a relative
2^-9 per probability).
The library is built once per machine into the kernel cache (kernels/cpu/build.py) and
loaded once per process; only the fallback test builds, in a subprocess with no compiler.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kernels import attention as attention_module
from kernels import decode_attention, prefill_attention
from kernels.attention import attention_with_kv_write
from kernels.cache import write_kv_cache
from kernels.cpu import build
from kernels.cpu_attention import cpu_attention_backend, native_attention_error
from tests.support.cpu_targets import avx2_build_environment
from tests.support.fresh_process import run_python_ok
from tests.support.paths import REPO_ROOT
from tests.unit.kernels.test_kernels import make_paged, rel_err

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
FEATURES = [dict(), dict(sliding_window=7), dict(logit_softcap=5.0), dict(sliding_window=20, logit_softcap=1.0)]
# (num_kv_heads, gqa ratio, block_size, head_dim); head_dims 64/128/256 take the kernel's
# vector-register specialisations, 24 its generic loops.
GEOMETRIES = [(2, 1, 16, 64), (3, 3, 32, 64), (2, 4, 16, 128), (1, 3, 32, 128), (1, 2, 16, 256), (2, 3, 8, 24)]


@pytest.fixture(scope="module", autouse=True)
def native_kernel():
    assert native_attention_error() is None, native_attention_error()


def _ids(param):
    return "-".join(f"{k}={v}" for k, v in param.items()) or "plain"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "kv{}x{}-bs{}-d{}".format(*g))
@pytest.mark.parametrize("features", FEATURES, ids=_ids)
def test_decode_matches_reference(dtype, geometry, features):
    num_kv_heads, ratio, block_size, head_dim = geometry
    gen = torch.Generator().manual_seed(block_size + head_dim + ratio)
    # Lengths off and on block boundaries, a single token, padding (0), one long context.
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 0, 77, 300]
    k_cache, v_cache, block_tables, _, _ = make_paged(seq_lens, block_size, gen, device="cpu", dtype=dtype,
                                                      num_kv_heads=num_kv_heads, head_dim=head_dim)
    q = torch.randn(len(seq_lens), num_kv_heads * ratio, head_dim, generator=gen).to(dtype)
    args = (q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), head_dim ** -0.5)
    out = decode_attention(*args, backend="native", **features)
    ref = decode_attention(*args, backend="torch", **features)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "kv{}x{}-bs{}-d{}".format(*g))
@pytest.mark.parametrize("features", FEATURES, ids=_ids)
def test_mixed_prefill_decode_step_matches_reference(dtype, geometry, features):
    num_kv_heads, ratio, block_size, head_dim = geometry
    gen = torch.Generator().manual_seed(7 * block_size + head_dim + ratio)
    # (context_len, query_len): a fresh prompt, chunks with context (one spanning several
    # 16-token query tiles), decode rows, an empty query.
    shapes = [(0, 45), (50, 20), (37, 1), (0, 1), (3, 40), (9, 0), (130, 1), (block_size, block_size)]
    seq_lens = [c + n for c, n in shapes]
    k_cache, v_cache, block_tables, _, _ = make_paged(seq_lens, block_size, gen, device="cpu", dtype=dtype,
                                                      num_kv_heads=num_kv_heads, head_dim=head_dim)
    query_lens = [n for _, n in shapes]
    num_padding = 3  # rows past query_start_loc[-1]
    q = torch.randn(sum(query_lens) + num_padding, num_kv_heads * ratio, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    args = (q, k_cache, v_cache, block_tables, query_start_loc, torch.tensor(seq_lens, dtype=torch.int32),
            head_dim ** -0.5)
    out = prefill_attention(*args, backend="native", **features)
    ref = prefill_attention(*args, backend="torch", **features)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out[-num_padding:], torch.zeros_like(out[-num_padding:]))
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("features", [dict(), dict(logit_softcap=5.0), dict(sliding_window=1500)], ids=_ids)
@pytest.mark.parametrize("context", [1990, 16350], ids=["amx-limit", "vector-limit"])
def test_prefill_tiles_either_side_of_the_whole_rows_limit_match_reference(features, context, dtype):
    # With AVX512-BF16 a bf16 prefill tile of 48 rows (16 tokens x 3 query heads) whose keys
    # fit 2,048 (on AMX tiles) or 16,384 (on the vector dot products: whole_rows_max_scores) is
    # scored over all of them at once, one softmax per row; past that, a chunk of that many
    # keys at a time. The chunk's tiles (positions context to context + 63) lie on both sides
    # of one limit; the window brings every tile under it. fp32 tiles take their whole-rows
    # form up to 16,384 keys, block by block past it, their P.V a range of keys at a time
    # across the row groups.
    gen = torch.Generator().manual_seed(5)
    shapes = [(context, 64), (0, 40)]
    seq_lens = [c + n for c, n in shapes]
    k_cache, v_cache, block_tables, _, _ = make_paged(seq_lens, 16, gen, device="cpu", dtype=dtype,
                                                      num_kv_heads=3, head_dim=64)
    query_lens = [n for _, n in shapes]
    q = torch.randn(sum(query_lens), 9, 64, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    args = (q, k_cache, v_cache, block_tables, query_start_loc, torch.tensor(seq_lens, dtype=torch.int32), 0.125)
    out = prefill_attention(*args, backend="native", **features)
    ref = prefill_attention(*args, backend="torch", **features)
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("features", [dict(), dict(logit_softcap=30.0)], ids=_ids)
@pytest.mark.parametrize("context", [5000, 16500], ids=["amx-chunks", "vector-chunks"])
def test_prefill_tiles_whose_later_keys_score_higher_match_reference(features, context):
    # A bf16 tile past the whole-rows limit takes its keys a chunk at a time (2,048 keys on
    # AMX tiles, 16,384 on the vector dot products): each row's sums and accumulators so far
    # scale down where a later chunk holds a higher score. Here every key scores higher than
    # the keys before it (K grows along the queries' one direction), so every chunk rescales
    # every row, by ~e^-4 a chunk of 2,048 keys.
    gen = torch.Generator().manual_seed(11)
    num_kv_heads, ratio, head_dim, block_size, query_len = 3, 3, 64, 16, 40
    seq_len = context + query_len
    k_cache, v_cache, block_tables, _, _ = make_paged([seq_len], block_size, gen, device="cpu",
                                                      dtype=torch.bfloat16, num_kv_heads=num_kv_heads,
                                                      head_dim=head_dim)
    direction = torch.randn(num_kv_heads, head_dim, generator=gen)  # [num_kv_heads, head_dim]
    growth = torch.arange(seq_len, dtype=torch.float32) / 4096  # [seq_len]
    keys = growth[:, None, None] * direction + 0.3 * torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    positions = torch.arange(seq_len)
    slots = block_tables[0, positions // block_size].long() * block_size + positions % block_size
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = keys.to(torch.bfloat16)
    q = direction.repeat_interleave(ratio, dim=0).expand(query_len, -1, -1).to(torch.bfloat16)  # [query_len, 9, 64]
    args = (q.contiguous(), k_cache, v_cache, block_tables, torch.tensor([0, query_len], dtype=torch.int32),
            torch.tensor([seq_len], dtype=torch.int32), 0.125)
    out = prefill_attention(*args, backend="native", **features)
    ref = prefill_attention(*args, backend="torch", **features)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("context", [21, 100])
@pytest.mark.parametrize("features", [dict(), dict(sliding_window=20), dict(logit_softcap=5.0)], ids=_ids)
@pytest.mark.parametrize("geometry", [(3, 3, 16, 64), (2, 2, 32, 128), (3, 3, 32, 64), (2, 2, 16, 128), (2, 2, 32, 64),
                                      (1, 3, 16, 128), (1, 3, 128, 64)], ids=lambda g: "kv{}x{}-bs{}-d{}".format(*g))
def test_a_prompt_in_one_call_gives_the_bits_of_its_16_token_tiles_one_call_each(features, geometry, context, dtype):
    # A call prepares once the keys of a sequence with several 16-token query tiles (bf16 with
    # AVX512-BF16 pairs them, fp32 transposes them in spans of 64 or 16 keys), where each tile
    # of a short query prepares its own: the tiles' results must not change by a bit. The keys
    # past each tile (written, not seen) and the slots past the sequence (garbage) are in the
    # blocks the tiles read; with blocks of 128 keys a sequence of 145 has more whole-block
    # spans (4) than its keys fill (3).
    num_kv_heads, ratio, block_size, head_dim = geometry
    gen = torch.Generator().manual_seed(3 + head_dim + context)
    query_len = 45
    seq_len = context + query_len
    k_cache, v_cache, block_tables, _, _ = make_paged([seq_len], block_size, gen, device="cpu", dtype=dtype,
                                                      num_kv_heads=num_kv_heads, head_dim=head_dim)
    q = torch.randn(query_len, num_kv_heads * ratio, head_dim, generator=gen).to(dtype)

    def attend(first, last):  # query tokens [first, last) of the prompt, in one call
        return prefill_attention(q[first:last], k_cache, v_cache, block_tables,
                                 torch.tensor([0, last - first], dtype=torch.int32),
                                 torch.tensor([context + last], dtype=torch.int32), head_dim ** -0.5,
                                 backend="native", **features)

    whole = attend(0, query_len)
    tiles = torch.cat([attend(first, min(first + 16, query_len)) for first in range(0, query_len, 16)])
    assert torch.equal(whole, tiles)
    ref = prefill_attention(q, k_cache, v_cache, block_tables, torch.tensor([0, query_len], dtype=torch.int32),
                            torch.tensor([seq_len], dtype=torch.int32), head_dim ** -0.5, backend="torch", **features)
    assert rel_err(whole, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("features", FEATURES, ids=_ids)
def test_few_long_decodes_split_over_keys_match_reference(dtype, features):
    # Fewer (sequence, kv head) items than 2 per thread: long decode tokens are split over
    # their keys and merged (flash-decoding). 8 threads force it on any machine.
    gen = torch.Generator().manual_seed(21)
    seq_lens = [1000, 300, 2000, 513]
    k_cache, v_cache, block_tables, _, _ = make_paged(seq_lens, 16, gen, device="cpu", dtype=dtype, num_kv_heads=3,
                                                      head_dim=64)
    q = torch.randn(len(seq_lens), 9, 64, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    threads = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        out = decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125, backend="native", **features)
        # The same tokens as decode rows of a prefill call, after one 5-token chunk.
        starts = torch.tensor([0, 5, 6, 7, 8], dtype=torch.int32)
        q_mixed = torch.cat([torch.randn(4, 9, 64, generator=gen).to(dtype), q])
        mixed = prefill_attention(q_mixed, k_cache, v_cache, block_tables, starts, lens, 0.125, backend="native",
                                  **features)
    finally:
        torch.set_num_threads(threads)
    ref = decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125, backend="torch", **features)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert rel_err(mixed[5:], ref[1:]) < TOLERANCE[dtype]
    ref_mixed = prefill_attention(q_mixed, k_cache, v_cache, block_tables, starts, lens, 0.125, backend="torch",
                                  **features)
    assert rel_err(mixed, ref_mixed) < TOLERANCE[dtype]


@pytest.mark.parametrize("geometry", [(3, 3, 16, 64), (2, 4, 16, 128), (8, 4, 16, 64), (2, 1, 32, 64)],
                         ids=lambda g: "kv{}x{}-bs{}-d{}".format(*g))
@pytest.mark.parametrize("features", FEATURES, ids=_ids)
def test_fp32_decode_tokens_get_the_same_bits_every_head_at_once_as_head_by_head(geometry, features):
    # A call with at least two items a thread gives each thread whole items, and an fp32
    # decode token's items take every kv head in one pass over its blocks
    # (attend_token_all_heads); a sequence alone on one thread is one item per kv head.
    # The sums are the same in the same order, so the bits must be too.
    num_kv_heads, ratio, block_size, head_dim = geometry
    gen = torch.Generator().manual_seed(31 + num_kv_heads + head_dim)
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 77, 300, 1000]
    k_cache, v_cache, block_tables, _, _ = make_paged(seq_lens, block_size, gen, device="cpu",
                                                      num_kv_heads=num_kv_heads, head_dim=head_dim)
    q = torch.randn(len(seq_lens), num_kv_heads * ratio, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        together = decode_attention(q, k_cache, v_cache, block_tables, lens, head_dim ** -0.5, backend="native",
                                    **features)
        alone = torch.cat([decode_attention(q[i:i + 1], k_cache, v_cache, block_tables[i:i + 1], lens[i:i + 1],
                                            head_dim ** -0.5, backend="native", **features)
                           for i in range(len(seq_lens))])
        torch.set_num_threads(2)
        on_two = decode_attention(q, k_cache, v_cache, block_tables, lens, head_dim ** -0.5, backend="native",
                                  **features)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)
    assert torch.equal(on_two, alone)
    ref = decode_attention(q, k_cache, v_cache, block_tables, lens, head_dim ** -0.5, backend="torch", **features)
    assert rel_err(together, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_step_gives_the_same_bits_on_several_threads_as_on_one(dtype):
    # Prompts (whose keys a call pairs once, over the threads, in bf16 with AVX512-BF16),
    # a chunk with context and decode rows: work items go to whichever thread claims them
    # and each reads what the call prepared, so the bits may not depend on the threads.
    gen = torch.Generator().manual_seed(23)
    shapes = [(0, 300), (40, 70), (500, 1), (0, 1), (130, 33)]  # (context_len, query_len)
    seq_lens = [c + n for c, n in shapes]
    k_cache, v_cache, block_tables, _, _ = make_paged(seq_lens, 16, gen, device="cpu", dtype=dtype, num_kv_heads=3,
                                                      head_dim=64)
    query_lens = [n for _, n in shapes]
    q = torch.randn(sum(query_lens), 9, 64, generator=gen).to(dtype)
    starts = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    args = (q, k_cache, v_cache, block_tables, starts, torch.tensor(seq_lens, dtype=torch.int32), 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = prefill_attention(*args, backend="native")
        torch.set_num_threads(3)
        several = prefill_attention(*args, backend="native")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(several, one)
    assert rel_err(one, prefill_attention(*args, backend="torch")) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("geometry", [(3, 3, 16, 64), (1, 3, 32, 128), (2, 2, 8, 64)],
                         ids=lambda g: "kv{}x{}-bs{}-d{}".format(*g))
def test_cache_slots_past_the_sequences_are_never_read(dtype, geometry):
    # A block's slots past its sequence's length hold whatever an earlier request left,
    # NaN bits included: a masked probability times such a V (0 x NaN) must not reach the
    # output. Every slot no sequence owns is NaN here; the answer is the clean cache's.
    num_kv_heads, ratio, block_size, head_dim = geometry
    gen = torch.Generator().manual_seed(11 + block_size)
    shapes = [(0, 45), (50, 20), (37, 1), (3, 40), (130, 1), (block_size + 1, block_size + 3)]
    seq_lens = [c + n for c, n in shapes]
    k_cache, v_cache, block_tables, _, _ = make_paged(seq_lens, block_size, gen, device="cpu", dtype=dtype,
                                                      num_kv_heads=num_kv_heads, head_dim=head_dim)
    owned = torch.zeros(k_cache.shape[0], block_size, dtype=torch.bool)  # [num_blocks, block_size]
    for i, seq_len in enumerate(seq_lens):
        for position in range(seq_len):
            owned[block_tables[i, position // block_size], position % block_size] = True
    assert not owned.all()
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    poisoned_k[~owned] = float("nan")
    poisoned_v[~owned] = float("nan")
    query_lens = [n for _, n in shapes]
    q = torch.randn(sum(query_lens), num_kv_heads * ratio, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = prefill_attention(q, poisoned_k, poisoned_v, block_tables, query_start_loc, lens, head_dim ** -0.5,
                            backend="native")
    ref = prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, lens, head_dim ** -0.5,
                            backend="torch")
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOLERANCE[dtype]


def test_prefill_without_context_fp16_and_strided_views():
    # Whole prompts only (the reference's plain causal path), with K and V as views of one
    # [num_blocks, 2, ...] tensor and q sliced out of a wider projection; fp16 as well.
    gen = torch.Generator().manual_seed(11)
    num_kv_heads, num_q_heads, head_dim, block_size = 2, 8, 64, 16
    seq_lens = [33, 16, 5]
    k_cache, v_cache, block_tables, _, _ = make_paged(seq_lens, block_size, gen, device="cpu",
                                                      num_kv_heads=num_kv_heads, head_dim=head_dim)
    kv = torch.stack([k_cache, v_cache], dim=1)  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    num_tokens = sum(seq_lens)
    q = torch.randn(num_tokens, num_q_heads * head_dim + 8, generator=gen)[:, 8:].view(
        num_tokens, num_q_heads, head_dim)
    query_start_loc = torch.tensor([0, 33, 49, 54], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        args = (q.to(dtype), kv[:, 0].to(dtype), kv[:, 1].to(dtype), block_tables, query_start_loc, lens, 0.125)
        out = prefill_attention(*args, backend="native")
        assert rel_err(out, prefill_attention(*args, backend="torch")) < tolerance
    out = prefill_attention(q, kv[:, 0], kv[:, 1], block_tables, query_start_loc, lens, 0.125, backend="native")
    ref = prefill_attention(q.contiguous(), k_cache, v_cache, block_tables, query_start_loc, lens, 0.125,
                            backend="torch")
    assert rel_err(out, ref) < 1e-5


def test_rows_no_sequence_covers_are_zeros_whatever_the_memory_held():
    # A padding sequence (seq_len 0 with queries) in the middle, rows before the first query
    # and past the last: all zeros, while the real sequences match the reference. Repeated
    # so that a freshly allocated output reuses memory an earlier one filled.
    gen = torch.Generator().manual_seed(21)
    k_cache, v_cache, block_tables, _, _ = make_paged([9, 1, 20], 16, gen, device="cpu")
    q = torch.randn(12, 6, 32, generator=gen)
    query_start_loc = torch.tensor([2, 5, 7, 10], dtype=torch.int32)  # rows 0-1 and 10-11 uncovered
    lens = torch.tensor([9, 0, 20], dtype=torch.int32)  # sequence 1 (rows 5-6) is padding
    for _ in range(3):
        prefill_attention(torch.full((12, 6, 32), float("nan")), k_cache, v_cache, block_tables, query_start_loc,
                          torch.tensor([9, 2, 20], dtype=torch.int32), 0.1, backend="native")
        out = prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, lens, 0.1, backend="native")
        for rows in (slice(0, 2), slice(5, 7), slice(10, 12)):
            assert torch.equal(out[rows], torch.zeros_like(out[rows]))
        # The torch path refuses padding; sequence 1's length does not touch the others' rows.
        ref = prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                torch.tensor([9, 2, 20], dtype=torch.int32), 0.1, backend="torch")
        for rows in (slice(2, 5), slice(7, 10)):
            assert rel_err(out[rows], ref[rows]) < 1e-5


def test_bad_block_table_entry_raises_instead_of_reading_outside_the_cache():
    gen = torch.Generator().manual_seed(12)
    k_cache, v_cache, block_tables, _, _ = make_paged([20], 16, gen, device="cpu")
    num_blocks = k_cache.shape[0]
    block_tables[0, 1] = num_blocks  # within the sequence's 2 blocks
    q = torch.randn(1, 6, 32, generator=gen)
    with pytest.raises(ValueError, match=f"block table entry {num_blocks} of sequence 0 is outside the cache's "
                                         f"{num_blocks} blocks"):
        decode_attention(q, k_cache, v_cache, block_tables, torch.tensor([20], dtype=torch.int32), 0.1,
                         backend="native")


def test_opaque_to_torch_compile():
    gen = torch.Generator().manual_seed(13)
    k_cache, v_cache, block_tables, _, _ = make_paged([9, 40], 16, gen, device="cpu")
    q = torch.randn(2, 6, 32, generator=gen)
    lens = torch.tensor([9, 40], dtype=torch.int32)
    query_start_loc = torch.arange(3, dtype=torch.int32)
    args = (q, k_cache, v_cache, block_tables, query_start_loc, lens, 0.2, 0, 0.0)
    torch.library.opcheck(torch.ops.pdserve_cpu.paged_attention.default, args)

    def layer(q):
        return torch.ops.pdserve_cpu.paged_attention(q * 2, *args[1:]) + 1

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert rel_err(compiled(q), layer(q)) < 1e-6

    # The public entry points trace whole too, the CPU dispatch decided while tracing.
    def public(q, backend):
        return prefill_attention(q * 2, k_cache, v_cache, block_tables, query_start_loc, lens, 0.2,
                                 backend=backend) + 1

    for backend in (None, "native"):
        compiled = torch.compile(public, backend="aot_eager", fullgraph=True)
        assert rel_err(compiled(q, backend), layer(q)) < 1e-6


def test_dispatch_prefers_native_on_cpu_unless_told(monkeypatch):
    calls = []
    monkeypatch.setattr(attention_module, "decode_attention_native", lambda *a, **k: calls.append(a) or a[0])
    gen = torch.Generator().manual_seed(14)
    k_cache, v_cache, block_tables, _, _ = make_paged([5], 16, gen, device="cpu")
    args = (torch.randn(1, 6, 32, generator=gen), k_cache, v_cache, block_tables,
            torch.tensor([5], dtype=torch.int32), 0.1)
    monkeypatch.delenv("PDSERVE_CPU_ATTENTION", raising=False)
    decode_attention(*args, sliding_window=3)
    assert len(calls) == 1
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "torch")
    decode_attention(*args)
    assert len(calls) == 1 and cpu_attention_backend() == "torch"
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "native")
    decode_attention(*args)
    assert len(calls) == 2
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "fast")
    with pytest.raises(ValueError, match="PDSERVE_CPU_ATTENTION"):
        decode_attention(*args)


def test_built_library_is_reused_from_the_cache(monkeypatch):
    def no_compiling(*args, **kwargs):
        raise AssertionError("rebuilt a cached library")

    monkeypatch.setattr(build.subprocess, "run", no_compiling)
    assert build.build_library("paged_attention").exists()


def test_another_virtualenv_with_the_same_torch_reuses_the_build(monkeypatch):
    # A fresh clone's .venv puts torch's headers and libraries elsewhere: same build.
    built = build.build_library("paged_attention")

    def no_compiling(*args, **kwargs):
        raise AssertionError("rebuilt for another install path of the same torch")

    monkeypatch.setattr(build.subprocess, "run", no_compiling)
    monkeypatch.setattr(build.cpp_extension, "include_paths", lambda *a, **k: ["/elsewhere/include"])
    monkeypatch.setattr(build.cpp_extension, "library_paths", lambda *a, **k: ["/elsewhere/lib"])
    assert build.build_library("paged_attention") == built
    # A different compiler (or g++ upgraded in place) is a different build.
    monkeypatch.setattr(build, "compiler_identity", lambda cxx: "/usr/bin/g++-99 1 1")
    with pytest.raises(AssertionError, match="rebuilt"):
        build.build_library("paged_attention")


def test_missing_compiler_raises_build_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(build.BuildError, match="no C\\+\\+ compiler"):
        build.build_library("paged_attention")


_AVX2_SCRIPT = textwrap.dedent("""
    import torch
    from kernels import decode_attention, prefill_attention
    from kernels.cpu_attention import native_attention_error
    from tests.unit.kernels.test_kernels import make_paged, rel_err
    assert native_attention_error() is None, native_attention_error()
    gen = torch.Generator().manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for head_dim in (64, 128):
            seq_lens = [1, 17, 90, 40]
            k_cache, v_cache, block_tables, _, _ = make_paged(seq_lens, 16, gen, device="cpu", dtype=dtype,
                                                              num_kv_heads=2, head_dim=head_dim)
            lens = torch.tensor(seq_lens, dtype=torch.int32)
            q = torch.randn(4, 8, head_dim, generator=gen).to(dtype)
            for features in ({}, {"sliding_window": 9, "logit_softcap": 3.0}):
                args = (q, k_cache, v_cache, block_tables, lens, 0.1)
                assert rel_err(decode_attention(*args, backend="native", **features),
                               decode_attention(*args, backend="torch", **features)) < tolerance
                q_prefill = torch.randn(1 + 17 + 30 + 40, 8, head_dim, generator=gen).to(dtype)
                starts = torch.tensor([0, 1, 18, 48, 88], dtype=torch.int32)
                args = (q_prefill, k_cache, v_cache, block_tables, starts, lens, 0.1)
                assert rel_err(prefill_attention(*args, backend="native", **features),
                               prefill_attention(*args, backend="torch", **features)) < tolerance
            # fp8 caches: the codes written and read one at a time, as without AVX-512.
            from kernels._backend import to_cache_dtype
            from kernels.attention import attention_with_kv_write
            for cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                codes = [to_cache_dtype(c * 3, cache_dtype) for c in (k_cache, v_cache)]
                args = (q, *codes, block_tables, lens, 0.1)
                assert rel_err(decode_attention(*args, backend="native"),
                               decode_attention(*args, backend="torch")) < tolerance
                new = (torch.randn(4, 2, head_dim, generator=gen) * 300).to(dtype)
                slots = torch.tensor([0, 5, 17, 40])
                attention_with_kv_write(q, new, new, *codes, slots, block_tables, torch.arange(5, dtype=torch.int32),
                                        lens, 0.1)
                assert torch.equal(codes[0].view(-1, 2, head_dim)[slots].view(torch.uint8),
                                   to_cache_dtype(new, cache_dtype).view(torch.uint8))
    print("ok")
""")


def test_avx2_build_matches_reference():
    # The kernel's 8-lane (AVX2) vectors, as on machines without AVX-512: where this CPU has
    # AVX-512, built once per machine for x86-64-v3 into the usual kernel cache (the target
    # is part of the library's key); elsewhere its own build is that one.
    run_python_ok(_AVX2_SCRIPT, timeout_s=280, **avx2_build_environment())


_FALLBACK_SCRIPT = textwrap.dedent("""
    import logging, torch
    from kernels import decode_attention
    from kernels.cpu_attention import cpu_attention_backend
    logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
    k_cache = torch.randn(4, 16, 2, 32)
    args = (torch.randn(2, 6, 32), k_cache, k_cache.clone(), torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
            torch.tensor([20, 7], dtype=torch.int32), 0.1)
    for _ in range(3):
        out = decode_attention(*args)
    assert torch.equal(out, decode_attention(*args, backend="torch"))
    print("backend", cpu_attention_backend())
""")


@pytest.mark.parametrize("mode", ["auto", "native"])
def test_falls_back_to_torch_with_one_log_line_without_a_compiler(tmp_path, mode):
    env = dict(os.environ, CXX=str(tmp_path / "no-such-g++"), PDSERVE_KERNEL_CACHE=str(tmp_path / "cache"),
               PDSERVE_CPU_ATTENTION=mode, PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    output = done.stdout + done.stderr
    log_lines = [line for line in output.splitlines() if line.startswith("LOG ")]
    assert len(log_lines) == 1 and "using the torch path" in log_lines[0], output
    if mode == "auto":
        assert done.returncode == 0 and "backend torch" in done.stdout, output
    else:  # forced native: the step fails loudly rather than running the slow path
        assert done.returncode != 0 and "PDSERVE_CPU_ATTENTION=native" in output, output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("geometry", [(2, 4, 16, 64), (3, 3, 32, 64), (2, 3, 8, 24)],
                         ids=lambda g: "kv{}x{}-bs{}-d{}".format(*g))
@pytest.mark.parametrize("features", [dict(), dict(sliding_window=20, logit_softcap=1.0)], ids=_ids)
def test_attention_with_kv_write_equals_the_write_then_the_attention(dtype, geometry, features):
    num_kv_heads, ratio, block_size, head_dim = geometry
    gen = torch.Generator().manual_seed(block_size + head_dim)
    # Decodes first, then chunks with and without context, as the runner orders a step.
    shapes = [(37, 1), (0, 1), (130, 1), (0, 45), (50, 20), (3, 40)]
    seq_lens = [c + n for c, n in shapes]
    k_cache, v_cache, block_tables, _, _ = make_paged(seq_lens, block_size, gen, device="cpu", dtype=dtype,
                                                      num_kv_heads=num_kv_heads, head_dim=head_dim)
    query_lens = [n for _, n in shapes]
    num_tokens = sum(query_lens)
    slots = [int(block_tables[i, p // block_size]) * block_size + p % block_size
             for i, (c, n) in enumerate(shapes) for p in range(c, c + n)]
    slots[5] = -1  # padding: computed, never written
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    num_q_heads = num_kv_heads * ratio
    # k and v as the model has them: strided views into one qkv projection output.
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    query_start_loc = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, k_ref, v_ref, slot_mapping, backend="torch")
    want = prefill_attention(q, k_ref, v_ref, block_tables, query_start_loc, seq_lens_t, head_dim ** -0.5,
                             backend="torch", **features)
    got = attention_with_kv_write(q, k, v, k_cache, v_cache, slot_mapping, block_tables, query_start_loc,
                                  seq_lens_t, head_dim ** -0.5, **features)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert got.shape == q.shape and got.dtype == dtype
    assert rel_err(got, want) < TOLERANCE[dtype]


def test_attention_with_kv_write_refuses_a_slot_past_the_cache_and_declines_other_paths(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, block_tables, _, _ = make_paged([5], 16, gen, device="cpu")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    q = torch.randn(1, num_kv_heads, head_dim)
    k = v = torch.randn(1, num_kv_heads, head_dim)
    args = (block_tables, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5], dtype=torch.int32), 0.125)
    num_slots = k_cache.shape[0] * 16
    with pytest.raises(ValueError, match=f"slot {num_slots} of token 0 is past the cache's {num_slots}"):
        attention_with_kv_write(q, k, v, k_cache, v_cache, torch.tensor([num_slots]), *args)
    # Not the native path: None, and the caller writes and attends separately.
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "torch")
    assert attention_with_kv_write(q, k, v, k_cache, v_cache, torch.tensor([4]), *args) is None

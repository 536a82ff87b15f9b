"""Kernel tests: Triton and the torch reference against a naive oracle, on the GPU where
there is one (scripts/gpu_check.sh), else on the CPU with Triton interpreted.

The oracle loops over tokens and heads on un-paged contiguous K/V in float64.
Error metric everywhere: max |a - b| / max |b| (max relative error), < 1e-4 for fp32.
"""
from __future__ import annotations

import os

import pytest
import torch

from kernels import decode_attention, prefill_attention, write_kv_cache
from tests.support.fresh_process import run_python

BACKENDS = ["torch", "triton"]
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 32
SCALE = HEAD_DIM ** -0.5
PAD_BLOCK = 1_000_000  # padded block-table entries point nowhere valid on purpose
# Inputs are drawn on the CPU (seeded generators) and moved; the oracle stays there.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max()).item()


def naive_attention(q_tok, k_seq, v_seq, num_visible):
    """q_tok [num_q_heads, D] over the first num_visible rows of k_seq/v_seq [L, num_kv_heads, D]."""
    group = q_tok.shape[0] // k_seq.shape[1]
    out = torch.empty(q_tok.shape, dtype=torch.float64)
    for h in range(q_tok.shape[0]):
        k = k_seq[:num_visible, h // group].double()  # [num_visible, D]
        v = v_seq[:num_visible, h // group].double()
        probs = torch.softmax(k @ q_tok[h].double() * SCALE, dim=0)
        out[h] = probs @ v
    return out


def make_paged(seq_lens, block_size, gen, dtype=torch.float32, num_kv_heads=NUM_KV_HEADS,
               head_dim=HEAD_DIM, device=DEVICE):
    """Random per-sequence K/V placed in shuffled cache blocks; garbage everywhere else.
    The cache and block tables on `device`, the per-sequence K/V (the oracle's) on the CPU."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), PAD_BLOCK, dtype=torch.int32)
    keys, values = [], []
    for i, n in enumerate(seq_lens):
        ids = [perm.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        keys.append(torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype))
        values.append(torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype))
        for pos in range(n):
            k_cache[ids[pos // block_size], pos % block_size] = keys[i][pos]
            v_cache[ids[pos // block_size], pos % block_size] = values[i][pos]
    return k_cache.to(device), v_cache.to(device), block_tables.to(device), keys, values


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [16, 8])
def test_write_kv_cache(backend, block_size):
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_tokens = 6, 20
    k_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 11, 19]] = -1  # padding tokens
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    write_kv_cache(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE), backend=backend)
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_before[slot // block_size, slot % block_size] = key[t]
            v_before[slot // block_size, slot % block_size] = value[t]
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_cache_strided_views(backend):
    # A layer's K and V as views into one [num_blocks, 2, ...] tensor, key/value sliced from qkv.
    kv = torch.zeros(4, 2, 8, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    qkv = torch.randn(5, 3 * NUM_KV_HEADS * HEAD_DIM).to(DEVICE)
    key = qkv[:, :NUM_KV_HEADS * HEAD_DIM].view(5, NUM_KV_HEADS, HEAD_DIM)
    value = qkv[:, NUM_KV_HEADS * HEAD_DIM:2 * NUM_KV_HEADS * HEAD_DIM].view(5, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.tensor([0, 9, -1, 31, 17], device=DEVICE)
    write_kv_cache(key, value, kv[:, 0], kv[:, 1], slots, backend=backend)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(kv[slot // 8, 0, slot % 8], key[t])
            assert torch.equal(kv[slot // 8, 1, slot % 8], value[t])
    assert kv.abs().sum(dim=(2, 3, 4)).count_nonzero() == 8  # nothing else touched
    # Attention reads the strided cache views and a q sliced out of a wider projection.
    q = torch.randn(2, NUM_Q_HEADS * HEAD_DIM + 8).to(DEVICE)[:, 8:].view(2, NUM_Q_HEADS, HEAD_DIM)
    block_tables = torch.tensor([[1, 3], [2, 0]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([16, 10], dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, kv[:, 0], kv[:, 1], block_tables, lens, SCALE, backend=backend)
    ref = decode_attention(q.contiguous(), kv[:, 0].contiguous(), kv[:, 1].contiguous(),
                           block_tables, lens, SCALE, backend="torch")
    assert rel_err(out, ref) < 1e-4 and out.is_contiguous()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [16, 8])
def test_decode_attention(backend, block_size):
    gen = torch.Generator().manual_seed(1)
    seq_lens = [1, 17, 70, block_size * 3]
    k_cache, v_cache, block_tables, keys, values = make_paged(seq_lens, block_size, gen)
    q = torch.randn(len(seq_lens), NUM_Q_HEADS, HEAD_DIM, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q.to(DEVICE), k_cache, v_cache, block_tables, lens, SCALE, backend=backend)
    expected = torch.stack([naive_attention(q[i], keys[i], values[i], n) for i, n in enumerate(seq_lens)])
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, expected) < 1e-4
    if backend == "triton":
        ref = decode_attention(q.to(DEVICE), k_cache, v_cache, block_tables, lens, SCALE, backend="torch")
        assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_zero_length_gives_zeros(backend):
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, block_tables, _, _ = make_paged([5, 9], 8, gen)
    q = torch.randn(2, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    lens = torch.tensor([0, 9], dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, block_tables, lens, SCALE, max_seq_len=9, backend=backend)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isfinite(out).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [16, 8])
def test_prefill_attention_ragged(backend, block_size):
    gen = torch.Generator().manual_seed(3)
    # (context_len, query_len): fresh prompts, chunked-prefill/prefix-hit offsets, decode-like
    # single tokens, chunks crossing 32-row Triton query tiles and 128-row torch chunks,
    # an empty query.
    shapes = [(0, 20), (13, 7), (35, 1), (0, 1), (16, 33), (5, 0), (2, 1), (20, 150)]
    seq_lens = [c + n for c, n in shapes]
    k_cache, v_cache, block_tables, keys, values = make_paged(seq_lens, block_size, gen)
    query_lens = [n for _, n in shapes]
    q = torch.randn(sum(query_lens), NUM_Q_HEADS, HEAD_DIM, generator=gen)
    query_start_loc = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32,
                                   device=DEVICE)
    out = prefill_attention(q.to(DEVICE), k_cache, v_cache, block_tables, query_start_loc,
                            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), SCALE,
                            max_query_len=max(query_lens), max_seq_len=max(seq_lens), backend=backend)
    expected = torch.empty(q.shape, dtype=torch.float64)
    for i, (context_len, query_len) in enumerate(shapes):
        for j in range(query_len):
            token = int(query_start_loc[i]) + j
            expected[token] = naive_attention(q[token], keys[i], values[i], context_len + j + 1)
    assert out.shape == q.shape
    assert rel_err(out, expected) < 1e-4
    if backend == "triton":
        ref = prefill_attention(q.to(DEVICE), k_cache, v_cache, block_tables, query_start_loc,
                                torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), SCALE, backend="torch")
        assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_mha_odd_head_dim_single_sequence(backend):
    # No GQA, head_dim 24 (not a power of two), block_size 4, one sequence with context.
    gen = torch.Generator().manual_seed(5)
    num_heads, head_dim, context_len, query_len = 3, 24, 11, 9
    k_cache, v_cache, block_tables, keys, values = make_paged(
        [context_len + query_len], 4, gen, num_kv_heads=num_heads, head_dim=head_dim)
    q = torch.randn(query_len, num_heads, head_dim, generator=gen)
    lens = torch.tensor([context_len + query_len], dtype=torch.int32, device=DEVICE)
    out = prefill_attention(q.to(DEVICE), k_cache, v_cache, block_tables,
                            torch.tensor([0, query_len], dtype=torch.int32, device=DEVICE), lens, SCALE,
                            backend=backend)
    expected = torch.stack([naive_attention(q[j], keys[0], values[0], context_len + j + 1)
                            for j in range(query_len)])
    assert rel_err(out, expected) < 1e-4
    # The last query token as a decode step sees the same keys.
    out = decode_attention(q[-1:].to(DEVICE), k_cache, v_cache, block_tables, lens, SCALE, backend=backend)
    assert rel_err(out[0], expected[-1]) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_triton_matches_reference(dtype):
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache, block_tables, _, _ = make_paged([9, 30], 16, gen, dtype=dtype)
    lens = torch.tensor([9, 30], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(DEVICE, dtype)
    args = (q, k_cache, v_cache, block_tables, lens, SCALE)
    out = decode_attention(*args, backend="triton")
    assert out.dtype == dtype
    assert rel_err(out, decode_attention(*args, backend="torch")) < 2e-2
    q = torch.randn(12, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(DEVICE, dtype)
    args = (q, k_cache, v_cache, block_tables, torch.tensor([0, 4, 12], dtype=torch.int32, device=DEVICE), lens,
            SCALE)
    assert rel_err(prefill_attention(*args, backend="triton"), prefill_attention(*args, backend="torch")) < 2e-2


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_over_fp8_codes_matches_the_reference(dtype, cache_dtype):
    """kv_cache_dtype fp8 on CUDA: the Triton write stores torch's codes (padding slots
    skipped), and both kernels read them as the torch reference does (widened exactly)."""
    gen = torch.Generator().manual_seed(6)
    seq_lens = [9, 30, 70]
    block_size = 16
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 1
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    reference_caches = (k_cache.clone(), v_cache.clone())
    block_tables = torch.zeros(len(seq_lens), -(-max(seq_lens) // block_size), dtype=torch.int32)
    slots, next_block = [], 1
    for i, n in enumerate(seq_lens):
        blocks = list(range(next_block, next_block + -(-n // block_size)))
        next_block += len(blocks)
        block_tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
    slots.insert(5, -1)  # a padding token: nothing written
    # Values past E4M3's largest (448) too: the codes saturate.
    key = (torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen) * 100).to(DEVICE, dtype)
    value = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE, dtype)
    slot_mapping = torch.tensor(slots, device=DEVICE)
    write_kv_cache(key, value, k_cache, v_cache, slot_mapping, backend="triton")
    write_kv_cache(key, value, *reference_caches, slot_mapping, backend="torch")
    assert torch.equal(k_cache.view(torch.uint8), reference_caches[0].view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), reference_caches[1].view(torch.uint8))
    assert k_cache[0].view(torch.uint8).count_nonzero() == 0  # block 0 no slot's
    block_tables = block_tables.to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    # The x100 keys put scores in the hundreds, where one fp32 rounding of a score moves its
    # weight by ~2e-5 (seen on an H200: 1.02e-5 between two correct fp32 kernels), so fp32
    # keeps the file's 1e-4; a misread code is off by a whole fp8 step (12-25%).
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    q = torch.randn(len(seq_lens), NUM_Q_HEADS, HEAD_DIM, generator=gen).to(DEVICE, dtype)
    args = (q, k_cache, v_cache, block_tables, lens, SCALE)
    out = decode_attention(*args, backend="triton")
    assert out.dtype == dtype and rel_err(out, decode_attention(*args, backend="torch")) < tolerance
    q = torch.randn(20, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(DEVICE, dtype)
    query_start_loc = torch.tensor([0, 4, 12, 20], dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, block_tables, query_start_loc, lens, SCALE)
    assert rel_err(prefill_attention(*args, backend="triton"), prefill_attention(*args, backend="torch")) < tolerance


def _decode_args(**overrides):
    k_cache = torch.zeros(4, 16, NUM_KV_HEADS, HEAD_DIM)
    args = dict(q=torch.zeros(2, NUM_Q_HEADS, HEAD_DIM), k_cache=k_cache, v_cache=k_cache.clone(),
                block_tables=torch.zeros(2, 2, dtype=torch.int32),
                seq_lens=torch.ones(2, dtype=torch.int32), scale=SCALE)
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides, match", [
    (dict(q=torch.zeros(2, 5, HEAD_DIM)), "multiple of num_kv_heads"),
    (dict(q=torch.zeros(2, NUM_Q_HEADS, 16)), "head_dim"),
    (dict(q=torch.zeros(3, NUM_Q_HEADS, HEAD_DIM)), "sequences"),
    (dict(q=torch.zeros(2, NUM_Q_HEADS * HEAD_DIM)), "q must be"),
    (dict(q=torch.zeros(2, NUM_Q_HEADS, HEAD_DIM, dtype=torch.float16)), "dtype mismatch"),
    (dict(q=torch.zeros(2, HEAD_DIM, NUM_Q_HEADS).transpose(1, 2)), "contiguous"),
    (dict(q=torch.zeros(2, NUM_Q_HEADS, HEAD_DIM, dtype=torch.float64)), "float32"),
    (dict(v_cache=torch.zeros(4, 8, NUM_KV_HEADS, HEAD_DIM)), "v_cache shape"),
    (dict(block_tables=torch.zeros(2, 2, dtype=torch.int64)), "block_tables must be int32"),
    (dict(block_tables=torch.zeros(2, dtype=torch.int32)), "block_tables must be"),
    (dict(seq_lens=torch.ones(2, dtype=torch.int64)), "seq_lens must be int32"),
    (dict(seq_lens=torch.ones(3, dtype=torch.int32)), r"seq_lens must have shape \[2\]"),
    (dict(max_seq_len=33), "exceeds block_tables capacity"),
    (dict(backend="cuda"), "backend must be"),
])
def test_decode_preconditions(overrides, match):
    with pytest.raises(ValueError, match=match):
        decode_attention(**_decode_args(**overrides))


def test_prefill_and_write_preconditions():
    args = _decode_args()
    q = torch.zeros(3, NUM_Q_HEADS, HEAD_DIM)
    cache = (args["k_cache"], args["v_cache"], args["block_tables"])
    with pytest.raises(ValueError, match=r"query_start_loc must have shape \[3\]"):
        prefill_attention(q, *cache, torch.tensor([0, 3], dtype=torch.int32), args["seq_lens"], SCALE)
    with pytest.raises(ValueError, match="query_start_loc must be int32"):
        prefill_attention(q, *cache, torch.tensor([0, 1, 3]), args["seq_lens"], SCALE)
    with pytest.raises(ValueError, match="seq_len 1 < query_len 2"):
        prefill_attention(q, *cache, torch.tensor([0, 1, 3], dtype=torch.int32), args["seq_lens"], SCALE)
    key = torch.zeros(3, NUM_KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        write_kv_cache(key, key, args["k_cache"], args["v_cache"], torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"slot_mapping must have shape \[3\]"):
        write_kv_cache(key, key, args["k_cache"], args["v_cache"], torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="do not match the cache"):
        write_kv_cache(key[:, :1], key[:, :1], args["k_cache"], args["v_cache"], torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="dtype mismatch"):
        write_kv_cache(key.half(), key.half(), args["k_cache"], args["v_cache"], torch.zeros(3, dtype=torch.int64))


_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_attention as ta, triton_cache as tc

INT32_PTRS = ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")
for dtype in ("bf16", "fp32"):
    block = 64 if dtype == "bf16" else 32
    for fn, consts in (
        (ta._decode_kernel, dict(GROUP=4, BLOCK_G=16, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=block, UPCAST=False)),
        (ta._prefill_kernel, dict(GROUP=4, BLOCK_M=block, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=block, UPCAST=False)),
        (tc._write_kv_cache_kernel, dict(BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128)),
    ):
        sig = {}
        for name in fn.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = "*i32" if name in INT32_PTRS else "*i64" if name == "slot_mapping_ptr" else "*" + dtype
            else:
                sig[name] = "fp32" if name == "scale_log2" else "i32"
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
print("compiled")
"""


def test_triton_kernels_compile_for_gpu():
    # The interpreter skips codegen; compile for sm_90 ahead of time to catch what only a
    # GPU build would reject (types, tl.dot shapes, control flow). Needs no GPU.
    import pathlib

    triton = pytest.importorskip("triton")
    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("triton's bundled ptxas is missing")
    fp_fusion = os.environ.get("TRITON_DEFAULT_FP_FUSION", "1")
    result = run_python(_COMPILE_SCRIPT, timeout_s=240, unset=("TRITON_INTERPRET",),
                        TRITON_DEFAULT_FP_FUSION=fp_fusion)
    assert "compiled" in result.stdout, result.stdout + result.stderr

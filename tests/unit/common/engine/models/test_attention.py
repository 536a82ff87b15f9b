"""The model's per-layer attention op on CPU: the step the forward context publishes to the
native kernel, the fused kernel run from C++ on it, and the Python op where nothing is
published (a KV-connector hook per layer, no ragged batch)."""
from __future__ import annotations

import pytest
import torch

from common.engine.forward_context import forward_context
from common.engine.models.attention import AttentionMetadata
from kernels.cpu_attention import cpu_attention_backend, layer_attention, native_attention_error, publish_step
from tests.unit.kernels.test_kernels import make_paged

pytestmark = pytest.mark.skipif(native_attention_error() is not None or cpu_attention_backend() != "native",
                                reason="the native CPU attention kernel is not in use here")

BLOCK_SIZE, NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM = 16, 3, 9, 64
SCALE = HEAD_DIM ** -0.5


def make_step(seed: int):
    """A ragged step of three chunks (with and without context) on shuffled cache blocks:
    q, k, v, the caches and its metadata, every field the runner fills in."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(0, 5), (40, 3), (17, 1)]  # (context, new tokens) per sequence
    seq_lens = [c + n for c, n in shapes]
    k_cache, v_cache, block_tables, _, _ = make_paged(seq_lens, BLOCK_SIZE, gen, num_kv_heads=NUM_KV_HEADS,
                                                      head_dim=HEAD_DIM)
    slots = [int(block_tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for i, (c, n) in enumerate(shapes) for p in range(c, c + n)]
    num_tokens = len(slots)
    query_start_loc = torch.tensor([0] + torch.tensor([n for _, n in shapes]).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), num_decode_tokens=0, decode_block_tables=None,
        decode_seq_lens=None, max_decode_seq_len=0, prefill_block_tables=block_tables,
        prefill_query_start_loc=query_start_loc, prefill_seq_lens=seq_lens_t,
        max_prefill_query_len=5, max_prefill_seq_len=max(seq_lens),
        block_tables=block_tables, query_start_loc=query_start_loc, seq_lens=seq_lens_t)
    q = torch.randn(num_tokens, NUM_Q_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    return q, k, v, k_cache, v_cache, meta


# Layer indices as the compiled model passes them: 0-d int64 tensors.
LAYER = {i: torch.tensor(i) for i in (0, 7)}


def python_op(q, k, v, k_cache, v_cache, meta, layer_idx=0):
    with forward_context(meta):
        return torch.ops.pdserve.paged_attention(q, k, v, k_cache, v_cache, SCALE, LAYER[layer_idx], None, None)


def test_the_published_step_runs_the_fused_kernel_from_cpp():
    q, k, v, k_cache, v_cache, meta = make_step(0)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = python_op(q, k, v, k_ref, v_ref, meta)
    assert not torch.ops.pdserve_cpu.has_step()
    with forward_context(meta):
        assert torch.ops.pdserve_cpu.has_step()
    assert not torch.ops.pdserve_cpu.has_step()  # the step ends with its forward pass
    # Published without a Python forward context, which the Python op would need: only the
    # C++ path can serve this call.
    publish_step(meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens)
    try:
        got = layer_attention(q, k, v, k_cache, v_cache, SCALE, LAYER[0], None, None)
    finally:
        publish_step(None)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # the new K/V were written
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="outside a forward pass"):  # nothing published: the Python op
        layer_attention(q, k, v, k_cache, v_cache, SCALE, LAYER[0], None, None)


def test_a_layer_hook_keeps_the_python_op_which_calls_it():
    q, k, v, k_cache, v_cache, meta = make_step(1)
    want = python_op(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    hooked = []
    meta.kv_layer_hook = hooked.append
    with forward_context(meta):
        assert not torch.ops.pdserve_cpu.has_step()
        got = layer_attention(q, k, v, k_cache, v_cache, SCALE, LAYER[7], None, None)
    assert hooked == [7]  # the Python path ran: it calls the hook with the layer's index
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_nested_pass_restores_the_outer_step():
    outer, inner = make_step(2), make_step(3)
    inner[5].kv_layer_hook = lambda layer_idx: None
    with forward_context(outer[5]):
        with forward_context(inner[5]):
            assert not torch.ops.pdserve_cpu.has_step()
        assert torch.ops.pdserve_cpu.has_step()
        q, k, v, k_cache, v_cache, meta = outer
        want = python_op(q, k, v, k_cache.clone(), v_cache.clone(), meta)
        got = layer_attention(q, k, v, k_cache, v_cache, SCALE, LAYER[0], None, None)
    assert not torch.ops.pdserve_cpu.has_step()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_layer_features_are_refused_on_the_fused_path():
    q, k, v, k_cache, v_cache, meta = make_step(4)
    with forward_context(meta):
        with pytest.raises(ValueError, match="sliding_window"):
            layer_attention(q, k, v, k_cache, v_cache, SCALE, LAYER[0], 0, None)
        with pytest.raises(ValueError, match="logit_softcap"):
            layer_attention(q, k, v, k_cache, v_cache, SCALE, LAYER[0], None, -1.0)

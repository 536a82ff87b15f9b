"""Sliding windows and logit soft-capping on the torch path against a naive float64 oracle.

The Triton kernels implement neither: the dispatcher sends such calls to torch on any
device, and refuses a forced backend="triton".
"""
from __future__ import annotations

import pytest
import torch

from kernels import decode_attention, prefill_attention
from tests.unit.kernels.test_kernels import DEVICE, HEAD_DIM, NUM_Q_HEADS, SCALE, make_paged, rel_err

FEATURES = [dict(sliding_window=5), dict(logit_softcap=0.5), dict(sliding_window=9, logit_softcap=2.0)]


def naive_attention(q_tok, k_seq, v_seq, position, sliding_window=None, logit_softcap=None):
    """q_tok [num_q_heads, D] at `position` over k_seq/v_seq [L, num_kv_heads, D]."""
    first = 0 if sliding_window is None else max(0, position - sliding_window + 1)
    group = q_tok.shape[0] // k_seq.shape[1]
    out = torch.empty(q_tok.shape, dtype=torch.float64)
    for h in range(q_tok.shape[0]):
        k = k_seq[first:position + 1, h // group].double()  # [num_visible, D]
        v = v_seq[first:position + 1, h // group].double()
        scores = k @ q_tok[h].double() * SCALE
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        out[h] = torch.softmax(scores, dim=0) @ v
    return out


@pytest.mark.parametrize("features", FEATURES)
def test_decode_features(features):
    gen = torch.Generator().manual_seed(0)
    seq_lens = [1, 4, 13, 30]
    k_cache, v_cache, block_tables, keys, values = make_paged(seq_lens, 8, gen)
    q = torch.randn(len(seq_lens), NUM_Q_HEADS, HEAD_DIM, generator=gen)
    out = decode_attention(q.to(DEVICE), k_cache, v_cache, block_tables,
                           torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), SCALE, **features)
    for i, n in enumerate(seq_lens):
        assert rel_err(out[i], naive_attention(q[i], keys[i], values[i], n - 1, **features)) < 1e-5


@pytest.mark.parametrize("features", FEATURES)
def test_prefill_features_with_context(features):
    gen = torch.Generator().manual_seed(1)
    seq_lens, query_lens = [20, 7, 33, 1, 6], [20, 3, 11, 1, 1]  # fresh, chunked, decode-like rows
    k_cache, v_cache, block_tables, keys, values = make_paged(seq_lens, 8, gen)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], NUM_Q_HEADS, HEAD_DIM, generator=gen)
    out = prefill_attention(q.to(DEVICE), k_cache, v_cache, block_tables,
                            torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), SCALE, **features)
    for i, (n, query_len) in enumerate(zip(seq_lens, query_lens)):
        for j in range(query_len):
            position = n - query_len + j
            expected = naive_attention(q[starts[i] + j], keys[i], values[i], position, **features)
            assert rel_err(out[starts[i] + j], expected) < 1e-5


def test_forced_triton_refuses_features():
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, block_tables, _, _ = make_paged([4], 8, gen)
    q = torch.randn(1, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match="sliding windows"):
        decode_attention(q, k_cache, v_cache, block_tables, torch.tensor([4], dtype=torch.int32, device=DEVICE),
                         SCALE, backend="triton", sliding_window=2)

"""Tensor-parallel layers, sharded by hand in one process: the ranks' shards put together
give the unsharded layer's output, and tp_size 1 is the plain layer with no collective.

Without parallel_state initialised the collectives are the identity, so a rank's forward
here returns its partial result; the tests sum or concatenate them as the all-reduce or
all-gather would.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.engine.config import ModelConfig
from common.engine.distributed import parallel_state
from common.engine.models.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    kv_head_partition,
    parallel_logits,
)

HIDDEN, HEAD_DIM = 16, 4


def test_kv_heads_split_or_replicate():
    assert [kv_head_partition(4, r, 2) for r in range(2)] == [(0, 2), (2, 2)]
    # More ranks than KV heads: each head on tp_size // num_kv_heads adjacent ranks.
    assert [kv_head_partition(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_head_partition(3, r, 3) for r in range(3)] == [(0, 1), (1, 1), (2, 1)]


@pytest.mark.parametrize("num_heads, num_kv_heads, tp_size", [(8, 2, 2), (8, 2, 4), (9, 3, 3), (4, 4, 1)])
def test_qkv_shards_hold_their_ranks_heads(num_heads, num_kv_heads, tp_size):
    torch.manual_seed(0)
    q_w, k_w, v_w = (torch.randn(n * HEAD_DIM, HIDDEN) for n in (num_heads, num_kv_heads, num_kv_heads))
    q_b, k_b, v_b = (torch.randn(w.shape[0]) for w in (q_w, k_w, v_w))
    x = torch.randn(5, HIDDEN)
    q_full = F.linear(x, q_w, q_b).view(5, num_heads, HEAD_DIM)
    k_full = F.linear(x, k_w, k_b).view(5, num_kv_heads, HEAD_DIM)
    v_full = F.linear(x, v_w, v_b).view(5, num_kv_heads, HEAD_DIM)
    for rank in range(tp_size):
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, num_heads, num_kv_heads, bias=True, tp_rank=rank, tp_size=tp_size)
        for shard, (w, b) in enumerate([(q_w, q_b), (k_w, k_b), (v_w, v_b)]):
            layer.load_weight("weight", w, shard)
            layer.load_weight("bias", b, shard)
        out = layer(x).view(5, -1, HEAD_DIM)
        q, k, v = out.split([layer.num_heads, layer.num_kv_heads, layer.num_kv_heads], dim=1)
        heads = slice(rank * layer.num_heads, (rank + 1) * layer.num_heads)
        kv_heads = slice(layer.kv_head_start, layer.kv_head_start + layer.num_kv_heads)
        torch.testing.assert_close(q, q_full[:, heads])
        torch.testing.assert_close(k, k_full[:, kv_heads])
        torch.testing.assert_close(v, v_full[:, kv_heads])


def test_qkv_loads_a_prepacked_checkpoint_tensor_as_its_pieces():
    torch.manual_seed(0)
    packed = torch.randn((8 + 2 * 2) * HEAD_DIM, HIDDEN)  # Phi-3 stores q, k, v as one tensor
    by_piece = QKVParallelLinear(HIDDEN, HEAD_DIM, 8, 2, bias=False, tp_rank=1, tp_size=2)
    for shard, piece in enumerate(packed.split([8 * HEAD_DIM, 2 * HEAD_DIM, 2 * HEAD_DIM])):
        by_piece.load_weight("weight", piece, shard)
    at_once = QKVParallelLinear(HIDDEN, HEAD_DIM, 8, 2, bias=False, tp_rank=1, tp_size=2)
    at_once.load_weight("weight", packed, None)
    torch.testing.assert_close(at_once.weight, by_piece.weight)


def test_gated_mlp_shards_sum_to_the_full_mlp():
    torch.manual_seed(0)
    intermediate, tp_size = 12, 3
    gate_w, up_w, down_w = torch.randn(intermediate, HIDDEN), torch.randn(intermediate, HIDDEN), \
        torch.randn(HIDDEN, intermediate)
    x = torch.randn(5, HIDDEN)
    expected = F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)
    total = torch.zeros_like(expected)
    for rank in range(tp_size):
        gate_up = MergedColumnParallelLinear(HIDDEN, intermediate, tp_rank=rank, tp_size=tp_size)
        gate_up.load_weight("weight", gate_w, 0)
        gate_up.load_weight("weight", up_w, 1)
        down = RowParallelLinear(intermediate, HIDDEN, tp_rank=rank, tp_size=tp_size)
        down.load_weight("weight", down_w, None)
        gate, up = gate_up(x).split(gate_up.output_size_per_rank, dim=-1)
        total += down(F.silu(gate) * up)  # the all-reduce's sum
    torch.testing.assert_close(total, expected)


def test_vocab_shards_embed_and_project_like_the_full_table():
    torch.manual_seed(0)
    vocab, tp_size = 10, 4  # 3 rows per rank: the last rank holds 1 real row and 2 of padding
    table = torch.randn(vocab, HIDDEN)
    ids = torch.tensor([0, 3, 9, 5, 2])
    hidden = torch.randn(3, HIDDEN)
    embedded = torch.zeros(len(ids), HIDDEN)
    logit_slices = []
    for rank in range(tp_size):
        embedding = VocabParallelEmbedding(vocab, HIDDEN, tp_rank=rank, tp_size=tp_size)
        embedding.weight.data.fill_(float("nan"))  # loading must overwrite padding too
        embedding.load_weight("weight", table, None)
        embedded += embedding(ids)  # the all-reduce's sum
        head = ParallelLMHead(vocab, HIDDEN, tp_rank=rank, tp_size=tp_size)
        head.load_weight("weight", table, None)
        logit_slices.append(F.linear(hidden, head.weight))
    assert torch.equal(embedding.weight[1:], torch.zeros(2, HIDDEN))
    torch.testing.assert_close(embedded, F.embedding(ids, table))
    torch.testing.assert_close(torch.cat(logit_slices, dim=-1)[:, :vocab], F.linear(hidden, table))


def test_wrong_checkpoint_shapes_are_named():
    layer = RowParallelLinear(8, HIDDEN, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match=r"shape \(16, 4\), expected \(16, 8\)"):
        layer.load_weight("weight", torch.zeros(HIDDEN, 4), None)
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, 8, 2, bias=False, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match=r"expected \(8, 16\)"):
        qkv.load_weight("weight", torch.zeros(4 * HEAD_DIM, HIDDEN), 1)


def test_one_rank_is_the_plain_layer_with_no_collective(monkeypatch):
    def no_collective(*args, **kwargs):
        raise AssertionError("a collective at tp_size 1")
    monkeypatch.setattr(parallel_state, "tp_all_reduce", no_collective)
    monkeypatch.setattr(parallel_state, "tp_all_gather", no_collective)
    torch.manual_seed(0)
    x = torch.randn(5, HIDDEN)
    down = RowParallelLinear(HIDDEN, 8)
    assert down.weight.shape == (8, HIDDEN)
    torch.testing.assert_close(down(x), F.linear(x, down.weight))
    embedding = VocabParallelEmbedding(10, HIDDEN)
    assert embedding.weight.shape == (10, HIDDEN)
    ids = torch.tensor([1, 9])
    torch.testing.assert_close(embedding(ids), F.embedding(ids, embedding.weight))
    torch.testing.assert_close(parallel_logits(x, embedding.weight, 10, 1), F.linear(x, embedding.weight))


def _config(num_heads: int, num_kv_heads: int, intermediate: int = 128, num_layers: int = 2) -> ModelConfig:
    return ModelConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=num_heads * HEAD_DIM,
        intermediate_size=intermediate, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads))


@pytest.mark.parametrize("num_heads, num_kv_heads, tp, pp", [(9, 3, 1, 1), (9, 3, 3, 1), (9, 3, 9, 1),
                                                             (8, 2, 4, 2), (8, 8, 2, 1)])
def test_valid_layouts_pass(num_heads, num_kv_heads, tp, pp):
    _config(num_heads, num_kv_heads, intermediate=144).verify_parallel(tp, pp)


@pytest.mark.parametrize("num_heads, num_kv_heads, intermediate, tp, pp, message", [
    (9, 3, 128, 2, 1, r"Total number of attention heads \(9\) must be divisible by tensor parallel size \(2\)\."),
    (12, 3, 128, 4, 1, r"Tensor parallel size \(4\) must be a multiple of the total number of key/value "
                       r"heads \(3\)"),
    (12, 6, 128, 4, 1, r"Total number of key/value heads \(6\) must be divisible by tensor parallel size \(4\)\."),
    (8, 2, 100, 8, 1, r"Intermediate size \(100\) must be divisible by tensor parallel size \(8\)\."),
    (8, 2, 128, 1, 3, r"Total number of hidden layers \(2\) must be at least the pipeline parallel size \(3\)\."),
])
def test_invalid_layouts_name_the_counts(num_heads, num_kv_heads, intermediate, tp, pp, message):
    with pytest.raises(ValueError, match=message):
        _config(num_heads, num_kv_heads, intermediate).verify_parallel(tp, pp)

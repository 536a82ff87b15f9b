"""A tensor-parallel rank's share of an adapter's stacked matrices (lora/layers.rank_shards)
is exactly the features its base linears hold, as parallel_layers splits them: B's rows of
the column-parallel qkv (query heads, and KV heads split or replicated) and gate/up, A's
columns of the row-parallel o and down projections."""
from __future__ import annotations

import pytest
import torch

from common.engine.config import ModelConfig
from common.engine.lora.layers import _shard, rank_shards
from common.engine.models.parallel_layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

HIDDEN, HEAD_DIM, INTER, RANK = 32, 4, 48, 3


def config(num_heads: int, num_kv_heads: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=HIDDEN, intermediate_size=INTER,
                       num_hidden_layers=1, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                       head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                       max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False, bos_token_id=None,
                       eos_token_ids=(0,))


@pytest.mark.parametrize("num_heads, num_kv_heads, tp_size", [(8, 2, 2), (8, 2, 4), (9, 3, 3), (4, 4, 2)])
def test_a_ranks_shards_are_the_features_its_parallel_linears_hold(num_heads, num_kv_heads, tp_size):
    torch.manual_seed(0)
    q_out, kv_out = num_heads * HEAD_DIM, num_kv_heads * HEAD_DIM
    # Full weights: a B's rows index its linear's output features as the weight's rows do; an
    # A's columns its input features as the weight's columns do.
    qkv_w, gate_up_w = torch.randn(q_out + 2 * kv_out, HIDDEN), torch.randn(2 * INTER, HIDDEN)
    o_w, down_w = torch.randn(HIDDEN, q_out), torch.randn(HIDDEN, INTER)
    a_any, b_any = torch.randn(RANK, HIDDEN), torch.randn(HIDDEN, RANK)  # the matrix a shard leaves whole
    for rank in range(tp_size):
        shards = rank_shards(config(num_heads, num_kv_heads), rank, tp_size)
        qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, num_heads, num_kv_heads, bias=False, tp_rank=rank, tp_size=tp_size)
        qkv.load_weight("weight", qkv_w, None)
        gate_up = MergedColumnParallelLinear(HIDDEN, INTER, tp_rank=rank, tp_size=tp_size)
        gate_up.load_weight("weight", gate_up_w, None)
        o = RowParallelLinear(q_out, HIDDEN, tp_rank=rank, tp_size=tp_size)
        o.load_weight("weight", o_w, None)
        down = RowParallelLinear(INTER, HIDDEN, tp_rank=rank, tp_size=tp_size)
        down.load_weight("weight", down_w, None)
        for name, full, layer in (("qkv_proj", qkv_w, qkv), ("gate_up_proj", gate_up_w, gate_up)):
            a, b = _shard(a_any, full, shards[name])
            assert a is a_any and torch.equal(b, layer.weight.data), (name, rank)
        for name, full, layer in (("o_proj", o_w, o), ("down_proj", down_w, down)):
            a, b = _shard(full, b_any, shards[name])
            assert b is b_any and torch.equal(a, layer.weight.data), (name, rank)

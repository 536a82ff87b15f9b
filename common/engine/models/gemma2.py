"""Gemma 2: Llama's attention and gated MLP rearranged.

What differs: embeddings scaled by sqrt(hidden_size); RMSNorm by (1 + weight);
norms after attention and around the MLP (sandwich); GeGLU (gelu_pytorch_tanh);
scores scaled by query_pre_attn_scalar ** -0.5 and soft-capped; logits soft-capped;
even layers (layer_types "sliding_attention") see a sliding window. The scaling,
soft-capping and windows come through ModelConfig into the shared attention.
"""
from __future__ import annotations

import torch
from torch import nn

from common.engine.config import ModelConfig
from common.engine.models.causal_lm import CausalLM
from common.engine.models.layers import GatedMLP, RMSNorm
from common.engine.models.llama import LlamaAttention

GEMMA_NORM_OFFSET = 1.0  # checkpoints store weight - 1


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, GEMMA_NORM_OFFSET)

        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.post_feedforward_layernorm = norm()

    def forward(self, x, rope_cos_sin, kv_cache, meta, keep_rows=None):
        """keep_rows: as LlamaDecoderLayer's."""
        attn_out = self.self_attn(self.input_layernorm(x), rope_cos_sin, kv_cache, meta, keep_rows)
        x = (x if keep_rows is None else x.index_select(0, keep_rows)) + self.post_attention_layernorm(attn_out)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2ForCausalLM(CausalLM):
    decoder_layer_cls = Gemma2DecoderLayer
    norm_weight_offset = GEMMA_NORM_OFFSET

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        # The normaliser is rounded to the activations' dtype first, as transformers does.
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)

"""Qwen3: Llama plus an RMSNorm over each q and k head before RoPE (no q/k/v biases)."""
from __future__ import annotations

import torch

from common.engine.config import ModelConfig
from common.engine.models.layers import RMSNorm
from common.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def normalize_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """qk [num_tokens, num_heads + num_kv_heads, head_dim]: each head normed over head_dim."""
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer

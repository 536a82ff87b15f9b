"""Llama decoder over a flattened batch of tokens; the base the other families vary.

Math only: the runner builds positions and attention metadata; prefill chunks
and decode tokens of many requests go through one forward pass.
"""
from __future__ import annotations

import torch
from torch import nn

from common.engine.config import ModelConfig
from common.engine.models.attention import AttentionMetadata, paged_attention
from common.engine.models.causal_lm import CausalLM
from common.engine.models.layers import GatedMLP, RMSNorm
from common.engine.models.parallel_layers import QKVParallelLinear, RowParallelLinear
from common.engine.models.rotary import apply_rope


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        # What attention takes: a plain attribute, not a buffer, so it stays on the CPU
        # (also when the model is built on the meta device and moved).
        self.layer_idx_tensor = torch.tensor(layer_idx, device="cpu")  # [] int64
        self.head_dim = cfg.head_dim
        # q, k and v in one matmul: one weight read instead of three. Under tensor
        # parallelism it holds this rank's heads, and o_proj sums the ranks' outputs.
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.qkv_bias)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size)
        self.scale = cfg.attention_scale
        self.sliding_window = cfg.sliding_window(layer_idx)
        self.logit_softcap = cfg.attn_logit_softcapping

    def normalize_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """qk [num_tokens, num_heads + num_kv_heads, head_dim] before RoPE; Qwen3 norms it."""
        return qk

    def forward(self, x: torch.Tensor, rope_cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden], or [len(keep_rows), hidden] for the
        rows keep_rows names: every token's K/V is written and every token attends, but the
        output projection reads only those rows."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # q and k heads are adjacent: rotate them together in one pass.
        qk = apply_rope(self.normalize_qk(qkv[:, :self.num_heads + self.num_kv_heads]), *rope_cos_sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.layer_idx_tensor,
                              sliding_window=self.sliding_window, logit_softcap=self.logit_softcap)
        if keep_rows is not None:
            out = out.index_select(0, keep_rows)  # [num_kept, num_heads, head_dim]
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[nn.Module] = LlamaAttention

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_cls(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x, rope_cos_sin, kv_cache, meta, keep_rows=None):
        """keep_rows: None, or the rows [num_kept] int64 whose output anyone reads (the
        model's last layer: the sampled ones); the others stop after their K/V are written."""
        attn_out = self.self_attn(self.input_layernorm(x), rope_cos_sin, kv_cache, meta, keep_rows)
        x = (x if keep_rows is None else x.index_select(0, keep_rows)) + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    decoder_layer_cls = LlamaDecoderLayer

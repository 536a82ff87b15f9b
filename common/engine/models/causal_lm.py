"""What every family's model shares: embeddings, the layer stack, the head, weight loading.

A family subclasses `CausalLM`, names its decoder layer class and, where its
checkpoint splits what we fuse (q/k/v, gate/up), the pieces to pack.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.config import ModelConfig
from common.engine.models.attention import AttentionMetadata
from common.engine.models.layers import RMSNorm
from common.engine.models.rotary import RotaryEmbedding

# Checkpoint projection name -> (our fused parameter, its shard index).
LLAMA_PACKED_WEIGHTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def build_rope(cfg: ModelConfig) -> RotaryEmbedding:
    return RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                           cfg.rope_scaling)


class CausalLM(nn.Module):
    decoder_layer_cls: type[nn.Module]
    packed_weights: dict[str, tuple[str, int]] = LLAMA_PACKED_WEIGHTS
    norm_weight_offset = 0.0  # Gemma's RMSNorm scales by (1 + weight)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = build_rope(cfg)
        self.layers = nn.ModuleList(self.decoder_layer_cls(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.norm_weight_offset)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size,
                                                                       bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, num_layers: int | None = None) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> hidden states [num_tokens, hidden_size].

        num_layers: run only the first num_layers layers, then the final norm (an early
        exit, as a speculative draft); None: all of them."""
        x = self.embed(input_ids)
        rope_cos_sin = self.rope.cos_sin(positions, x.dtype)
        for layer, kv_cache in zip(self.layers[:num_layers], kv_caches[:num_layers]):
            x = layer(x, rope_cos_sin, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_seqs, hidden_size] -> logits [num_seqs, vocab_size] in fp32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, packing split projections into their fused params."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            parts = name.split(".")
            shard = None
            if len(parts) >= 2 and parts[-2] in self.packed_weights:
                parts[-2], shard = self.packed_weights[parts[-2]]
            target = ".".join(parts)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {self.config.architecture}")
            param = params[target]
            if shard is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(param.shape)}")
                param.data.copy_(tensor)
            else:
                sizes = self._shard_sizes(parts[-2])
                param.data.narrow(0, sum(sizes[:shard]), sizes[shard]).copy_(tensor)
            loaded.add(f"{target}:{shard}")
        num_shards = {}
        for packed_name, shard in self.packed_weights.values():
            num_shards[packed_name] = max(num_shards.get(packed_name, 0), shard + 1)
        expected = sum(num_shards.get(n.split(".")[-2], 1) for n in params)
        if len(loaded) != expected:
            missing = sorted(n for n in params if not any(k.startswith(n + ":") for k in loaded))
            raise ValueError(f"checkpoint incomplete: loaded {len(loaded)} of {expected} weight pieces; "
                             f"missing {missing[:5]}")

    def _shard_sizes(self, packed_name: str) -> list[int]:
        cfg = self.config
        if packed_name == "qkv_proj":
            kv = cfg.num_key_value_heads * cfg.head_dim
            return [cfg.num_attention_heads * cfg.head_dim, kv, kv]
        return [cfg.intermediate_size, cfg.intermediate_size]

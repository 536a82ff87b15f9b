"""What every family's model shares: embeddings, the layer stack, the head, weight loading.

A family subclasses `CausalLM`, names its decoder layer class and, where its
checkpoint splits what we fuse (q/k/v, gate/up), the pieces to pack.

Under pipeline parallelism a model holds only its stage's layers (parallel_state's
split): the first stage embeds, the last norms and owns the LM head; `forward` takes
the previous stage's hidden states instead of token ids on the others. Under tensor
parallelism the layers hold their rank's shard and load only it.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from common.engine.config import ModelConfig
from common.engine.distributed import parallel_state
from common.engine.models.attention import AttentionMetadata
from common.engine.models.layers import RMSNorm
from common.engine.models.parallel_layers import ParallelLMHead, VocabParallelEmbedding, parallel_logits
from common.engine.models.rotary import RotaryEmbedding

# A decoder layer's four projections as (block, linear) attribute names, in the order it runs them.
DECODER_PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                       ("mlp", "down_proj"))
# Checkpoint projection name -> (our fused parameter, its shard index).
LLAMA_PACKED_WEIGHTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


@torch.compiler.nested_compile_region
def _compiled_once(layer: nn.Module, x: torch.Tensor, rope_cos_sin: tuple[torch.Tensor, torch.Tensor],
                   kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One decoder layer, which torch.compile compiles once and calls for every layer: the
    layers differ only in tensors (weights, caches, the ids the native ops take), which the
    compiled layer takes as inputs. No metadata: compiled attention reads the step from the
    forward context (models.attention)."""
    return layer(x, rope_cos_sin, kv_cache, None)


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
        self.is_first_stage, self.is_last_stage = parallel_state.is_first_stage(), parallel_state.is_last_stage()
        self.start_layer, self.end_layer = parallel_state.pipeline_layer_range(
            cfg.num_hidden_layers, parallel_state.get_pp_rank(), parallel_state.get_pp_size())
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
                             if self.is_first_stage else None)
        self.rope = build_rope(cfg)
        # layers[i] is the model's layer start_layer + i.
        self.layers = nn.ModuleList(self.decoder_layer_cls(cfg, i) for i in range(self.start_layer, self.end_layer))
        self.norm = (RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.norm_weight_offset)
                     if self.is_last_stage else None)
        # Tied embeddings reuse embed_tokens as the head where this stage has it; a last
        # stage without it loads its own copy of the embedding as the head.
        head_is_embedding = cfg.tie_word_embeddings and self.embed_tokens is not None
        self.lm_head = (ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
                        if self.is_last_stage and not head_is_embedding else None)
        # The head's weight packed for the CPU's matmul units (models.prepacked_linear); None: use the weight.
        self.prepacked_head: nn.Module | None = None
        # [vocab_size, hidden_size // 32 * 34] uint8: the head as a GGUF stores it in Q8_0, for
        # decode steps of the packed head (left by quantization gguf); None: the dense weight.
        self.head_q8_0_blocks: torch.Tensor | None = None
        # Whether torch.compile compiles one decoder layer for all (set by the compiled path
        # where it traces with static shapes: dynamo's layer reuse fails with all dims dynamic).
        self.compile_layer_once = False

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, num_layers: int | None = None,
                hidden_states: torch.Tensor | None = None, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> hidden states [num_tokens, hidden_size]:
        normed on the last pipeline stage, the raw residual stream on the others.

        kv_caches: one (K, V) per layer of this stage. num_layers: run only the first
        num_layers layers, then the final norm (an early exit, as a speculative draft);
        None: all of them. hidden_states: the previous stage's output (not the first stage).
        keep_rows [num_kept] int64 (the last stage only): the rows whose hidden states the
        caller reads, in the order it wants them; the output is then [num_kept, hidden_size].
        The last layer writes every token's K/V and attends for every token, then projects
        and runs its MLP over those rows alone: a prompt chunk's other rows feed nothing
        after it (SmolLM2's 30 layers: ~2.8% of a prompt token's linear FLOPs)."""
        if keep_rows is not None and not self.is_last_stage:
            raise ValueError("keep_rows is for the last pipeline stage: the next stage reads every row")
        x = self.embed(input_ids) if hidden_states is None else hidden_states
        rope_cos_sin = self.rope.cos_sin(positions, x.dtype)
        compile_layer_once = self.compile_layer_once and torch.compiler.is_compiling()
        layers = self.layers[:num_layers]
        last = len(layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches[:num_layers])):
            if keep_rows is not None and i == last:
                # Compiled on its own: the compiled-once layer takes no keep_rows.
                x = layer(x, rope_cos_sin, kv_cache, None if compile_layer_once else meta, keep_rows)
            elif compile_layer_once:
                x = _compiled_once(layer, x, rope_cos_sin, kv_cache)
            else:
                x = layer(x, rope_cos_sin, kv_cache, meta)
        return x if self.norm is None else self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_seqs, hidden_size] -> logits [num_seqs, vocab_size] in fp32 (on every
        TP rank of the last stage: each computes its vocabulary slice, then they gather)."""
        if self.prepacked_head is not None:
            logits = self.prepacked_head(hidden)[:, :self.config.vocab_size].float()
        else:
            head = self.embed_tokens if self.lm_head is None else self.lm_head
            logits = parallel_logits(hidden, head.weight, self.config.vocab_size, head.tp_size).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def compute_argmax_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [num_seqs, hidden_size] -> logits [num_seqs, vocab_size] whose rows have
        compute_logits' argmax, in the packed head's own dtype: its fp32 copy (12.6 MB at 64
        rows of a 49k bf16 vocabulary) changes no argmax, the widening being exact. None where
        that does not hold or save anything (no packed head, or soft-capping, whose rounding
        can tie values the head told apart)."""
        if self.prepacked_head is None or self.config.final_logit_softcapping is not None:
            return None
        return self.prepacked_head(hidden)[:, :self.config.vocab_size]

    def _local_name(self, name: str) -> str | None:
        """A checkpoint name -> this model's parameter name (packed pieces not yet renamed);
        None for a weight another pipeline stage (or nobody) holds."""
        name = name.removeprefix("model.")
        if "rotary_emb" in name:
            return None
        if name == "lm_head.weight":
            return None if self.config.tie_word_embeddings or self.lm_head is None else name
        if name == "embed_tokens.weight" and self.embed_tokens is None:
            tied_head = self.config.tie_word_embeddings and self.lm_head is not None
            return "lm_head.weight" if tied_head else None
        if name.startswith("norm.") and self.norm is None:
            return None
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            if not self.start_layer <= int(index) < self.end_layer:
                return None
            return f"layers.{int(index) - self.start_layer}.{rest}"
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors: this stage's weights, each cut to this rank's shard and
        packed into our fused params where the checkpoint splits them."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            local_name = self._local_name(name)
            if local_name is None:
                continue
            parts = local_name.split(".")
            shard = None
            if len(parts) >= 2 and parts[-2] in self.packed_weights:
                parts[-2], shard = self.packed_weights[parts[-2]]
            target = ".".join(parts)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {self.config.architecture}")
            param = params[target]
            module_name, _, param_name = target.rpartition(".")
            load_shard = getattr(modules[module_name], "load_weight", None)
            try:
                if load_shard is not None:
                    load_shard(param_name, tensor, shard)
                elif param.shape != tensor.shape:
                    raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
                else:
                    param.data.copy_(tensor)
            except ValueError as e:
                raise ValueError(f"weight {name!r} has {e}") from None
            loaded.add(f"{target}:{shard}")
        num_shards = {}
        for packed_name, shard in self.packed_weights.values():
            num_shards[packed_name] = max(num_shards.get(packed_name, 0), shard + 1)
        expected = sum(num_shards.get(n.split(".")[-2], 1) for n in params)
        if len(loaded) != expected:
            missing = sorted(n for n in params if not any(k.startswith(n + ":") for k in loaded))
            raise ValueError(f"checkpoint incomplete: loaded {len(loaded)} of {expected} weight pieces; "
                             f"missing {missing[:5]}")

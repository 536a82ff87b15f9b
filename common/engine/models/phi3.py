"""Phi-3 / Phi-4-mini: Llama with q/k/v and gate/up already fused in the checkpoint.

Its longrope RoPE scaling and partial rotary dims live in the shared rotary module.
"""
from __future__ import annotations

from common.engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_weights = {}  # qkv_proj and gate_up_proj load as they are

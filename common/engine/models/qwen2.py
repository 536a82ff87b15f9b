"""Qwen2 / Qwen2.5: Llama with biases on the q/k/v projections (ModelConfig.qkv_bias)."""
from __future__ import annotations

from common.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass

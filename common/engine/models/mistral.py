"""Mistral: Llama with a sliding window on every layer (config.json `sliding_window`).

The window lives in ModelConfig.layer_sliding_windows and the attention path applies
it, so nothing here differs from Llama but the name.
"""
from __future__ import annotations

from common.engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass

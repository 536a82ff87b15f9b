"""Which module serves which architecture, keyed by config.json's `architectures`.

Torch-free on purpose: config parsing (and the gateway, through it) checks names here
without importing any model; `model_class` imports the family module on demand.
"""
from __future__ import annotations

import importlib

# HF architecture -> (module under common.engine.models, class name).
MODEL_FAMILIES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
}
SUPPORTED_ARCHITECTURES = tuple(MODEL_FAMILIES)

# config.json `model_type` (also GGUF's general.architecture) -> architecture, for
# configs without an `architectures` list.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}


class UnsupportedArchitectureError(ValueError):
    pass


def check_architecture(architecture: str) -> None:
    if architecture not in MODEL_FAMILIES:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def model_class(architecture: str) -> type:
    """The nn.Module class serving `architecture` (its constructor takes a ModelConfig)."""
    check_architecture(architecture)
    module_name, class_name = MODEL_FAMILIES[architecture]
    module = importlib.import_module(f"common.engine.models.{module_name}")
    return getattr(module, class_name)

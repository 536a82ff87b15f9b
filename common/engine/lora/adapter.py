"""One PEFT LoRA adapter read from its directory (adapter_config.json and
adapter_model.safetensors; a pickled adapter_model.bin is refused), checked against the
base model: its targets among the decoder's linears, its rank within max_lora_rank, each
matrix the shape the layer needs.

A target linear's output is x W^T + scaling * (x A^T) B^T, A [r, in_features] and
B [out_features, r], scaling lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from common.engine.config import ModelConfig

# The PEFT modules an adapter may target: a Llama layer's seven linears, and the fused
# qkv_proj and gate_up_proj of checkpoints that store them fused (Phi-3).
LLAMA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGET_MODULES = LLAMA_TARGET_MODULES + ("qkv_proj", "gate_up_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAAdapter:
    """An adapter's matrices by (layer index, PEFT module name): (A [r, in], B [out, r]); and
    as the model's fused linears take them (layers.stack_adapter), also as packed linears
    where those are faster (bf16 on the CPU)."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    stacked: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    packed: dict[tuple[int, str], tuple[torch.nn.Module, torch.nn.Module]] = field(default_factory=dict)
    native_id: int | None = None  # its id with the native decode loop, where registered there


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module of one decoder layer."""
    q_out, kv_out = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"q_proj": (cfg.hidden_size, q_out), "k_proj": (cfg.hidden_size, kv_out),
            "v_proj": (cfg.hidden_size, kv_out), "o_proj": (q_out, cfg.hidden_size),
            "gate_proj": (cfg.hidden_size, cfg.intermediate_size), "up_proj": (cfg.hidden_size, cfg.intermediate_size),
            "down_proj": (cfg.intermediate_size, cfg.hidden_size),
            "qkv_proj": (cfg.hidden_size, q_out + 2 * kv_out),
            "gate_up_proj": (cfg.hidden_size, 2 * cfg.intermediate_size)}


def load_adapter(name: str, path: str, cfg: ModelConfig, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device) -> LoRAAdapter:
    """The adapter at `path`, or ValueError saying what about it this model cannot serve."""
    directory = Path(path)
    config_file, weights_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {path} (a PEFT adapter directory)")
    if not weights_file.is_file():
        pickled = (directory / "adapter_model.bin").exists()
        found = " (adapter_model.bin is pickle, which is not loaded: save it with safetensors)" if pickled else ""
        raise ValueError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path}{found}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json is not JSON: {e}") from None
    rank, scaling = _rank_and_scaling(name, config, max_lora_rank)
    shapes = module_shapes(cfg)
    adapter = LoRAAdapter(name, str(directory), rank, scaling)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_file), framework="pt", device="cpu") as f:
        for key in f.keys():
            match = _KEY.match(key)
            if match is None or match.group(3) not in TARGET_MODULES:
                raise ValueError(f"LoRA adapter {name!r}: {key} is not a LoRA matrix of a decoder layer's "
                                 f"{', '.join(TARGET_MODULES)} (embeddings, the LM head and extra modules are "
                                 f"not served)")
            layer, module, half = int(match.group(1)), match.group(3), match.group(4)
            if layer >= cfg.num_hidden_layers:
                raise ValueError(f"LoRA adapter {name!r}: {key} is for layer {layer}; the model has "
                                 f"{cfg.num_hidden_layers}")
            halves.setdefault((layer, module), {})[half] = f.get_tensor(key)
    if not halves:
        raise ValueError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA matrices")
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {module} has lora_{''.join(pair)} only")
        in_features, out_features = shapes[module]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {module} has A {list(a.shape)} and B "
                             f"{list(b.shape)}; this model needs [{rank}, {in_features}] and [{out_features}, {rank}] "
                             f"(an adapter of another base model?)")
        adapter.weights[(layer, module)] = (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
    return adapter


def _rank_and_scaling(name: str, config: dict, max_lora_rank: int) -> tuple[int, float]:
    def refuse(what: str) -> ValueError:
        return ValueError(f"LoRA adapter {name!r}: {what}")
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse(f"r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise refuse(f"rank {rank} is above max_lora_rank {max_lora_rank} (raise --max-lora-rank)")
    if config.get("bias", "none") != "none":
        raise refuse(f"bias {config.get('bias')!r} is not served (only 'none')")
    if config.get("use_dora"):
        raise refuse("DoRA (use_dora) is not served")
    if config.get("modules_to_save"):
        raise refuse(f"modules_to_save {config['modules_to_save']} are not served (full copies of modules)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise refuse("per-module rank_pattern / alpha_pattern are not served")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise refuse(f"lora_alpha must be a number, got {alpha!r}")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)

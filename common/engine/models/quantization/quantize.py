"""Swap a loaded model's projection linears for quantized ones, found by name.

Only qkv_proj, o_proj, gate_up_proj and down_proj change; the embedding (and the LM head
tied to it in SmolLM2) and the norms stay dense in the model's dtype. With gguf, the
file's own Q8_0 head (SmolLM2's token embedding) is kept beside it for the compiled CPU
path's decode steps (models/prepacked_linear.py): the dense weight is its dequantization,
so the logits are the same up to summation order, from a quarter of fp32's bytes.
"""
from __future__ import annotations

import logging
import re

import torch
from torch import nn

from common.engine.models.quantization.cpu_kernels import (
    INT4_KERNEL,
    INT8_KERNEL,
    KERNEL_DTYPE,
    int4_kernel_available,
    int8_kernel_available,
)
from common.engine.models.quantization.gguf_blocks import GGUFQuantizedWeights
from common.engine.models.quantization.int8_linear import Int8Linear
from common.engine.models.quantization.q4_1_linear import Q4_1Linear
from common.engine.models.quantization.spec import QuantizationSpec

logger = logging.getLogger(__name__)

PROJECTION_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def full_projection_shape(cfg, projection: str) -> tuple[int, int]:
    """[out_features, in_features] of an unsharded projection."""
    q_size = cfg.num_attention_heads * cfg.head_dim
    kv_size = cfg.num_key_value_heads * cfg.head_dim
    return {"qkv_proj": (q_size + 2 * kv_size, cfg.hidden_size), "o_proj": (cfg.hidden_size, q_size),
            "gate_up_proj": (2 * cfg.intermediate_size, cfg.hidden_size),
            "down_proj": (cfg.hidden_size, cfg.intermediate_size)}[projection]


def projection_modules(model: nn.Module) -> list[tuple[str, int, str]]:
    """(module name, layer index, projection name) of every projection to quantize."""
    found = []
    for name, _ in model.named_modules():
        projection = name.rsplit(".", 1)[-1]
        match = _LAYER_INDEX.search(name)
        if projection in PROJECTION_NAMES and match:
            found.append((name, int(match.group(1)), projection))
    return found


def quantize_model(model: nn.Module, spec: QuantizationSpec) -> None:
    """Replace the projections in place; their float weights are freed with the old modules."""
    gguf = GGUFQuantizedWeights(spec.gguf_path) if spec.method == "gguf" else None
    targets = projection_modules(model)
    if not targets:
        raise ValueError(f"quantization {spec.method}: no projection ({', '.join(PROJECTION_NAMES)}) in the model")
    device = None
    for name, layer_idx, projection in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        weight, bias = old.weight, getattr(old, "bias", None)
        device = weight.device
        expected = full_projection_shape(model.config, projection)
        if tuple(weight.shape) != expected:
            raise ValueError(f"quantization {spec.method}: {name} has weight {tuple(weight.shape)}, not the whole "
                             f"{expected}; quantized projections do not support tensor parallelism")
        if gguf is not None:
            blocks = gguf.projection(layer_idx, projection)
            if blocks.shape != expected:
                raise ValueError(f"{spec.gguf_path}: layer {layer_idx} {projection} is {blocks.shape} in the GGUF, "
                                 f"{expected} in the model")
            new = Q4_1Linear(blocks, bias, device, dtype=weight.dtype)
        else:
            new = Int8Linear(weight, bias)
        setattr(parent, attr, new)
        del old, weight
    head_note = ""
    if gguf is not None:
        model.head_q8_0_blocks = _gguf_head(model, gguf)
        if model.head_q8_0_blocks is not None:
            head_note = " (decode steps' head: the GGUF's Q8_0 blocks where the CPU GEMV runs)"
    logger.info("quantization %s: %d projections as %s via %s; embedding and LM head stay %s%s",
                spec.method, len(targets), "Q4_1" if gguf is not None else "int8 per-channel",
                _path_name(spec.method, device, new), _dense_dtype(model), head_note)


def _gguf_head(model: nn.Module, gguf: GGUFQuantizedWeights) -> torch.Tensor | None:
    """The GGUF's Q8_0 head rows [vocab_size, hidden_size // 32 * 34] where they match the
    model's whole head on CPU; None otherwise (the dense head serves every step)."""
    head = model.embed_tokens if getattr(model, "lm_head", None) is None else model.lm_head
    if head is None or getattr(head, "tp_size", 1) != 1 or head.weight.device.type != "cpu":
        return None
    blocks = gguf.head_q8_0()
    if blocks is None or blocks.shape != tuple(head.weight.shape):
        return None
    return blocks.raw()


def _path_name(method: str, device: torch.device, linear: nn.Module) -> str:
    """Which kernels the quantized projections (of which `linear` is one) take."""
    kernel_dtype = str(KERNEL_DTYPE).removeprefix("torch.")
    torch_kernel = f"torch {INT4_KERNEL if method == 'gguf' else INT8_KERNEL} in {kernel_dtype}"
    blocks = linear.blocks if isinstance(linear, Q4_1Linear) else linear.q8_0_blocks
    torch_copy = linear.packed if isinstance(linear, Q4_1Linear) else linear.codes
    if blocks is not None and torch_copy is None:
        return "the native GEMV over GGUF blocks for decode steps, the blocks widened to bf16 for the others"
    if blocks is not None:
        return f"the native GEMV over GGUF blocks for decode steps, {torch_kernel} for the others"
    if (int4_kernel_available if method == "gguf" else int8_kernel_available)(device.type):
        return torch_kernel
    return "per-call dequantization (no torch kernel for this device/build)"


def _dense_dtype(model: nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")

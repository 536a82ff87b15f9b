"""The decoder's linears with their adapters' deltas: LoRALinear wraps one (qkv_proj,
o_proj, gate_up_proj, down_proj) and, for each adapter the step's rows use, adds
scaling * (x A^T) B^T to those rows' columns of each of its pieces (qkv_proj's q, k and v;
gate_up_proj's gate and up). Which rows use which adapter is the step's (lora_step), set by
the runner around the forward pass as the attention metadata is."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

from common.engine.config import ModelConfig
from common.engine.lora.adapter import LoRAAdapter

_local = threading.local()


@contextlib.contextmanager
def lora_step(groups: list[tuple[LoRAAdapter, torch.Tensor]]) -> Iterator[None]:
    """For one forward pass: each adapter in use with its rows, [num_rows] int64 each."""
    previous = getattr(_local, "groups", None)
    _local.groups = groups
    try:
        yield
    finally:
        _local.groups = previous


def _current_groups() -> list[tuple[LoRAAdapter, torch.Tensor]]:
    return getattr(_local, "groups", None) or []


class LoRALinear(nn.Module):
    """base(x) plus each adapter's delta on its rows; pieces: (PEFT module name, first output
    column, number of columns) of the base's output."""

    def __init__(self, base: nn.Module, layer_idx: int, pieces: list[tuple[str, int, int]]):
        super().__init__()
        self.base = base
        self.layer_idx = layer_idx
        self.pieces = pieces

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [num_tokens, in_features]
        y = self.base(x)  # [num_tokens, out_features]
        for adapter, rows in _current_groups():
            x_rows = None
            for module, first, num_columns in self.pieces:
                pair = adapter.weights.get((self.layer_idx, module))
                if pair is None:  # not one of this adapter's targets
                    continue
                a, b = pair  # [r, in_features], [num_columns, r]
                if x_rows is None:
                    x_rows = x.index_select(0, rows)  # [num_rows, in_features]
                delta = (x_rows @ a.t()) @ b.t()  # [num_rows, num_columns]
                y[rows, first:first + num_columns] += adapter.scaling * delta
        return y


def wrap_linears(model: nn.Module, cfg: ModelConfig) -> int:
    """Every decoder layer's linears wrapped in LoRALinear (one rank: no tensor parallelism);
    the number wrapped."""
    q_out, kv_out = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size
    layouts = {
        ("self_attn", "qkv_proj"): [("q_proj", 0, q_out), ("k_proj", q_out, kv_out),
                                    ("v_proj", q_out + kv_out, kv_out)],
        ("self_attn", "o_proj"): [("o_proj", 0, cfg.hidden_size)],
        ("mlp", "gate_up_proj"): [("gate_proj", 0, inter), ("up_proj", inter, inter)],
        ("mlp", "down_proj"): [("down_proj", 0, cfg.hidden_size)],
    }
    num_wrapped = 0
    for offset, layer in enumerate(model.layers):
        for (block_name, linear_name), pieces in layouts.items():
            block = getattr(layer, block_name)
            base = getattr(block, linear_name)
            setattr(block, linear_name, LoRALinear(base, model.start_layer + offset, pieces))
            num_wrapped += 1
    return num_wrapped

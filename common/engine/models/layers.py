"""Layers every family shares: RMSNorm and the gated MLP (tensor-parallel over its columns)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.models.parallel_layers import MergedColumnParallelLinear, RowParallelLinear

# config.json activation names -> functions (gelu_pytorch_tanh is Gemma's GeGLU).
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class RMSNorm(nn.Module):
    """x / rms(x) * (weight + weight_offset); Gemma stores weight - 1 (weight_offset 1)."""

    def __init__(self, hidden_size: int, eps: float, weight_offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.weight_offset = weight_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight_offset == 0.0:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        # Normalise half types in fp32 like the reference, so bf16 stays stable.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            # Gemma scales in fp32 before casting back, unlike Llama.
            return (x32 * (self.weight.float() + self.weight_offset)).to(x.dtype)
        return self.weight * x32.to(x.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up in one matmul; under tensor parallelism
    each rank holds a slice of the intermediate columns and down_proj sums the slices."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r}; supported: {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[activation]
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, intermediate_size)
        self.intermediate_size = self.gate_up_proj.output_size_per_rank
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)

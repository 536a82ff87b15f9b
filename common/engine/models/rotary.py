"""Rotary position embedding with the scaling variants config.json names.

Supported `rope_type`s: default, linear, dynamic, yarn, llama3 and longrope (Phi-3).
Positions never pass max_position_embeddings here, so "dynamic" (NTK scaling that
starts beyond it) is the default table.
"""
from __future__ import annotations

import math

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def _base_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(rotary_dim: int, theta: float, scaling: dict,
                   max_position: int) -> tuple[torch.Tensor, float]:
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = scaling.get("attention_factor")
    if attn_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return rotary_dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    # transformers builds this table in fp32; so do we, to match it bit for bit.
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.double(), float(attn_factor)


def _longrope_attention_factor(scaling: dict, max_position: int) -> float:
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / old_len
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def rope_type_of(scaling: dict | None) -> str:
    return "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))


def _rope_tables(rope_type: str, rotary_dim: int, max_position: int, theta: float,
                 scaling: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin, [max_position, rotary_dim // 2] each."""
    positions = torch.arange(max_position, dtype=torch.float64)
    inv_freq, attn_factor = _base_inv_freq(rotary_dim, theta), 1.0
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq, attn_factor = _yarn_inv_freq(rotary_dim, theta, scaling, max_position)
    if rope_type == "longrope":
        # Short factors within the pretraining length, long ones past it, per
        # position. transformers switches the whole sequence to the long factors
        # once it grows past that length (recomputing its cache), so the two agree
        # only while sequences stay within original_max_position_embeddings.
        attn_factor = _longrope_attention_factor(scaling, max_position)
        old_len = scaling["original_max_position_embeddings"]
        short = inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float64)
        long = inv_freq / torch.tensor(scaling["long_factor"], dtype=torch.float64)
        freqs = torch.where((positions < old_len)[:, None], torch.outer(positions, short),
                            torch.outer(positions, long))
    else:
        freqs = torch.outer(positions, inv_freq)  # [max_position, rotary_dim // 2]
    return (freqs.cos() * attn_factor).float(), (freqs.sin() * attn_factor).float()


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_position), over the first rotary_dim dims of a head."""

    def __init__(self, rotary_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        rope_type = rope_type_of(scaling)
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        self.rotary_dim = rotary_dim
        # Computed on the CPU, then placed on the default device. Models are built on the
        # meta device before loading (the runner then builds these tables on the real
        # one): there torch runs these ops through Python decompositions that import
        # torch._dynamo, seconds of every eager process's start-up.
        with torch.device("cpu"):
            cos, sin = _rope_tables(rope_type, rotary_dim, max_position, theta, scaling)
        device = torch.get_default_device()
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Looked up once per step and shared by every layer: [num_tokens, 1, rotary_dim // 2] each."""
        return (self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim] in rotate-half layout; dims past 2 * cos.shape[-1]
    (partial rotary, e.g. Phi-4-mini) pass through unrotated."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((apply_rope(x_rot, cos, sin), x_pass), dim=-1)

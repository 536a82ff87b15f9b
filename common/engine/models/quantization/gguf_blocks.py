"""A GGUF file's quantized weights as stored: packed rows, never dequantized at load.

Q4_1 (the projections) stores each row in blocks of 32 columns: fp16 d, fp16 m, then 16
bytes of nibbles (byte j holds column j in its low nibble and column j + 16 in its high
one); the weight is d * q + m. Q8_0 (SmolLM2's token embedding, which is also its head)
stores fp16 d and 32 int8 codes; the weight is d * q. The converter (transformers)
un-permutes the q and k rows that llama.cpp permuted for its RoPE layout; that is a pure
row permutation, so it is applied here to the packed rows and the fused projections are
row concatenations of the GGUF tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

Q4_1_BLOCK_SIZE = 32
Q4_1_BLOCK_BYTES = 2 + 2 + Q4_1_BLOCK_SIZE // 2
Q8_0_BLOCK_SIZE = 32
Q8_0_BLOCK_BYTES = 2 + Q8_0_BLOCK_SIZE

# Our fused projection -> the GGUF tensors whose rows it concatenates, in order.
GGUF_PROJECTION_TENSORS = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}
# GGUF architectures whose q/k rows the converter un-permutes (transformers' LlamaTensorProcessor).
PERMUTED_QK_ARCHITECTURES = ("llama",)


@dataclass
class Q4_1Blocks:
    """One [N, K] matrix in Q4_1, split into its block fields."""

    d: torch.Tensor  # [N, K // 32] fp16 scales
    m: torch.Tensor  # [N, K // 32] fp16 minimums
    nibbles: torch.Tensor  # [N, K // 32, 16] uint8: column j low nibble, column j + 16 high nibble

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * Q4_1_BLOCK_SIZE

    @classmethod
    def from_raw(cls, raw: torch.Tensor) -> "Q4_1Blocks":
        """raw [N, K // 32 * 20] uint8, as GGUFReader's tensor.data holds it."""
        blocks = raw.reshape(raw.shape[0], -1, Q4_1_BLOCK_BYTES)  # [N, K // 32, 20]
        d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
        m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
        return cls(d=d, m=m, nibbles=blocks[..., 4:].contiguous())

    def raw(self) -> torch.Tensor:
        """[N, K // 32 * 20] uint8: the rows as the file stores them (from_raw's input)."""
        d = self.d.view(torch.uint8).reshape(*self.d.shape, 2)
        m = self.m.view(torch.uint8).reshape(*self.m.shape, 2)
        return torch.cat([d, m, self.nibbles], dim=-1).reshape(self.shape[0], -1)

    @classmethod
    def cat(cls, parts: list["Q4_1Blocks"]) -> "Q4_1Blocks":
        return cls(d=torch.cat([p.d for p in parts]), m=torch.cat([p.m for p in parts]),
                   nibbles=torch.cat([p.nibbles for p in parts]))

    def codes(self) -> torch.Tensor:
        """[N, K] uint8 in 0..15, column order."""
        low = self.nibbles & 0x0F
        high = self.nibbles >> 4
        return torch.cat([low, high], dim=-1).reshape(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] d * q + m, computed in fp32 as gguf.quants does, then cast."""
        n, num_blocks = self.d.shape
        codes = self.codes().view(n, num_blocks, Q4_1_BLOCK_SIZE).float()
        w = self.d.float().unsqueeze(-1) * codes + self.m.float().unsqueeze(-1)
        return w.reshape(self.shape).to(dtype)


@dataclass
class Q8_0Blocks:
    """One [N, K] matrix in Q8_0, split into its block fields."""

    d: torch.Tensor  # [N, K // 32] fp16 scales
    codes: torch.Tensor  # [N, K // 32, 32] int8

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * Q8_0_BLOCK_SIZE

    @classmethod
    def from_raw(cls, raw: torch.Tensor) -> "Q8_0Blocks":
        """raw [N, K // 32 * 34] uint8, as GGUFReader's tensor.data holds it."""
        blocks = raw.reshape(raw.shape[0], -1, Q8_0_BLOCK_BYTES)  # [N, K // 32, 34]
        d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
        return cls(d=d, codes=blocks[..., 2:].contiguous().view(torch.int8))

    def raw(self) -> torch.Tensor:
        """[N, K // 32 * 34] uint8: the rows as the file stores them (from_raw's input)."""
        d = self.d.view(torch.uint8).reshape(*self.d.shape, 2)
        return torch.cat([d, self.codes.view(torch.uint8)], dim=-1).reshape(self.shape[0], -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] d * q, computed in fp32 as gguf.quants does, then cast."""
        w = self.d.float().unsqueeze(-1) * self.codes.float()
        return w.reshape(self.shape).to(dtype)


def unpermute_qk_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head RoPE row interleave; rows [N, ...] of any element type."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


class GGUFQuantizedWeights:
    """The projection tensors of one GGUF file, as raw blocks (memory-mapped by GGUFReader)."""

    def __init__(self, path: Path):
        from gguf import GGUFReader
        self.path = Path(path)
        self.reader = GGUFReader(str(self.path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.architecture = self._field("general.architecture")
        self.num_heads = int(self._field(f"{self.architecture}.attention.head_count"))
        self.num_kv_heads = int(self._field(f"{self.architecture}.attention.head_count_kv", self.num_heads))

    def _field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            if default is None:
                raise ValueError(f"{self.path}: GGUF metadata has no {key!r}")
            return default
        value = field.parts[field.data[0]]
        return bytes(value).decode() if value.dtype == np.uint8 else value[0]

    def tensor_type(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def raw_rows(self, name: str) -> torch.Tensor:
        """[N, bytes per row] uint8, with q/k rows in the converter's (HF) order."""
        if name not in self.tensors:
            raise ValueError(f"{self.path}: no tensor {name!r}")
        rows = torch.from_numpy(np.array(self.tensors[name].data, dtype=np.uint8))
        if self.architecture in PERMUTED_QK_ARCHITECTURES:
            if ".attn_q." in name:
                rows = unpermute_qk_rows(rows, self.num_heads)
            elif ".attn_k." in name:
                rows = unpermute_qk_rows(rows, self.num_kv_heads)
        return rows

    def q4_1(self, name: str) -> Q4_1Blocks:
        kind = self.tensor_type(name)
        if kind != "Q4_1":
            raise NotImplementedError(f"{self.path}: tensor {name!r} is {kind}; quantization gguf serves Q4_1 "
                                      f"projections only (use quantization int8 for this model)")
        return Q4_1Blocks.from_raw(self.raw_rows(name))

    def head_q8_0(self) -> Q8_0Blocks | None:
        """The LM head as stored where it is Q8_0: `output.weight`, else the token embedding
        it is tied to; None for any other type."""
        name = "output.weight" if "output.weight" in self.tensors else "token_embd.weight"
        if name not in self.tensors or self.tensor_type(name) != "Q8_0":
            return None
        return Q8_0Blocks.from_raw(self.raw_rows(name))

    def projection(self, layer_idx: int, projection: str) -> Q4_1Blocks:
        """Our fused projection of one layer: the row concatenation of its GGUF tensors."""
        return Q4_1Blocks.cat([self.q4_1(f"blk.{layer_idx}.{t}.weight")
                               for t in GGUF_PROJECTION_TENSORS[projection]])

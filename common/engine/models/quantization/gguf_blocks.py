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

import struct
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


# GGUF metadata value types (gguf.GGUFValueType) -> struct format of one value; 8 is a
# string (uint64 length + bytes), 9 an array (uint32 item type, uint64 count, items).
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# Tensor types that gguf.GGUFReader gives as their own element type; it gives any other
# (the quantized ones, bf16) as the bytes of each row.
_GGUF_PLAIN_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                     "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file; data as gguf.GGUFReader gives it (for a quantized type,
    [rows, bytes per row] uint8), memory-mapped."""

    name: str
    tensor_type: "gguf.GGMLQuantizationType"  # noqa: F821
    data: np.ndarray


def read_gguf(path: Path) -> tuple[dict[str, object], dict[str, GGUFTensor]]:
    """The scalar and string metadata of a little-endian GGUF file (arrays are skipped)
    and its tensors. gguf.GGUFReader parses every metadata item into numpy views,
    the tokenizer's ~100k vocabulary and merge strings included: 3-4 s for the bundled
    135M model, where this reads the same header in ~0.04 s. A file that is cut short or
    malformed raises ValueError naming it."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if Path(path).stat().st_size == 0:
        raise ValueError(f"{path}: empty, not a GGUF file")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buffer = memoryview(data)
    offset = 0

    def truncated(what: str) -> ValueError:
        return ValueError(f"{path}: cut short or malformed GGUF file ({what} past its {data.size} bytes)")

    def unpack(fmt: str):
        nonlocal offset
        try:
            values = struct.unpack_from(fmt, buffer, offset)
        except struct.error:
            raise truncated(f"a header field at byte {offset}") from None
        offset += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def string() -> str:
        nonlocal offset
        length = unpack("<Q")
        if offset + length > data.size:
            raise truncated(f"a {length}-byte string at byte {offset}")
        offset += length
        try:
            return bytes(buffer[offset - length:offset]).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{path}: a GGUF string at byte {offset - length} is not UTF-8") from None

    def skip_array(depth: int = 0) -> None:
        nonlocal offset
        if depth > 16:  # GGUF writers nest arrays a level or two; more is a malformed file
            raise ValueError(f"{path}: GGUF arrays nested deeper than 16 levels at byte {offset}")
        item_type, count = unpack("<IQ")
        if item_type in _GGUF_SCALARS:
            offset += count * struct.calcsize(_GGUF_SCALARS[item_type])
        elif item_type == _GGUF_STRING:
            for _ in range(count):
                length = unpack("<Q")
                offset += length
        elif item_type == _GGUF_ARRAY:
            for _ in range(count):
                skip_array(depth + 1)
        else:
            raise ValueError(f"{path}: unknown GGUF array item type {item_type}")

    magic, version = unpack("<4sI")
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (a big-endian file, or not 2 or 3) is not supported")
    num_tensors, num_fields = unpack("<QQ")
    metadata: dict[str, object] = {}
    for _ in range(num_fields):
        key = string()
        value_type = unpack("<I")
        if value_type in _GGUF_SCALARS:
            metadata[key] = unpack(_GGUF_SCALARS[value_type])
        elif value_type == _GGUF_STRING:
            metadata[key] = string()
        elif value_type == _GGUF_ARRAY:
            skip_array()
        else:
            raise ValueError(f"{path}: unknown GGUF value type {value_type} for {key!r}")
    infos = []
    for _ in range(num_tensors):
        name = string()
        num_dims = unpack("<I")
        dims = unpack(f"<{num_dims}Q") if num_dims != 1 else (unpack("<Q"),)
        tensor_type, data_offset = unpack("<IQ")
        try:
            tensor_type = GGMLQuantizationType(tensor_type)
        except ValueError:
            raise ValueError(f"{path}: tensor {name!r} has unknown GGML type {tensor_type}") from None
        infos.append((name, dims, tensor_type, data_offset))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-offset // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, tensor_type, data_offset in infos:
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        shape = tuple(reversed(dims))  # GGUF lists the fastest-varying dimension first
        num_bytes = int(np.prod(shape, dtype=np.int64)) * type_size // block_size
        if start + data_offset + num_bytes > data.size:
            raise truncated(f"tensor {name!r}'s {num_bytes} bytes at byte {start + data_offset}")
        raw = data[start + data_offset:start + data_offset + num_bytes]
        element_type = _GGUF_PLAIN_TYPES.get(tensor_type.name)
        if element_type is not None:
            array = raw.view(element_type).reshape(shape)
        else:  # quantized (and bf16): the bytes of each row
            array = raw.reshape(*shape[:-1], shape[-1] // block_size * type_size)
        tensors[name] = GGUFTensor(name, tensor_type, array)
    return metadata, tensors


class GGUFQuantizedWeights:
    """The projection tensors of one GGUF file, as raw blocks (memory-mapped)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.metadata, self.tensors = read_gguf(self.path)
        self.architecture = self._field("general.architecture")
        self.num_heads = int(self._field(f"{self.architecture}.attention.head_count"))
        self.num_kv_heads = int(self._field(f"{self.architecture}.attention.head_count_kv", self.num_heads))

    def _field(self, key: str, default=None):
        value = self.metadata.get(key)
        if value is None:
            if default is None:
                raise ValueError(f"{self.path}: GGUF metadata has no {key!r}")
            return default
        return value

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

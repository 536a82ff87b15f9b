"""The reader's packed Q4_1 rows and Q8_0 head are the GGUF's own weights (as gguf's own
GGUFReader reads them), in the converter's row order."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFValueType
from gguf.quants import dequantize

from common.engine.models.quantization.cpu_kernels import int4_kernel_available
from common.engine.models.quantization.gguf_blocks import (
    GGUF_PROJECTION_TENSORS,
    Q4_1Blocks,
    Q8_0Blocks,
    read_gguf,
    unpermute_qk_rows,
)
from common.engine.models.quantization.q4_1_linear import Q4_1Linear

LAYERS = (0, 14, 29)


def gguf_reference(reference_tensors, reader, layer_idx: int, projection: str) -> torch.Tensor:
    """gguf's own dequantization of the projection's tensors, q/k un-permuted as transformers does."""
    parts = []
    for tensor_name in GGUF_PROJECTION_TENSORS[projection]:
        tensor = reference_tensors[f"blk.{layer_idx}.{tensor_name}.weight"]
        weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
        if tensor_name == "attn_q":
            weight = unpermute_qk_rows(weight, reader.num_heads)
        elif tensor_name == "attn_k":
            weight = unpermute_qk_rows(weight, reader.num_kv_heads)
        parts.append(weight)
    return torch.cat(parts)


@pytest.mark.parametrize("layer_idx", LAYERS)
@pytest.mark.parametrize("projection", list(GGUF_PROJECTION_TENSORS))
def test_packed_rows_dequantize_bit_exact_to_gguf(bundled_gguf, reference_tensors, layer_idx, projection):
    blocks = bundled_gguf.projection(layer_idx, projection)
    reference = gguf_reference(reference_tensors, bundled_gguf, layer_idx, projection)
    assert blocks.shape == tuple(reference.shape)
    assert torch.equal(blocks.dequantize(torch.float32), reference)


def test_read_gguf_gives_what_gguf_reader_gives(bundled_gguf, gguf_reader):
    """Every tensor (type, shape, bytes) and every scalar or string metadata item."""
    metadata, tensors = read_gguf(bundled_gguf.path)
    assert list(tensors) == [t.name for t in gguf_reader.tensors]
    for reference in gguf_reader.tensors:
        ours = tensors[reference.name]
        assert ours.tensor_type == reference.tensor_type, reference.name
        assert (ours.data.dtype, ours.data.shape) == (reference.data.dtype, reference.data.shape), reference.name
        assert np.array_equal(ours.data, reference.data), reference.name
    scalars = {}
    for key, field in gguf_reader.fields.items():
        if key.startswith("GGUF."):  # the header, which GGUFReader lists as fields too
            continue
        if field.types[0] == GGUFValueType.STRING:
            scalars[key] = bytes(field.parts[field.data[0]]).decode()
        elif field.types[0] != GGUFValueType.ARRAY:
            scalars[key] = field.parts[field.data[0]][0]
    assert metadata == scalars
    assert "general.architecture" in metadata and "llama.attention.head_count_kv" in metadata


def test_raw_gives_back_the_file_layout(bundled_gguf):
    raw = bundled_gguf.raw_rows("blk.0.ffn_down.weight")
    assert torch.equal(Q4_1Blocks.from_raw(raw).raw(), raw)


def test_packed_rows_match_the_converted_checkpoint(bundled_gguf, bundled_model_dir):
    """What pdserve serves unquantized is transformers' dequantization of the same file."""
    from safetensors import safe_open
    with safe_open(str(bundled_model_dir / "model.safetensors"), framework="pt") as f:
        q_k_v = [f.get_tensor(f"model.layers.3.self_attn.{n}_proj.weight") for n in "qkv"]
    assert torch.equal(bundled_gguf.projection(3, "qkv_proj").dequantize(), torch.cat(q_k_v))


def test_the_q8_0_head_dequantizes_bit_exact_to_gguf_and_the_converted_embedding(bundled_gguf, reference_tensors,
                                                                                  bundled_model_dir):
    """SmolLM2's head is its token embedding, Q8_0 in the file; the dense checkpoint pdserve
    serves holds exactly its dequantization, so the Q8_0 GEMV computes the same logits."""
    from safetensors import safe_open
    head = bundled_gguf.head_q8_0()
    tensor = reference_tensors["token_embd.weight"]
    reference = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
    assert head.shape == tuple(reference.shape) == (49152, 576)
    assert torch.equal(head.dequantize(torch.float32), reference)
    with safe_open(str(bundled_model_dir / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("model.embed_tokens.weight").float(), reference)
    raw = bundled_gguf.raw_rows("token_embd.weight")
    assert torch.equal(Q8_0Blocks.from_raw(raw).raw(), raw)


def test_a_head_of_another_type_is_none(bundled_gguf, monkeypatch):
    monkeypatch.setattr(bundled_gguf, "tensor_type", lambda name: "F16")
    assert bundled_gguf.head_q8_0() is None


def test_unpermute_inverts_llama_cpp_permute():
    num_heads, head_dim = 3, 8
    rows = torch.arange(num_heads * head_dim * 5).reshape(num_heads * head_dim, 5)
    # convert_hf_to_gguf.py's permute: rows (n_head, 2, dim/2) -> (n_head, dim/2, 2).
    permuted = rows.reshape(num_heads, 2, head_dim // 2, 5).swapaxes(1, 2).reshape(rows.shape)
    assert not torch.equal(permuted, rows)
    assert torch.equal(unpermute_qk_rows(permuted, num_heads), rows)


@pytest.mark.skipif(not int4_kernel_available("cpu"), reason="this torch build has no CPU int4 kernel")
def test_int4_packing_reproduces_the_weight(bundled_gguf):
    """torch's packed codes and (scale, zero) give back d * q + m when run in fp32 on the identity."""
    blocks = bundled_gguf.projection(7, "o_proj")
    linear = Q4_1Linear(blocks, None, torch.device("cpu"))
    k = linear.in_features
    d = blocks.d.float().t()  # [K // 32, N]
    scales_and_zeros = torch.stack([d, blocks.m.float().t() + 8 * d], dim=-1).contiguous()
    weight_t = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k), linear.packed, 32, scales_and_zeros)
    reference = blocks.dequantize()
    # m + 8 d is rounded once in fp32: at most a few ulp of the weights' magnitude.
    torch.testing.assert_close(weight_t.t(), reference, rtol=0, atol=1e-6)
    # ...and the bf16 scales the module keeps are those, rounded.
    torch.testing.assert_close(linear.scales_and_zeros.float(), scales_and_zeros, rtol=2 ** -8, atol=0)

"""quantize_model swaps exactly the projections; bad requests fail before any weight is read."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from common.engine.config import EngineConfig, make_engine_config
from common.engine.model_files import bundled_gguf_path
from common.engine.models.quantization import QuantizationSpec, quantization_spec, quantize_model
from common.engine.models.quantization.int8_linear import Int8Linear
from common.engine.models.quantization.quantize import PROJECTION_NAMES
from tests.conftest import load_cpu_model


def test_int8_replaces_every_projection_and_nothing_else(tiny_llama_dir):
    dense = load_cpu_model(tiny_llama_dir)
    model = load_cpu_model(tiny_llama_dir, quantization=QuantizationSpec("int8"))
    quantized = {name for name, m in model.named_modules() if isinstance(m, Int8Linear)}
    expected = {f"layers.{i}.{block}.{p}" for i in range(2)
                for block, p in [("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
                                 ("mlp", "gate_up_proj"), ("mlp", "down_proj")]}
    assert quantized == expected
    # the untied LM head of this tiny model stays dense
    assert model.lm_head.weight.is_floating_point() and not isinstance(model.lm_head, Int8Linear)
    # no float copy of a projection weight survives
    assert not any(name.endswith(PROJECTION_NAMES) and p.is_floating_point()
                   for name, p in model.named_parameters())
    torch.testing.assert_close(model.embed_tokens.weight, dense.embed_tokens.weight, rtol=0, atol=0)
    x = torch.randn(5, dense.config.hidden_size)
    ref = dense.layers[1].mlp(x)
    assert ((model.layers[1].mlp(x) - ref).norm() / ref.norm()).item() < 3e-2


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of gguf, int8"):
        QuantizationSpec("fp4")
    with pytest.raises(ValueError, match="quantization must be one of"):
        make_engine_config(quantization="awq")


def test_gguf_needs_a_gguf_model(tiny_llama_dir):
    with pytest.raises(ValueError, match="not one"):
        quantization_spec(make_engine_config(str(tiny_llama_dir), quantization="gguf"))
    # the bundled model (no --model) and an explicit .gguf file both are
    assert quantization_spec(make_engine_config(quantization="gguf")).gguf_path == bundled_gguf_path()
    spec = quantization_spec(make_engine_config(str(bundled_gguf_path()), quantization="gguf"))
    assert spec.gguf_path == bundled_gguf_path()
    assert quantization_spec(make_engine_config(str(tiny_llama_dir), quantization="int8")) == QuantizationSpec("int8")
    assert quantization_spec(EngineConfig()) is None


@pytest.mark.parametrize("method", ["gguf", "int8"])
def test_tensor_parallel_is_refused(method):
    config = make_engine_config(quantization=method, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        quantization_spec(config)


def test_a_sharded_projection_is_refused(tiny_llama_dir):
    """A rank's slice of a projection (as tensor parallelism leaves it) is not quantized."""
    model = load_cpu_model(tiny_llama_dir)
    qkv = model.layers[0].self_attn.qkv_proj
    model.layers[0].self_attn.qkv_proj = nn.Linear(qkv.in_features, qkv.out_features // 2, bias=False)
    with pytest.raises(ValueError, match="tensor parallelism"):
        quantize_model(model, QuantizationSpec("int8"))


def test_gguf_shapes_must_match_the_model(tiny_llama_dir):
    """The bundled GGUF's blocks cannot stand in for another model's projections."""
    model = load_cpu_model(tiny_llama_dir)
    with pytest.raises(ValueError, match="in the GGUF"):
        quantize_model(model, QuantizationSpec("gguf", bundled_gguf_path()))

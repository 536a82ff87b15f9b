"""Quantized projection weights for the CPU engine: a GGUF's own Q4_1 blocks, or int8 weight-only."""
from common.engine.models.quantization.quantize import quantize_model
from common.engine.models.quantization.spec import QuantizationSpec, quantization_spec

__all__ = ["QuantizationSpec", "quantization_spec", "quantize_model"]

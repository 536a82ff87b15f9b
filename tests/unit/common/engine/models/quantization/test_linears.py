"""Q4_1 and int8 linears against x @ W_deq.T, kernel and fallback paths, fp32 and bf16 inputs.

Tolerances (measured ~3e-3 and ~2e-3): the kernels run in bf16, so their error is bf16
rounding of activations and scales, relative 1e-2 of the output norm; the fp32 fallback
computes the reference's own weight, so 1e-5.
"""
from __future__ import annotations

import pytest
import torch

from common.engine.models.quantization.cpu_kernels import int4_kernel_available, int8_kernel_available
from common.engine.models.quantization.int8_linear import INT8_MAX, Int8Linear, quantize_per_channel
from common.engine.models.quantization.q4_1_linear import Q4_1Linear

NUM_TOKENS = (1, 7, 64)
DTYPES = (torch.float32, torch.bfloat16)
KERNEL_REL_TOL = 1e-2
BF16_REL_TOL = 2e-2
FP32_REL_TOL = 1e-5


def paths(kernel_available: bool) -> list:
    return [pytest.param(None, marks=pytest.mark.skipif(not kernel_available, reason="no CPU kernel here"),
                         id="kernel"), pytest.param(False, id="fallback")]


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference).norm() / reference.norm()).item()


def tolerance(use_kernel, dtype) -> float:
    if use_kernel is None:
        return KERNEL_REL_TOL
    return FP32_REL_TOL if dtype == torch.float32 else BF16_REL_TOL


@pytest.fixture(scope="module")
def gate_up_blocks(bundled_gguf):
    return bundled_gguf.projection(2, "gate_up_proj")


@pytest.mark.parametrize("use_kernel", paths(int4_kernel_available("cpu")))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_q4_1_matmul_matches_dequantized(gate_up_blocks, use_kernel, dtype, num_tokens):
    linear = Q4_1Linear(gate_up_blocks, None, torch.device("cpu"), use_kernel=use_kernel)
    x = torch.randn(num_tokens, linear.in_features, generator=torch.Generator().manual_seed(num_tokens)).to(dtype)
    reference = x.float() @ gate_up_blocks.dequantize().t()  # [num_tokens, N]
    out = linear(x)
    assert out.dtype == dtype and out.shape == reference.shape
    assert relative_error(out, reference) < tolerance(use_kernel, dtype)


def test_q4_1_bias_is_added(gate_up_blocks):
    bias = torch.randn(gate_up_blocks.shape[0])
    x = torch.randn(3, gate_up_blocks.shape[1])
    with_bias = Q4_1Linear(gate_up_blocks, bias, torch.device("cpu"))(x)
    without = Q4_1Linear(gate_up_blocks, None, torch.device("cpu"))(x)
    torch.testing.assert_close(with_bias - without, bias.expand_as(without), rtol=0, atol=1e-5)


def test_quantize_per_channel_is_symmetric_and_within_half_a_step():
    weight = torch.randn(48, 96) * torch.linspace(0.01, 3, 48).unsqueeze(1)
    codes, scales = quantize_per_channel(weight)
    assert codes.dtype == torch.int8 and scales.shape == (48,)
    assert codes.abs().amax(dim=1).eq(INT8_MAX).all()  # each row's largest weight maps to +-127
    assert ((codes.float() * scales.unsqueeze(1) - weight).abs() <= scales.unsqueeze(1) / 2 + 1e-7).all()


@pytest.mark.parametrize("use_kernel", paths(int8_kernel_available("cpu")))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_int8_matmul_matches_dequantized(gate_up_blocks, use_kernel, dtype, num_tokens):
    weight = gate_up_blocks.dequantize()
    linear = Int8Linear(weight, None, use_kernel=use_kernel)
    assert not any(t.is_floating_point() and t.shape == weight.shape for t in linear.state_dict().values())
    x = torch.randn(num_tokens, linear.in_features, generator=torch.Generator().manual_seed(num_tokens)).to(dtype)
    codes, scales = quantize_per_channel(weight)
    reference = x.float() @ (codes.float() * scales.unsqueeze(1)).t()
    out = linear(x)
    assert out.dtype == dtype and out.shape == reference.shape
    assert relative_error(out, reference) < tolerance(use_kernel, dtype)
    # and int8 itself is close to the float weight it replaced
    assert relative_error(out, x.float() @ weight.t()) < 3e-2

"""Whether torch's weight-only CPU matmul kernels run here, probed once on tiny inputs.

They exist only in some builds and only on CPU; the linears fall back to dequantizing
in their forward pass (correct, slower) where a probe fails. Their fp32 paths are ~20x
slower than a dense fp32 matmul here (measured on the bundled model's shapes), their
bf16 paths as fast as dense bf16 at one token: the linears run them in KERNEL_DTYPE.
"""
from __future__ import annotations

import functools

import torch

INT4_KERNEL = "aten._weight_int4pack_mm_for_cpu"
INT8_KERNEL = "aten._weight_int8pack_mm"
KERNEL_DTYPE = torch.bfloat16


@functools.cache
def int4_kernel_available(device_type: str) -> bool:
    if device_type != "cpu":
        return False
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.zeros(32, 64, dtype=torch.int32), 1)
        scales_and_zeros = torch.zeros(2, 32, 2, dtype=KERNEL_DTYPE)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.zeros(1, 64, dtype=KERNEL_DTYPE), packed, 32,
                                                   scales_and_zeros)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


@functools.cache
def int8_kernel_available(device_type: str) -> bool:
    if device_type != "cpu":
        return False
    try:
        codes = torch.zeros(32, 64, dtype=torch.int8)
        torch.ops.aten._weight_int8pack_mm(torch.zeros(1, 64, dtype=KERNEL_DTYPE), codes,
                                           torch.ones(32, dtype=KERNEL_DTYPE))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def kernel_output(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """A weight-only kernel's [num_tokens, N] result back in x's dtype and leading shape, plus bias."""
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out_features)

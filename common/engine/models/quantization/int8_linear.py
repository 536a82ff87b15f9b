"""Int8 weight-only linear: symmetric, one scale per output channel (w ~= q * scale).

Scales come from the model's own weights at load; the float weight is dropped once
quantized (the caller replaces the float linear). torch's CPU kernel
`_weight_int8pack_mm` runs in bf16 (see cpu_kernels): fp32 activations are rounded to
bf16 for this matmul. Without the kernel, forward converts the codes per call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.models.quantization.cpu_kernels import KERNEL_DTYPE, int8_kernel_available, kernel_output

INT8_MAX = 127


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (codes [N, K] int8 in -127..127, scales [N] fp32)."""
    weight = weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    codes = torch.round(weight / scales.unsqueeze(1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, use_kernel: bool | None = None):
        """use_kernel None: torch's int8 kernel where it runs; False: always the fallback."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.uses_kernel = int8_kernel_available(weight.device.type) if use_kernel is None else use_kernel
        codes, scales = quantize_per_channel(weight)
        self.register_buffer("codes", codes)  # [N, K] int8
        self.register_buffer("scales", scales.to(KERNEL_DTYPE) if self.uses_kernel else scales)  # [N]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.codes.to(dtype) * self.scales.to(dtype).unsqueeze(1)  # [N, K]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.uses_kernel:
            out = F.linear(x, self.codes.to(x.dtype)) * self.scales.to(x.dtype)
            return out if self.bias is None else out + self.bias
        x2d = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()  # [num_tokens, K]
        out = torch.ops.aten._weight_int8pack_mm(x2d, self.codes, self.scales.to(KERNEL_DTYPE))
        return kernel_output(out, x, self.bias, self.out_features)  # out: [num_tokens, N]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kernel={'int8pack bf16' if self.uses_kernel else 'dequantize'}")

"""Int8 weight-only linear: symmetric, one scale per output channel (w ~= q * scale).

Scales come from the model's own weights at load; the float weight is dropped once
quantized (the caller replaces the float linear). torch's CPU kernel
`_weight_int8pack_mm` runs in bf16 (see cpu_kernels): fp32 activations are rounded to
bf16 for this matmul. Without the kernel, forward converts the codes per call.

Decode steps take the native Q8_0 GEMV instead where the CPU has AVX2 and FMA
(kernels/cpu_linear.py; up to four tokens here, any number in the native decode loop): the
codes as Q8_0 blocks whose d is the row's scale (exact: the loader builds them only where
every scale fits fp16), in groups of 16 rows on huge pages, x quantized per 32 columns to
int8. bf16 prompts from 12 rows (with AVX512-BF16) take the blocks widened to bf16 panels,
and there a bf16 model keeps no second copy of the codes for torch's kernel. All sit behind
the native op `pdserve_gemv::int8_linear`, which picks by the token count in C++, so a
compiled graph does not branch on it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.models.quantization.cpu_kernels import KERNEL_DTYPE, int8_kernel_available, kernel_output
from kernels.cpu_linear import (GEMV_K_MULTIPLE, gguf_prompt_gemm_available, int8_linear, native_gemv_available,
                                q8_0_gemv_blocks)
from kernels.huge_pages import on_huge_pages

INT8_MAX = 127
# x dtypes the native op takes as they are.
NATIVE_X_DTYPES = (torch.bfloat16, torch.float32)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (codes [N, K] int8 in -127..127, scales [N] fp32)."""
    weight = weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    codes = torch.round(weight / scales.unsqueeze(1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


def gemv_blocks(
    codes: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N]
) -> torch.Tensor | None:  # [N, K // 32 * 34] uint8: q8_0_gemv_blocks, on huge pages
    """The weight codes * scales as Q8_0 blocks (every block of a row with the row's scale as
    its fp16 d) in the GEMV's order; None where a scale does not fit fp16 exactly or K is not
    a multiple of 32."""
    num_rows, num_cols = codes.shape
    d = scales.to(torch.float16)
    if num_cols % GEMV_K_MULTIPLE or not torch.equal(d.to(scales.dtype), scales) or not d.isfinite().all():
        return None
    num_blocks = num_cols // 32
    d_bytes = d.view(torch.uint8).reshape(num_rows, 1, 2).expand(num_rows, num_blocks, 2)
    raw = torch.cat([d_bytes, codes.view(torch.uint8).reshape(num_rows, num_blocks, 32)], dim=-1)
    return on_huge_pages(q8_0_gemv_blocks(raw.reshape(num_rows, -1)))


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, use_kernel: bool | None = None):
        """use_kernel None: torch's int8 kernel where it runs; False: always the fallback."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.uses_kernel = int8_kernel_available(weight.device.type) if use_kernel is None else use_kernel
        codes, scales = quantize_per_channel(weight)
        self.register_buffer("scales", scales.to(KERNEL_DTYPE) if self.uses_kernel else scales)  # [N]
        # [N, K // 32 * 34] uint8 for the decode GEMV, or None.
        self.register_buffer("q8_0_blocks", gemv_blocks(codes, self.scales) if self.uses_kernel
                             and weight.device.type == "cpu" and native_gemv_available() else None)
        # [N, K] int8 for torch's kernel, or None: a bf16 model's linear whose blocks serve
        # every step (the GEMV, and the blocks widened to bf16 for prompts from 5 rows)
        # keeps no second copy of its codes (the blocks are the codes with their scales).
        lean = (self.q8_0_blocks is not None and weight.dtype == torch.bfloat16 and gguf_prompt_gemm_available()
                and self.out_features % 32 == 0)
        self.register_buffer("codes", None if lean else codes)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.uses_kernel:
            out = F.linear(x, self.codes.to(x.dtype)) * self.scales.to(x.dtype)
            return out if self.bias is None else out + self.bias
        x2d = x.reshape(-1, self.in_features)  # [num_tokens, K]
        if self.q8_0_blocks is not None:  # the native library is loaded
            x2d = x2d.to(x.dtype if x.dtype in NATIVE_X_DTYPES else KERNEL_DTYPE).contiguous()
            out = int8_linear(x2d, self.codes, self.scales, self.q8_0_blocks)
        else:
            out = torch.ops.aten._weight_int8pack_mm(x2d.to(KERNEL_DTYPE).contiguous(), self.codes,
                                                     self.scales.to(KERNEL_DTYPE))
        return kernel_output(out, x, self.bias, self.out_features)  # out: [num_tokens, N]

    def extra_repr(self) -> str:
        kernel = "dequantize" if not self.uses_kernel else "blocks only" if self.codes is None else "int8pack bf16"
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={kernel}"

"""A linear layer whose weight stays in GGUF's Q4_1 (4-bit codes, per-32-column d and m).

torch's CPU int4 kernel dequantizes as (q - 8) * scale + zero per group of 32 input
columns, so Q4_1's d * q + m is scale = d, zero = m + 8 d. It runs in bf16 (see
cpu_kernels): fp32 activations are rounded to bf16 for this matmul and the fp16 d and m
to bf16. Without the kernel, forward dequantizes the codes per call, in x's dtype.

Decode steps take the native Q4_1 GEMV instead where the CPU has AVX2 and FMA
(kernels/cpu_linear.py): it streams GGUF's own blocks, rearranged in groups of 16 rows and
kept for it (d and m exact, not rounded to bf16), up to four tokens here and any number in
the native decode loop. bf16 prompts from 12 rows (with AVX512-BF16) take the same blocks
widened to bf16 panels per call (kernels/cpu/gguf_panels.h), and there a bf16 model keeps
no torch int4 copy at all: its prompts of 5-11 rows take the panels too. All sit behind one
opaque op, the native library's `pdserve_gemv::q4_1_linear`, which makes the choice in C++,
so a compiled graph does not branch on the number of tokens; it takes bf16 or fp32 rows
and answers in their dtype (it quantizes decode rows per block to int8, an fp32 model's
from fp32, not from bf16). Without the library, the op `pdserve::int4_linear` runs torch's
kernel for every step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.models.quantization.cpu_kernels import KERNEL_DTYPE, int4_kernel_available, kernel_output
from common.engine.models.quantization.gguf_blocks import Q4_1_BLOCK_SIZE, Q4_1Blocks
from kernels.cpu_linear import gguf_prompt_gemm_available, native_gemv_available, q4_1_gemv_blocks
from kernels.cpu_linear import q4_1_linear as native_q4_1_linear
from kernels.huge_pages import on_huge_pages

# torch's int4 codes are centred on 8: (q - 8) * scale + zero.
INT4_ZERO_POINT = 8
# x dtypes the native op takes as they are (it rounds fp32 rows to bf16 itself for torch's kernel).
NATIVE_X_DTYPES = (torch.bfloat16, torch.float32)

# torch's int4 kernel as an opaque op where the native library is not loaded: a compiled
# graph then holds one call whatever the token count.
_LIBRARY = torch.library.Library("pdserve", "FRAGMENT")
_LIBRARY.define("int4_linear(Tensor x, Tensor packed, Tensor scales_and_zeros, int group_size) -> Tensor")


def _int4_linear_cpu(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    # x [num_tokens, K] bf16 -> [num_tokens, N] bf16
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


def _int4_linear_fake(x, packed, scales_and_zeros, group_size):
    return x.new_empty((x.shape[0], scales_and_zeros.shape[1]))


_LIBRARY.impl("int4_linear", _int4_linear_cpu, "CPU")
torch.library.register_fake("pdserve::int4_linear", _int4_linear_fake, lib=_LIBRARY)


class Q4_1Linear(nn.Module):
    def __init__(self, blocks: Q4_1Blocks, bias: torch.Tensor | None, device: torch.device,
                 use_kernel: bool | None = None, dtype: torch.dtype | None = None):
        """use_kernel None: torch's int4 kernel where it runs; False: always the fallback.
        dtype: the model's; a bf16 model's linear on a CPU where the native op widens the
        blocks for prompts keeps no torch int4 copy (a third of a 4-bit model's memory)."""
        super().__init__()
        self.out_features, self.in_features = blocks.shape
        self.group_size = Q4_1_BLOCK_SIZE
        self.uses_kernel = int4_kernel_available(device.type) if use_kernel is None else use_kernel
        d, m = blocks.d.float(), blocks.m.float()  # [N, K // 32]
        native_blocks = self.uses_kernel and device.type == "cpu" and native_gemv_available()
        # A bf16 model's linear whose blocks serve every step (the GEMV, and the blocks
        # widened to bf16 for prompts from 5 rows) keeps no torch int4 copy.
        blocks_only = (native_blocks and dtype == torch.bfloat16 and gguf_prompt_gemm_available()
                       and self.out_features % 32 == 0)
        if self.uses_kernel:
            if blocks_only:
                self.register_buffer("packed", None)
                self.register_buffer("scales_and_zeros", None)
            else:
                codes = blocks.codes().to(torch.int32)  # [N, K], freed once packed
                self.register_buffer("packed",
                                     torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1).to(device))
                # [K // 32, N, 2]: (scale, zero) per group of input columns and output row.
                scales_and_zeros = torch.stack([d.t(), (m + INT4_ZERO_POINT * d).t()], dim=-1)
                self.register_buffer("scales_and_zeros", scales_and_zeros.to(device, KERNEL_DTYPE).contiguous())
            # [N, K // 32 * 20] uint8: GGUF's blocks in groups of 16 rows, for the decode GEMV,
            # on huge pages (a decode step streams them whole: kernels/huge_pages.py).
            self.register_buffer("blocks", on_huge_pages(q4_1_gemv_blocks(blocks.raw())) if native_blocks else None)
        else:
            self.register_buffer("codes", blocks.codes().to(device))  # [N, K] uint8
            self.register_buffer("d", blocks.d.to(device))  # [N, K // 32] fp16
            self.register_buffer("m", blocks.m.to(device))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] d * q + m: the fallback path's weight."""
        n, num_groups = self.d.shape
        codes = self.codes.view(n, num_groups, self.group_size).to(dtype)
        return (codes * self.d.to(dtype).unsqueeze(-1) + self.m.to(dtype).unsqueeze(-1)).reshape(n, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.uses_kernel:
            return F.linear(x, self.dequantized_weight(x.dtype), self.bias)
        x2d = x.reshape(-1, self.in_features)  # [num_tokens, K]
        if self.blocks is not None:  # the native library is loaded
            # It takes an fp32 model's rows as they are and answers in their dtype: no
            # conversion on either side of the 120 linears of a decode step.
            x2d = x2d.to(x.dtype if x.dtype in NATIVE_X_DTYPES else KERNEL_DTYPE).contiguous()
            out = native_q4_1_linear(x2d, self.packed, self.scales_and_zeros, self.blocks, self.group_size)
        else:
            out = torch.ops.pdserve.int4_linear(x2d.to(KERNEL_DTYPE).contiguous(), self.packed,
                                                self.scales_and_zeros, self.group_size)
        return kernel_output(out, x, self.bias, self.out_features)  # out: [num_tokens, N]

    def extra_repr(self) -> str:
        kernel = "dequantize" if not self.uses_kernel else "blocks only" if self.packed is None else "int4pack bf16"
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={kernel}"

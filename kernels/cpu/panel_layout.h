// The column-panel layouts (pack_panels) for every library that takes one, whatever the ISA
// it was built for: a bf16 weight W [N, K] as [N / kPanelCols][K / 2][kPanelCols][2], K's
// pairs outermost (panel_gemm.h); an fp32 one as [N / kF32PanelCols][K][kF32PanelCols], K
// outermost (panel_gemm_fp32.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pdserve_cpu {

constexpr int64_t kPanelCols = 32;  // output columns per panel: two 512-bit vectors of fp32
constexpr int64_t kF32PanelCols = 16;  // output columns per fp32 panel: two 256-bit vectors

// Whether t is laid out as pack_panels writes a bf16 weight: contiguous bf16 [N / 32, K / 2, 32, 2].
inline bool is_panel_copy(const at::Tensor& t) {
  return t.dim() == 4 && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.size(2) == kPanelCols &&
         t.size(3) == 2;
}

// Whether t is laid out as pack_panels writes an fp32 weight: contiguous fp32 [N / 16, K, 16].
inline bool is_f32_panel_copy(const at::Tensor& t) {
  return t.dim() == 3 && t.scalar_type() == at::kFloat && t.is_contiguous() && t.size(2) == kF32PanelCols;
}

}  // namespace pdserve_cpu

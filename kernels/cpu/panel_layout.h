// The column-panel layout of a bf16 weight (pack_panels, panel_gemm.h) for every library
// that takes one, whatever the ISA it was built for: W [N, K] as [N / kPanelCols][K / 2]
// [kPanelCols][2], K's pairs outermost.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pdserve_cpu {

constexpr int64_t kPanelCols = 32;  // output columns per panel: two 512-bit vectors of fp32

// Whether t is laid out as pack_panels writes a weight: contiguous bf16 [N / 32, K / 2, 32, 2].
inline bool is_panel_copy(const at::Tensor& t) {
  return t.dim() == 4 && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.size(2) == kPanelCols &&
         t.size(3) == 2;
}

}  // namespace pdserve_cpu

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

// A step's M rows of x cut into the panel GEMMs' tiles of tile_rows rows, the last the rest,
// where a rest of 1 to max_joined rows joins the tile before it (a tile of tile_rows + 1 or
// + 2: alone, the rest's few accumulators wait on the FMAs' or dot products' latency; SmolLM2's
// bf16 linears at 13 / 25 rows 7.3-7.75 / 9.85-10.4 -> 6.65-6.86 / 8.75-9.0 ms on the Zen 5).
// Both panel_gemm.h's tiles and panel_gemm_fp32.h's (x packed in the same tiles there).
struct RowTiles {
  int64_t num_rows, tile_rows, count;
  RowTiles(int64_t M, int64_t tile_rows, int64_t max_joined) : num_rows(M), tile_rows(tile_rows) {
    const int64_t rest = M % tile_rows;
    count = (M + tile_rows - 1) / tile_rows - (M > tile_rows && rest >= 1 && rest <= max_joined ? 1 : 0);
  }
  int64_t first(int64_t t) const { return t * tile_rows; }  // tile t's first row
  int64_t rows(int64_t t) const { return t + 1 == count ? num_rows - first(t) : tile_rows; }
};

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

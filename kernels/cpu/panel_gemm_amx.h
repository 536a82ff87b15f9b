// panel_gemm (panel_gemm.h) on AMX tiles: y [M, N] = x [M, K] @ W [N, K]^T (+ bias), bf16, W in
// the same column panels. On CPUs with AMX, vdpbf16ps is several times slower than the tiles:
// on the 2-core Xeon (2026-11-28, SmolLM2's 30 layers + head from DRAM) panel_gemm's vector
// tiles fell behind oneDNN from 12 rows (64 rows 111 ms against 39), while oneDNN itself
// streams the weights at ~13 GB/s against the GEMV's ~20 even at one row. On the tiles a
// step of 1-16 rows reads the panels as fast as the GEMV reads its rows (SmolLM2's linears
// and head, 15.3-16.5 ms against oneDNN's ~25), 64 rows take 26.6 ms against 33.6, 128 40.3
// against 46.3 (docs/benchmarks.md, "Fast execution on the AMX Xeon").
//
// A panel [K / 2][32][2] is already what tdpbf16ps takes as B: a tile of 16 pairs of K by 16
// columns is 16 rows of 64 bytes, 128 bytes apart (the panel's left or right 16 columns). x is
// A as it is (16 rows of 32 bf16, K * 2 bytes apart; a last partial block of rows from a
// padded copy); each panel is read from DRAM once and kept in L1/L2 for every block of x.
#pragma once

#include "amx_tiles.h"
#include "panel_gemm.h"
#include "panel_layout.h"

#ifdef PDSERVE_HAS_AMX
#define PDSERVE_PANEL_GEMM_AMX 1
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include <c10/util/BFloat16.h>

namespace pdserve_cpu {

constexpr int64_t kAmxRows = 16;       // rows of x per A tile (and of C)
constexpr int64_t kAmxK = 32;          // bf16 values of K per tile step (64 bytes a row)
constexpr int64_t kAmxPanelBytes = 128;  // a panel's pair of K: 32 columns x 2 bf16

// Every tile 16 rows of 64 bytes: tmm0-3 C (two 16-row blocks of x by the panel's two halves),
// tmm4-5 A (the two blocks of x), tmm6-7 B (the panel's halves).
struct alignas(64) AmxTileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// C's fp32 [rows, 32] (+ bias) rounded to nearest even into y's rows [m0, m0 + rows).
inline void amx_store_rows(const float* c, const c10::BFloat16* bias, c10::BFloat16* y, int64_t N, int64_t m0,
                           int64_t n0, int64_t rows) {
  const PanelBias panel_bias(bias, n0);
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 sums[2] = {_mm512_loadu_ps(c + i * 32), _mm512_loadu_ps(c + i * 32 + 16)};
    panel_bias.store_row(sums, y + (m0 + i) * N + n0);
  }
}

// Panels [panel_begin, panel_end) for all M rows, K a multiple of 32. x's whole blocks of 16
// rows are read in place; a last partial block from x_tail, its rows padded to 16 (the
// padding's sums are not stored). The tiles are this thread's: configured here and
// released at the end.
inline void panel_gemm_panels_amx(const c10::BFloat16* x, const c10::BFloat16* x_tail,
                                  const c10::BFloat16* panels, const c10::BFloat16* bias, c10::BFloat16* y,
                                  int64_t M, int64_t K, int64_t N, int64_t panel_begin, int64_t panel_end) {
  const AmxTileConfig config;
  _tile_loadconfig(&config);
  alignas(64) float c[2 * kAmxRows * kPanelCols];  // two blocks of 16 rows by the panel's 32 columns
  const int64_t x_stride = K * static_cast<int64_t>(sizeof(c10::BFloat16));
  const int64_t panel_values = K * kPanelCols;
  const int64_t num_blocks = (M + kAmxRows - 1) / kAmxRows;
  // The next panel is asked for into L2 over this one's steps. From two blocks of x on: at 64
  // rows 7-9% faster, at 128 3-10% (the 2-core Xeon of model 167). At one block it made no
  // difference there, the hardware's stream keeping up alone; on the Xeon of model 207 the
  // stream alone read SmolLM2's linears and head at ~13-14 GB/s in steps of 1-16 rows, and
  // ~19-20 with the prefetch (bench decode-linears: 21 -> 14 ms a step).
  const int64_t panel_lines = panel_values * static_cast<int64_t>(sizeof(c10::BFloat16)) / 64;
  const int64_t num_steps = (num_blocks + 1) / 2 * (K / kAmxK);
  const int64_t lines_per_step = (panel_lines + num_steps - 1) / num_steps;
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    const c10::BFloat16* panel = panels + p * panel_values;
    const char* ahead =
        p + 1 < panel_end ? reinterpret_cast<const char*>(panel + panel_values) : nullptr;
    int64_t next_line = 0;
    const int64_t n0 = p * kPanelCols;
    for (int64_t b = 0; b < num_blocks; b += 2) {
      const bool two = b + 1 < num_blocks;
      auto block_rows = [&](int64_t block) { return (block + 1) * kAmxRows <= M ? x + block * kAmxRows * K : x_tail; };
      const c10::BFloat16* x0 = block_rows(b);
      const c10::BFloat16* x1 = two ? block_rows(b + 1) : nullptr;
      _tile_zero(0);
      _tile_zero(1);
      if (two) {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t k = 0; k < K; k += kAmxK) {
        const c10::BFloat16* w = panel + k * kPanelCols;  // pair k / 2's row of the panel
        if (ahead != nullptr) {
          const int64_t stop = std::min(panel_lines, next_line + lines_per_step);
          for (; next_line < stop; ++next_line) _mm_prefetch(ahead + next_line * 64, _MM_HINT_T1);
        }
        _tile_loadd(6, w, kAmxPanelBytes);
        _tile_loadd(7, w + 16 * 2, kAmxPanelBytes);
        _tile_loadd(4, x0 + k, x_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, x1 + k, x_stride);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      constexpr int64_t kRowBytes = kPanelCols * sizeof(float);
      _tile_stored(0, c, kRowBytes);
      _tile_stored(1, c + 16, kRowBytes);
      const int64_t m0 = b * kAmxRows;
      amx_store_rows(c, bias, y, N, m0, n0, std::min(kAmxRows, M - m0));
      if (two) {
        _tile_stored(2, c + kAmxRows * kPanelCols, kRowBytes);
        _tile_stored(3, c + kAmxRows * kPanelCols + 16, kRowBytes);
        amx_store_rows(c + kAmxRows * kPanelCols, bias, y, N, m0 + kAmxRows, n0,
                       std::min(kAmxRows, M - m0 - kAmxRows));
      }
    }
  }
  _tile_release();
}

}  // namespace pdserve_cpu
#endif

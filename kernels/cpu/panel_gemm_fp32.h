// y [M, N] = x [M, K] @ W [N, K]^T (+ bias) in fp32 with AVX2 and FMA, for an fp32 model's
// steps of up to 2,048 rows on a CPU without AVX-512 (the Zen 3 EPYC's case, where `--dtype
// auto` is fp32): outer products on W packed in column panels, as panel_gemm.h does for bf16. A panel
// is 16 output columns by all of K (36 KB for K = 576), one 64-byte line per K step; a tile
// of 6 rows of x keeps 12 accumulators in 12 of AVX2's 16 registers, beside 2 W vectors and
// a broadcast of x, and reads the panel once per 6 rows from L2.
//
// SmolLM2's 30 layers' linears and its head in fp32 (538 MB, from DRAM), 2 threads, on the
// Zen 4 EPYC running this AVX2 code and oneDNN limited to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2; its
// FMA rate per core is the Zen 3's), medians, ms: 1 / 2 / 4 rows 17.2 / 17.4 / 18.6 (the
// row-major GEMV 16.7 / 19.2 / 24.8), 8 rows 22.8 against oneDNN's 69.9, 16 29.8 against
// 67.6, 32 56.5 against 71.9, 64 115 against 125 (~150-160 GFLOP/s from 24 rows); 96 / 128 /
// 256 / 512 rows 123 / 162 / 324 / 678 against 157 / 203 / 378 / 744 (~205-215 GFLOP/s, near
// the two cores' FMA peak), 1,024 / 2,048 rows 1,462 / 2,998 against 1,635 / 3,149 (the head's
// outputs then 200-400 MB). Wider layers (a Llama-3.2-1B-like stack: K 2,048 and 8,192,
// panels of 128-512 KB): 1-16 rows 1.3-1.6x oneDNN, 64-256 level, 1,024 1.17x.
// With AVX-512 oneDNN there ran 8 / 16 / 32 / 64 rows in 31.6 /
// 37.9 / 57.2 / 117 ms; on CPUs with two 512-bit FMA units it would pull ahead sooner, so
// AVX-512 builds keep oneDNN (gemv.cpp's f32_panel_gemm_max_rows).
#pragma once

#include "panel_layout.h"
#include "stream_prefetch.h"

#if defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_F32_PANEL_GEMM 1
#include <immintrin.h>

#include <cstdint>

namespace pdserve_cpu {

constexpr int64_t kF32TileRows = 6;    // rows of x per tile: 12 accumulators
// Steps of at least this many rows ask for the next panel into L2 while their first tile
// reads this one (as panel_gemm.h's whole tiles do); fewer stream W non-temporally a few KB
// ahead. On the Zen 4 running this code (above), 1 / 2 rows 17.2 / 17.4 ms streaming against
// 18.9 / 18.6 with the L2 prefetch; 3 / 4 / 5 rows 20.8 / 21.3 / 22.7 streaming against
// 18.8 / 18.6 / 18.0.
constexpr int64_t kF32PrefetchMinRows = 3;

// Panels [panel_begin, panel_end) of [N / 16][K][16] from W [N, K] row-major: panel p holds
// columns [p * 16, p * 16 + 16), K outermost.
inline void pack_f32_panels(const float* w, float* panels, int64_t K, int64_t panel_begin, int64_t panel_end) {
  for (int64_t p = panel_begin; p < panel_end; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < kF32PanelCols; ++c)
        panels[(p * K + k) * kF32PanelCols + c] = w[(p * kF32PanelCols + c) * K + k];
}

// y rows [m0, m0 + RM), the panel's 16 columns from n0; `ahead`: the next panel, asked for
// into L2 one line per K step, or null; stream_ahead (where `ahead` is null): the weight
// stream asked for non-temporally a few KB on (stream_prefetch.h).
//
// The loops over the tile's rows are unrolled by pragma: without it GCC 12 (-O3, AVX2)
// unrolls them too late to keep acc in registers only, and stores all 12 accumulators to
// the stack at every K step besides.
template <int RM>
inline void f32_panel_tile(const float* x, const float* panel, const float* bias, float* y, int64_t K, int64_t N,
                           int64_t m0, int64_t n0, const char* ahead, bool stream_ahead) {
  __m256 acc[RM][2];
#pragma GCC unroll 8
  for (int i = 0; i < RM; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const float* x_rows = x + m0 * K;
  for (int64_t k = 0; k < K; ++k) {
    const float* w_line = panel + k * kF32PanelCols;  // one 64-byte line: 16 columns' W[., k]
    const __m256 w0 = _mm256_loadu_ps(w_line);
    const __m256 w1 = _mm256_loadu_ps(w_line + 8);
    if (ahead != nullptr)
      _mm_prefetch(ahead + k * kF32PanelCols * sizeof(float), _MM_HINT_T1);
    else if (stream_ahead)
      prefetch_stream_ahead(w_line, kF32PanelCols * sizeof(float));
#pragma GCC unroll 8
    for (int i = 0; i < RM; ++i) {
      const __m256 x_k = _mm256_broadcast_ss(x_rows + i * K + k);
      acc[i][0] = _mm256_fmadd_ps(x_k, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(x_k, w1, acc[i][1]);
    }
  }
  __m256 bias0 = _mm256_setzero_ps(), bias1 = _mm256_setzero_ps();
  if (bias != nullptr) {
    bias0 = _mm256_loadu_ps(bias + n0);
    bias1 = _mm256_loadu_ps(bias + n0 + 8);
  }
#pragma GCC unroll 8
  for (int i = 0; i < RM; ++i) {
    float* y_row = y + (m0 + i) * N + n0;
    _mm256_storeu_ps(y_row, _mm256_add_ps(acc[i][0], bias0));
    _mm256_storeu_ps(y_row + 8, _mm256_add_ps(acc[i][1], bias1));
  }
}

// Panels [panel_begin, panel_end) for every row of x: each panel against all tiles of x
// rows before the next, which its first tile asks for.
inline void f32_panel_gemm_panels(const float* x, const float* panels, const float* bias, float* y, int64_t M,
                                  int64_t K, int64_t N, int64_t panel_begin, int64_t panel_end) {
  const int64_t panel_values = K * kF32PanelCols;
  const bool stream_ahead = M < kF32PrefetchMinRows;
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    const float* panel = panels + p * panel_values;
    const char* ahead =
        p + 1 < panel_end && !stream_ahead ? reinterpret_cast<const char*>(panel + panel_values) : nullptr;
    const int64_t n0 = p * kF32PanelCols;
    int64_t m0 = 0;
    for (; m0 + kF32TileRows <= M; m0 += kF32TileRows, ahead = nullptr)
      f32_panel_tile<kF32TileRows>(x, panel, bias, y, K, N, m0, n0, ahead, false);
    switch (M - m0) {
#define PDSERVE_F32_PANEL_TAIL(r) \
  case r: f32_panel_tile<r>(x, panel, bias, y, K, N, m0, n0, ahead, stream_ahead); break;
      PDSERVE_F32_PANEL_TAIL(1) PDSERVE_F32_PANEL_TAIL(2) PDSERVE_F32_PANEL_TAIL(3) PDSERVE_F32_PANEL_TAIL(4)
      PDSERVE_F32_PANEL_TAIL(5)
#undef PDSERVE_F32_PANEL_TAIL
      default: break;
    }
  }
}

}  // namespace pdserve_cpu
#endif

// y [M, N] = x [M, K] @ W [N, K]^T (+ bias) in bf16 with AVX512-BF16, for decode steps of
// 1 to ~128 rows (short of prefill's): outer products on W packed in column panels, each
// panel (32 output columns, all of K: 36 KB for K = 576) read from L2 once per 12 rows of
// x, the next panel asked for from DRAM meanwhile (steps of a whole tile and more:
// kPrefetchMinRows). It is the only copy of a bf16 weight that decode steps read: at 1-4
// rows it streams the panels as fast as the row-major GEMV streamed its rows, so the model
// keeps no row-major copy beside it.
//
// The panel layout [N / 32][K / 2][32][2] is what vdpbf16ps multiplies: one 512-bit load is
// 16 output columns' pair of K values, against one pair of x's K values broadcast to every
// lane; a tile of 12 rows of x by 32 columns keeps 24 accumulators and needs no sum across
// lanes at the end (dot-product tiles over W's rows do: the deleted stream_gemm's did).
//
// SmolLM2's 30 layers' linears and its head, weights from DRAM, 2 threads of the Zen 4
// EPYC (a standalone prototype; 465 GFLOP/s is the measured vdpbf16ps peak of both cores):
// 32 rows 23.6 ms (78% of the peak) against oneDNN's 28.0 (66%), 48 rows 35.1 against
// 39.6, 64 rows 44.2 (84%) against 50.5 (73%); even at 128; at 2,048 rows ~80% against
// oneDNN's ~90%, so prefill steps stay there. Through the op (bench decode-linears): 8
// rows 9.4 ms against oneDNN's 14.4, 16 rows 12.4 against 18.6; at 5 rows ~7% behind the
// dot-product tiles it replaced, bound by the weight reads like them.
#pragma once

#include "panel_layout.h"
#include "stream_prefetch.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PDSERVE_PANEL_GEMM 1
#include <immintrin.h>

#include <cstdint>

#include <c10/util/BFloat16.h>

namespace pdserve_cpu {

constexpr int64_t kPanelTileRows = 12;  // rows of x per tile: 24 accumulators, 2 W vectors, 1 broadcast
constexpr int64_t kPrefetchOutBytes = 1 << 20;  // outputs past this (a Zen 4 core's L2) are asked for ahead
// Steps of fewer rows than this read each panel in one tile, once: they ask for their
// stream non-temporally a few KB on (stream_prefetch.h); steps of whole tiles ask for the
// next panel into L2 while the first tile reads this one, as the later tiles read it again.
// On the Zen 4 EPYC, SmolLM2's linears and head (docs/benchmarks.md, "A bf16 weight held
// twice"): 1-5 rows 4-21% faster without the L2 prefetch, 6-64 rows 3-34% faster with it
// than with no prefetch at all; on the Zen 5, the non-temporal stream against it, a decode
// step of the bf16 layers at 6 / 8 / 11 rows -0.10 / -0.53 / -0.50 ms (6.36 / 7.12 / 6.97),
// at 16 and 32 rows (whole tiles) no better. On the Zen 4, once the tiles of 1-11 rows kept
// their sums in registers, the same: SmolLM2's linears and head at 8 / 11 / 20 rows 9.1-9.2 /
// 10.1-10.5 / 15.4-16.3 ms, against 11.2-12.9 / 10.3-18.0 / 18.5-20.1 with the L2 prefetch
// from 2 rows and tails of 7-11 rows padded to a whole tile (docs/benchmarks.md, "Decode
// steps of 2-11 rows on panel_gemm").
constexpr int64_t kPrefetchMinRows = kPanelTileRows;

// Panels [panel_begin, panel_end) of [N / kPanelCols][K / 2][kPanelCols][2] from W [N, K]
// row-major: panel p holds columns [p * 32, p * 32 + 32), K's pairs outermost.
inline void pack_panels(const c10::BFloat16* w, c10::BFloat16* panels, int64_t K, int64_t panel_begin,
                        int64_t panel_end) {
  const int64_t num_pairs = K / 2;
  for (int64_t p = panel_begin; p < panel_end; ++p)
    for (int64_t kp = 0; kp < num_pairs; ++kp) {
      c10::BFloat16* dst = panels + (p * num_pairs + kp) * kPanelCols * 2;
      for (int64_t c = 0; c < kPanelCols; ++c) {
        const c10::BFloat16* src = w + (p * kPanelCols + c) * K + kp * 2;
        dst[c * 2] = src[0];
        dst[c * 2 + 1] = src[1];
      }
    }
}

// A panel's 32 bias values (zero without a bias) in fp32, and the rounding of a row's 32 fp32
// sums plus the bias into y: both tile kinds' (panel_gemm_amx.h) last step.
struct PanelBias {
  __m512 lanes[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};

  PanelBias(const c10::BFloat16* bias, int64_t n0) {
    if (bias != nullptr)
      for (int j = 0; j < 2; ++j)  // bf16 -> fp32 is a shift into the high half
        lanes[j] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + n0 + j * 16))), 16));
  }

  // y_row[0..32) = bf16(sums + bias), rounded to nearest even as c10::BFloat16(float).
  void store_row(const __m512 (&sums)[2], c10::BFloat16* y_row) const {
    for (int j = 0; j < 2; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y_row + j * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sums[j], lanes[j])));
  }
};

// y rows [m0, m0 + RM), the panel's 32 columns from n0; `ahead`: the next panel, asked for
// into L2 two lines (one pair of K) per step, or null; stream_ahead (where `ahead` is null):
// the weight stream asked for non-temporally a few KB on (stream_prefetch.h); prefetch_out:
// whether to ask for the next panel's output lines (y larger than L2).
template <int RM>
inline void panel_gemm_tile(const c10::BFloat16* x, const c10::BFloat16* panel, const c10::BFloat16* bias,
                            c10::BFloat16* y, int64_t K, int64_t N, int64_t m0, int64_t n0, const char* ahead,
                            bool stream_ahead, bool prefetch_out) {
  __m512 acc[RM][2];
  for (int i = 0; i < RM; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  // The next panel's outputs: one line in each of RM rows N apart, which no hardware stream
  // covers; asked for (to write) now, they are owned by the time they are stored. Without
  // this the head's 64-row output (6 MB, cold after 30 layers) took ~2-3 ms more a step;
  // outputs that fit L2 need no asking.
  if (prefetch_out && n0 + kPanelCols < N)
    for (int i = 0; i < RM; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(y + (m0 + i) * N + n0 + kPanelCols), _MM_HINT_ET0);
  const int64_t num_pairs = K / 2;
  // x's rows as pairs of bf16: one 32-bit broadcast per row and pair.
  const int32_t* x_pairs = reinterpret_cast<const int32_t*>(x + m0 * K);
  for (int64_t kp = 0; kp < num_pairs; ++kp) {
    const c10::BFloat16* w_pair = panel + kp * kPanelCols * 2;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(static_cast<const void*>(w_pair));
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(static_cast<const void*>(w_pair + 32));
    if (ahead != nullptr) {
      _mm_prefetch(ahead + kp * kPanelCols * 4, _MM_HINT_T1);
      _mm_prefetch(ahead + kp * kPanelCols * 4 + 64, _MM_HINT_T1);
    } else if (stream_ahead) {
      prefetch_stream_ahead(w_pair, kPanelCols * 2 * sizeof(c10::BFloat16));
    }
    for (int i = 0; i < RM; ++i) {
      const __m512bh x_pair = (__m512bh)_mm512_set1_epi32(x_pairs[i * num_pairs + kp]);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x_pair, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x_pair, w1);
    }
  }
  const PanelBias panel_bias(bias, n0);
  for (int i = 0; i < RM; ++i) panel_bias.store_row(acc[i], y + (m0 + i) * N + n0);
}

// Panels [panel_begin, panel_end) for every row of x: each panel against all tiles of x
// rows before the next, which its first tile asks for.
inline void panel_gemm_panels(const c10::BFloat16* x, const c10::BFloat16* panels, const c10::BFloat16* bias,
                              c10::BFloat16* y, int64_t M, int64_t K, int64_t N, int64_t panel_begin,
                              int64_t panel_end) {
  const int64_t panel_values = K * kPanelCols;
  const bool prefetch_out = M * N * static_cast<int64_t>(sizeof(c10::BFloat16)) > kPrefetchOutBytes;
  const bool stream_ahead = M < kPrefetchMinRows;  // (one tile)
  // A rest of 1 or 2 rows joins the tile before it: 26 or 28 accumulators, 2 W vectors and a
  // broadcast fit AVX-512's 32 registers.
  const RowTiles tiles(M, kPanelTileRows, 2);
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    const c10::BFloat16* panel = panels + p * panel_values;
    const char* ahead =
        p + 1 < panel_end && M >= kPrefetchMinRows ? reinterpret_cast<const char*>(panel + panel_values) : nullptr;
    const int64_t n0 = p * kPanelCols;
    for (int64_t t = 0; t < tiles.count; ++t, ahead = nullptr) {
      switch (tiles.rows(t)) {
#define PDSERVE_PANEL_TILE(r) \
  case r: panel_gemm_tile<r>(x, panel, bias, y, K, N, tiles.first(t), n0, ahead, stream_ahead, prefetch_out); break;
        PDSERVE_PANEL_TILE(1) PDSERVE_PANEL_TILE(2) PDSERVE_PANEL_TILE(3) PDSERVE_PANEL_TILE(4)
        PDSERVE_PANEL_TILE(5) PDSERVE_PANEL_TILE(6) PDSERVE_PANEL_TILE(7) PDSERVE_PANEL_TILE(8)
        PDSERVE_PANEL_TILE(9) PDSERVE_PANEL_TILE(10) PDSERVE_PANEL_TILE(11) PDSERVE_PANEL_TILE(12)
        PDSERVE_PANEL_TILE(13) PDSERVE_PANEL_TILE(14)
#undef PDSERVE_PANEL_TILE
        default: break;
      }
    }
  }
}

}  // namespace pdserve_cpu
#endif

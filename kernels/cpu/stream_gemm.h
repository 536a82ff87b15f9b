// y [M, N] = x [M, K] @ W [N, K]^T (+ bias) in bf16 with AVX512-BF16 dot products, for
// decode steps of a few to a few tens of rows: W read as the GEMV reads it (each thread
// its share of W's rows, front to back, a few rows at a time, asked for ahead), each group
// of W rows used for every row of x while it is in L1.
//
// Against oneDNN's packed GEMM, SmolLM2's 30 layers' linears (W on huge pages, as the
// GEMV's copies are; from DRAM), on the 2-core Zen 4 EPYC, the two alternating, medians:
// 8 rows 12.8 -> 8.5 ms, 16 rows 15.7 -> 14.6 ms, even at 24 and 32 (oneDNN's outer-product
// tiles win once the math dominates). The head (49152 x 576): 8 rows 2.3 -> 1.6 ms, even at
// 16, behind from 24.
//
// A tile is 4 rows of x by 4 rows of W: 16 fp32 accumulators, each the dot product of one
// pair, whose lanes transpose_sum16 then sums all at once.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PDSERVE_STREAM_GEMM 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

#include "transpose16.h"

namespace pdserve_cpu {

constexpr int64_t kTileRows = 4;  // rows of x, and of W, per tile
// A group's first tile asks for the W rows of the group this many ahead, a line of each
// row per step of K: the group's four rows are four interleaved streams, which the
// hardware prefetcher alone kept at ~60% of a GEMV's read rate. Into L2: into L1 the
// requests stalled (4 rows, 30 layers: ~14 ms into L1, ~9 into L2; 2, 4 and 8 groups
// ahead alike).
constexpr int64_t kPrefetchGroups = 4;

// y[m0 + i, n0 + j] for i < RM, j < RN: x rows m0.., W rows n0.., K a multiple of 32;
// bias_lanes: lane i * 4 + j holds bias[n0 + j] (zeros without a bias); `ahead`: W rows to
// ask for meanwhile (kPrefetchGroups), or null.
template <int RM, int RN>
inline void stream_gemm_tile(const c10::BFloat16* x, const c10::BFloat16* w, __m512 bias_lanes, c10::BFloat16* y,
                             int64_t K, int64_t N, int64_t m0, int64_t n0, const c10::BFloat16* ahead) {
  __m512 acc[16];  // acc[i * 4 + j]: x row i . W row j; the unused stay zero for the sum
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  const c10::BFloat16* x_rows = x + m0 * K;
  const c10::BFloat16* w_rows = w + n0 * K;
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh w_vec[RN];
    for (int j = 0; j < RN; ++j)
      w_vec[j] = (__m512bh)_mm512_loadu_si512(static_cast<const void*>(w_rows + j * K + k));
    if (ahead != nullptr)
      for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * K + k), _MM_HINT_T1);
    for (int i = 0; i < RM; ++i) {
      const __m512bh x_vec = (__m512bh)_mm512_loadu_si512(static_cast<const void*>(x_rows + i * K + k));
      for (int j = 0; j < RN; ++j) acc[i * 4 + j] = _mm512_dpbf16_ps(acc[i * 4 + j], x_vec, w_vec[j]);
    }
  }
  // Lane i * 4 + j: y[m0 + i, n0 + j], rounded to nearest even as c10::BFloat16(float); a
  // row's RN values are adjacent in y and in `rounded`: one move each.
  alignas(32) c10::BFloat16 rounded[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(rounded),
                     (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(transpose_sum16(acc), bias_lanes)));
  for (int i = 0; i < RM; ++i) std::memcpy(y + (m0 + i) * N + n0, rounded + i * 4, RN * sizeof(c10::BFloat16));
}

// x rows [0, M) against W rows [n_begin, n_end): groups of 4 W rows, each against every
// tile of x rows before the next group is read.
template <int RN>
inline void stream_gemm_group(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias,
                              c10::BFloat16* y, int64_t M, int64_t K, int64_t N, int64_t n0) {
  alignas(64) float lanes[16] = {};
  if (bias != nullptr)
    for (int t = 0; t < 16; ++t) lanes[t] = t % 4 < RN ? static_cast<float>(bias[n0 + t % 4]) : 0.f;
  const __m512 bias_lanes = _mm512_load_ps(lanes);
  const int64_t n_ahead = n0 + kPrefetchGroups * kTileRows;
  const c10::BFloat16* ahead = n_ahead + kTileRows <= N ? w + n_ahead * K : nullptr;
  int64_t m0 = 0;
  for (; m0 + kTileRows <= M; m0 += kTileRows, ahead = nullptr)
    stream_gemm_tile<4, RN>(x, w, bias_lanes, y, K, N, m0, n0, ahead);
  switch (M - m0) {
    case 3: stream_gemm_tile<3, RN>(x, w, bias_lanes, y, K, N, m0, n0, ahead); break;
    case 2: stream_gemm_tile<2, RN>(x, w, bias_lanes, y, K, N, m0, n0, ahead); break;
    case 1: stream_gemm_tile<1, RN>(x, w, bias_lanes, y, K, N, m0, n0, ahead); break;
    default: break;
  }
}

inline void stream_gemm_rows(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias,
                             c10::BFloat16* y, int64_t M, int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  int64_t n0 = n_begin;
  for (; n0 + kTileRows <= n_end; n0 += kTileRows) stream_gemm_group<4>(x, w, bias, y, M, K, N, n0);
  switch (n_end - n0) {
    case 3: stream_gemm_group<3>(x, w, bias, y, M, K, N, n0); break;
    case 2: stream_gemm_group<2>(x, w, bias, y, M, K, N, n0); break;
    case 1: stream_gemm_group<1>(x, w, bias, y, M, K, N, n0); break;
    default: break;
  }
}

}  // namespace pdserve_cpu
#endif

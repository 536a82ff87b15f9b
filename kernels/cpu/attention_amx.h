// The bf16 prefill tiles of the CPU attention (attention_bf16.h) on AMX: both products of a
// cache block, Q K^T and P V, as tile multiplies (tdpbf16ps) over blocks of 16 query rows,
// where the vector tiles take one vdpbf16ps per row, pair and 16 keys. On the 2-core Xeon
// vdpbf16ps runs several times slower than the tiles, and a 1,024-token prompt's attention
// took half of its time to first token.
//
// The operands are the vector tiles' own: K's pairs transposed (k_pairs: row i = pair i of
// 16 keys, 64 bytes) are a B tile of 16 pairs by 16 keys per 32 values of d; V in pairs of
// keys (v_pairs: pair p's words (v_2p[d], v_2p+1[d]) for 16 d at a time) a B tile of 8 pairs
// by 16 d; the query rows (bf16, as given) and the rows' probabilities rounded to bf16 are
// the A tiles; the accumulators stay fp32 in memory, loaded into a C tile and stored back
// per block. The query and accumulator buffers hold whole blocks of 16 rows (rows past the
// item's are zero or anything: their results are never read).
#pragma once

#include "amx_tiles.h"
#include "attention_bf16.h"

#if defined(PDSERVE_BF16_DOT) && defined(PDSERVE_HAS_AMX)
#define PDSERVE_ATTENTION_AMX 1
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include <c10/util/BFloat16.h>

namespace pdserve_cpu {

constexpr int64_t kAmxTileRows = 16;  // query rows per A and C tile

// tmm0: scores (16 rows x 16 keys fp32), tmm1: queries (16 rows x 32 d), tmm2: K's pairs (16
// pairs x 16 keys), tmm3: probabilities (16 rows x 16 keys bf16), tmm4: V's pairs (8 pairs
// of keys x 16 d), tmm5: accumulators (16 rows x 16 d fp32).
struct alignas(64) AttentionTileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 32, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 8, 16};
};

// Configures this thread's tiles for the functions below (_tile_release() gives them back).
inline void configure_attention_tiles() {
  const AttentionTileConfig config;
  _tile_loadconfig(&config);
}

// Tile 0 = q_r . k_j, unscaled, for the 16 query rows from r0 and the 16 keys whose pairs
// k_pairs holds. q_rows: [ceil(num_rows / 16) * 16, kHeadDim] bf16.
template <int64_t kHeadDim>
inline void amx_tile_scores(const c10::BFloat16* q_rows, int64_t r0, const uint32_t* k_pairs) {
  static_assert(kHeadDim % 32 == 0);
  _tile_zero(0);
  for (int64_t d = 0; d < kHeadDim; d += 32) {
    _tile_loadd(1, q_rows + r0 * kHeadDim + d, kHeadDim * sizeof(c10::BFloat16));
    _tile_loadd(2, k_pairs + d / 2 * 16, 64);
    _tile_dpbf16ps(0, 1, 2);
  }
}

// scores[r * score_stride + j] = scale * (q_r . k_j) for the 16 keys whose pairs k_pairs holds
// (keys outside the block's range are zero there and score 0), rows [0, num_rows). q_rows:
// [ceil(num_rows / 16) * 16, kHeadDim] bf16; scores points at the 16 keys' first column.
template <int64_t kHeadDim>
inline void amx_block_scores(const c10::BFloat16* q_rows, int64_t num_rows, const uint32_t* k_pairs, float scale,
                             int64_t score_stride, float* scores) {
  alignas(64) float tile[kAmxTileRows * 16];
  const __m512 scale_vec = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < num_rows; r0 += kAmxTileRows) {
    amx_tile_scores<kHeadDim>(q_rows, r0, k_pairs);
    _tile_stored(0, tile, 64);
    const int64_t rows = std::min(kAmxTileRows, num_rows - r0);
    for (int64_t m = 0; m < rows; ++m)
      _mm512_storeu_ps(scores + (r0 + m) * score_stride, _mm512_mul_ps(_mm512_load_ps(tile + m * 16), scale_vec));
  }
}

// scores[r * score_stride + j] = q_r . k_j, unscaled, for the 16 keys whose pairs k_pairs holds,
// rows [0, ceil(num_rows / 16) * 16): each tile stored straight into the scores (whose rows
// past num_rows must exist), the scale left to the softmax, where a copy through a buffer
// to scale each row took ~8% of a long prompt's attention. q_rows as amx_block_scores'.
template <int64_t kHeadDim>
inline void amx_block_raw_scores(const c10::BFloat16* q_rows, int64_t num_rows, const uint32_t* k_pairs,
                                 int64_t score_stride, float* scores) {
  for (int64_t r0 = 0; r0 < num_rows; r0 += kAmxTileRows) {
    amx_tile_scores<kHeadDim>(q_rows, r0, k_pairs);
    _tile_stored(0, scores + r0 * score_stride, score_stride * sizeof(float));
  }
}

// acc_r += sum_j p_r[j] v_j over the 16 keys whose pairs v_pairs holds, p rounded to bf16 (as
// the vector tiles do) and 0 outside in_range, rows [0, num_rows). acc: [ceil(num_rows / 16)
// * 16, kHeadDim] fp32; p_rows points at the 16 keys' first column.
template <int64_t kHeadDim>
inline void amx_block_accumulate(float* acc, int64_t num_rows, const float* p_rows, int64_t p_stride,
                                 __mmask16 in_range, const uint32_t* v_pairs) {
  static_assert(kHeadDim % 16 == 0);
  constexpr int64_t kChunks = kHeadDim / 16;
  alignas(64) c10::BFloat16 p_tile[kAmxTileRows * 16];
  for (int64_t r0 = 0; r0 < num_rows; r0 += kAmxTileRows) {
    const int64_t rows = std::min(kAmxTileRows, num_rows - r0);
    for (int64_t m = 0; m < kAmxTileRows; ++m) {
      const __m256bh p = _mm512_cvtneps_pbh(m < rows ? _mm512_maskz_loadu_ps(in_range, p_rows + (r0 + m) * p_stride)
                                                     : _mm512_setzero_ps());
      _mm256_store_si256(reinterpret_cast<__m256i*>(p_tile + m * 16), (__m256i)p);
    }
    _tile_loadd(3, p_tile, 32);
    for (int64_t c = 0; c < kChunks; ++c) {
      float* acc_chunk = acc + r0 * kHeadDim + c * 16;
      _tile_loadd(5, acc_chunk, kHeadDim * sizeof(float));
      _tile_loadd(4, v_pairs + c * 16, kChunks * 16 * sizeof(uint32_t));
      _tile_dpbf16ps(5, 3, 4);
      _tile_stored(5, acc_chunk, kHeadDim * sizeof(float));
    }
  }
}

}  // namespace pdserve_cpu
#endif

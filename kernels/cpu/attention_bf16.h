// Scores of a bf16 query row against bf16 cache keys with AVX512-BF16 dot products
// (vdpbf16ps: bf16 pairs multiplied exactly, summed in fp32). For decode rows this
// replaces a bf16 -> fp32 conversion of every key and a horizontal sum per key: the
// partial sums of 16 keys are reduced together (transpose_sum16).
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PDSERVE_BF16_DOT 1
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include <c10/util/BFloat16.h>

namespace pdserve_cpu {

constexpr int64_t kBf16PerVec = 32;  // bf16 values in one 512-bit register

inline __m512bh load_bf16x32(const c10::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(static_cast<const void*>(p));
}

// v[0..15] -> one vector whose lane i is the sum of v[i]'s lanes: 15 adds and 30
// shuffles for 16 sums, against ~6 dependent steps per sum done one by one.
inline __m512 transpose_sum16(const __m512 (&v)[16]) {
  __m512 pairs[8];  // per 128-bit lane L: [a0, b0, a1, b1], partial sums of v[2i] (a), v[2i+1] (b)
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 quads[4];  // per 128-bit lane L: the sums over lane L of v[4i], ..., v[4i + 3]
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Fold the four 128-bit lanes: u0 holds quads[0] and quads[1] halved, u1 quads[2] and quads[3].
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], 0xEE));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
}

// scores[j] = scale * (q . k_j) for j in [begin, end), written 16 at a time from begin
// rounded down to 16 (the score row is padded to whole vectors; keys outside
// [begin, end) get some in-range key's score, which the softmax masks).
template <int64_t kHeadDim>
inline void row_scores_bf16(const c10::BFloat16* q_row, const c10::BFloat16* k_block, int64_t k_pos_stride,
                            int64_t begin, int64_t end, float scale, float* scores) {
  static_assert(kHeadDim % kBf16PerVec == 0);
  constexpr int64_t kNumVec = kHeadDim / kBf16PerVec;
  __m512bh q[kNumVec];
  for (int64_t v = 0; v < kNumVec; ++v) q[v] = load_bf16x32(q_row + v * kBf16PerVec);
  const __m512 scale_vec = _mm512_set1_ps(scale);
  for (int64_t first = begin / 16 * 16; first < end; first += 16) {
    __m512 partial[16];
#pragma GCC unroll 16
    for (int64_t i = 0; i < 16; ++i) {
      const c10::BFloat16* k = k_block + std::clamp(first + i, begin, end - 1) * k_pos_stride;
      __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], load_bf16x32(k));
      for (int64_t v = 1; v < kNumVec; ++v) acc = _mm512_dpbf16_ps(acc, q[v], load_bf16x32(k + v * kBf16PerVec));
      partial[i] = acc;
    }
    _mm512_storeu_ps(scores + first, _mm512_mul_ps(transpose_sum16(partial), scale_vec));
  }
}

}  // namespace pdserve_cpu
#endif

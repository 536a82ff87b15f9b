// A 16 x 16 transpose of 32-bit words in AVX-512 registers, for the attention kernel's
// prefill tiles: K's rows become vectors across keys without scattered stores; and the
// same shuffles summing 16 vectors' lanes at once (decode scores, the row-stream GEMM).
#pragma once

#if defined(__AVX512F__)
#define PDSERVE_TRANSPOSE16 1
#include <immintrin.h>

#include <cstdint>

namespace pdserve_cpu {

// rows[j] lane i -> out[i] lane j for 16 x 16 32-bit words, in registers: unpacks pair
// rows within 128-bit lanes, then the 4 x 4 lanes are transposed (64 shuffles).
inline void transpose_words16(const __m512i (&rows)[16], __m512i (&out)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per lane L: t[2i] = (r2i[4L], r2i+1[4L], r2i[4L+1], r2i+1[4L+1]), t[2i+1] from 4L+2
    t[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // per lane L: u[4i + e] = rows 4i .. 4i + 3 of word 4L + e
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // out[4L + e] lane i = u[4i + e] lane L
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    out[e] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    out[4 + e] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    out[8 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    out[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// The 16 keys from `first`, 16 32-bit words of each (key j's at row + j * row_stride
// elements of T), transposed: out[i * out_stride + j] = key j's word i. Keys outside
// [keys_begin, keys_end) read as zeros and their rows are not touched: a stale cache slot
// may hold anything.
template <typename T, typename Out>
inline void transpose_key_words16(const T* row, int64_t row_stride, int64_t first, int64_t keys_begin,
                                  int64_t keys_end, Out* out, int64_t out_stride) {
  __m512i rows[16], columns[16];
  for (int64_t j = 0; j < 16; ++j) {
    const int64_t key = first + j;
    rows[j] = key < keys_begin || key >= keys_end ? _mm512_setzero_si512()
                                                  : _mm512_loadu_si512(static_cast<const void*>(row + key * row_stride));
  }
  transpose_words16(rows, columns);
  for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(static_cast<void*>(out + i * out_stride), columns[i]);
}

// transpose_key_words16 of fp32 keys: the name attention_blocks.h's K^T takes on either ISA
// (transpose8.h's on AVX2).
inline void transpose_key_floats(const float* row, int64_t row_stride, int64_t first, int64_t keys_begin,
                                 int64_t keys_end, float* out, int64_t out_stride) {
  transpose_key_words16(row, row_stride, first, keys_begin, keys_end, out, out_stride);
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

}  // namespace pdserve_cpu
#endif

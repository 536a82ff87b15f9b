// An 8 x 8 transpose of floats in AVX2 registers, for the attention kernel's prefill tiles
// on CPUs without AVX-512 (transpose16.h's 16 x 16 takes AVX-512): K's rows become vectors
// across keys without a scattered store per value.
#pragma once

#if defined(__AVX2__) && !defined(__AVX512F__)
#define PDSERVE_TRANSPOSE8 1
#include <immintrin.h>

#include <cstdint>

namespace pdserve_cpu {

// rows[j] lane i -> out[i] lane j: unpacks pair rows within 128-bit halves, shuffles gather
// four rows' words, and the halves swap across (24 shuffles).
inline void transpose_floats8(const __m256 (&rows)[8], __m256 (&out)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {  // t[2i] = (r2i[0], r2i+1[0], r2i[1], r2i+1[1] | the same from word 4)
    t[2 * i] = _mm256_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // u[4h + e]: rows 4h .. 4h + 3 of words e and e + 4
    u[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
    u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {
    out[e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x20);
    out[4 + e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x31);
  }
}

// The 8 keys from `first`, 8 floats of each (key j's at row + j * row_stride), transposed:
// out[i * out_stride + j] = key j's value i. Keys outside [keys_begin, keys_end) read as
// zeros and their rows are not touched: a stale cache slot may hold anything.
inline void transpose_key_floats(const float* row, int64_t row_stride, int64_t first, int64_t keys_begin,
                                  int64_t keys_end, float* out, int64_t out_stride) {
  __m256 rows[8], columns[8];
  for (int64_t j = 0; j < 8; ++j) {
    const int64_t key = first + j;
    rows[j] = key < keys_begin || key >= keys_end ? _mm256_setzero_ps() : _mm256_loadu_ps(row + key * row_stride);
  }
  transpose_floats8(rows, columns);
  for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(out + i * out_stride, columns[i]);
}

}  // namespace pdserve_cpu
#endif

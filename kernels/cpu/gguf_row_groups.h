// GEMVs over GGUF's quantized blocks in groups of rows: y [M, N] = x [M, K] @ W^T with W in
// Q4_1 (per row and 32 columns: fp16 d, fp16 m, 32 4-bit codes q; the weight d * q + m) or
// Q8_0 (fp16 d, 32 int8 codes q; the weight d * q), rearranged at load
// (kernels/cpu_linear.py: q4_1_gemv_blocks, q8_0_gemv_blocks) so that one vector lane is
// one row.
//
// Why: in the file's order a block is one row's 32 columns, and each block's codes and
// scales must be unpacked and applied on their own: ~11 cycles a Q4_1 block on Zen 4, 12
// GB/s of weights against ~31 GB/s for the bf16 GEMV. Here 16 rows go together, so a
// block's unpacking, its scale and its minimum are each one vector op for 16 rows, and
// the products are integer dot products of 4 columns per lane (AVX512-VNNI vpdpbusd, or
// AVX2's maddubs + madd on two halves of 8 rows).
//
// Layout of a group of r rows (r = 16 except the last group, which holds N % 16), per
// 32-column block, the file's bytes per block and row (Q4_1 20 r, Q8_0 34 r):
//   Q4_1: 4 units of r 4-byte words: unit L, word j holds row j's columns 8L + t
//   (t = 0..3) in its low nibbles and columns 8L + 4 + t in its high ones, byte t each;
//   then r fp16 d; then r fp16 m.
//   Q8_0: 8 units of r 4-byte words: unit i, word j holds row j's codes of columns
//   4i .. 4i + 3; then r fp16 d.
// The groups follow each other in row order: each thread reads its groups as one stream.
//
// x is quantized per 32-column block to int8 as llama.cpp's Q8_1 (scale s = max |x| / 127,
// codes round(x / s)), and the sums over x take the sum of the quantized x (s * sum of
// codes), so each product is exactly the dequantized weight's with the quantized x; sums
// are fp32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "stream_prefetch.h"
#include "vec_math.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PDSERVE_ROW_GROUPS 1
#endif
#if defined(PDSERVE_ROW_GROUPS) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PDSERVE_ROW_GROUPS_VNNI 1
#endif

namespace pdserve_cpu {

constexpr int64_t kGroupRows = 16;  // rows per group: one per 32-bit lane of a 512-bit vector
constexpr int64_t kBlockCols = 32;  // columns per block, Q4_1 and Q8_0
constexpr int64_t kQ4RowBytes = 20;  // bytes per block and row: fp16 d, fp16 m, 16 bytes of nibbles
constexpr int64_t kQ4GroupBlockBytes = kGroupRows * kQ4RowBytes;  // 320: 256 of codes, 32 of d, 32 of m
constexpr int64_t kQ4CodeBytes = 16 * kGroupRows;
constexpr int64_t kQ8RowBytes = 34;  // bytes per block and row: fp16 d, 32 int8 codes
constexpr int64_t kQ8GroupBlockBytes = kGroupRows * kQ8RowBytes;  // 544: 512 of codes, 32 of d
constexpr int64_t kQ8CodeBytes = 32 * kGroupRows;

// Rows of x quantized per 32-column block, from some row on: what a group's kernel reads.
struct QuantizedRows {
  const int8_t* codes;            // [rows, K]
  const float* scales_and_sums;   // [rows, K / 32, 2]
};

// x rows quantized per 32-column block.
struct BlockQuantizedX {
  explicit BlockQuantizedX(int64_t num_blocks_total)
      : codes(num_blocks_total * kBlockCols), scales_and_sums(2 * num_blocks_total) {}
  std::vector<int8_t> codes;           // [M, K]
  std::vector<float> scales_and_sums;  // [M, K / 32, 2]: s, and s * the sum of the block's codes
  QuantizedRows rows_from(int64_t first_row, int64_t num_blocks_per_row) const {
    const int64_t first_block = first_row * num_blocks_per_row;
    return {codes.data() + first_block * kBlockCols, scales_and_sums.data() + 2 * first_block};
  }
};

// Which GGUF block format a row-group GEMV reads.
enum class BlockFormat { kQ4_1, kQ8_0 };

// rows(std::integral_constant<int, M>) for M = 1 .. 4 (4 for more): the kernels unroll over x's rows.
template <typename Fn>
void for_num_rows(int64_t M, Fn rows) {
  switch (M) {
    case 1: rows(std::integral_constant<int, 1>{}); break;
    case 2: rows(std::integral_constant<int, 2>{}); break;
    case 3: rows(std::integral_constant<int, 3>{}); break;
    default: rows(std::integral_constant<int, 4>{}); break;
  }
}

#ifdef PDSERVE_ROW_GROUPS
// Blocks [begin, end) of x (fp32 or bf16, widened by vec_math.h's to_float / load_vec;
// blocks of 32 values, one after another) into q. Rounds half to even (the default rounding mode) in both builds, so both give the
// same codes, and bf16 x gives the codes of its fp32 widening.
template <typename T>
void quantize_x_blocks(const T* x, int64_t begin, int64_t end, BlockQuantizedX& q) {
  for (int64_t i = begin; i < end; ++i) {
    const T* xb = x + i * kBlockCols;
#ifdef PDSERVE_ROW_GROUPS_VNNI
    const __m512 v0 = (__m512)load_vec(xb), v1 = (__m512)load_vec(xb + 16);  // Vec: 16 lanes here
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inverse)));
    const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inverse)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q.codes.data() + i * kBlockCols), _mm512_cvtepi32_epi8(c0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q.codes.data() + i * kBlockCols + 16), _mm512_cvtepi32_epi8(c1));
    const int32_t code_sum = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
#else
    float amax = 0.f;
    for (int64_t j = 0; j < kBlockCols; ++j) amax = std::max(amax, std::fabs(to_float(xb[j])));
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    int32_t code_sum = 0;
    for (int64_t j = 0; j < kBlockCols; ++j) {
      const int8_t code = static_cast<int8_t>(std::nearbyint(to_float(xb[j]) * inverse));
      q.codes[i * kBlockCols + j] = code;
      code_sum += code;
    }
#endif
    const float scale = amax / 127.f;
    q.scales_and_sums[2 * i] = scale;
    q.scales_and_sums[2 * i + 1] = scale * static_cast<float>(code_sum);
  }
}

inline int32_t x_word(const int8_t* codes, int i) {  // columns 4i .. 4i + 3 of a block
  int32_t word;
  std::memcpy(&word, codes + 4 * i, 4);
  return word;
}

#ifdef PDSERVE_ROW_GROUPS_VNNI
// One group of 16 rows over all blocks, for either format: out[m][j] = x row m . W row j
// (no bias). load(block, codes, d) fills a block's 8 unsigned code vectors (codes[i] lane j:
// row j's columns 4i .. 4i + 3) and its d, and returns what multiplies s * the sum of x's
// codes in each row (Q4_1: m; Q8_0: -128 d). The weights are asked for ahead
// (stream_prefetch.h) at every number of rows: a group's passes (up to kGroupPassRows rows
// of x each) follow each other, so the later ones find it in L1 all the same. On the 2-core
// Zen 5 EPYC, prefetching past one pass too: a step of SmolLM2's Q4_1 layers at 16 / 32 /
// 64 / 96 rows 7.86 -> 5.94, 12.79 -> 10.62, 25.18 -> 22.51, 33.24 -> 32.20 ms.
template <int M, typename LoadBlock>
void group_vnni(const QuantizedRows& x, const uint8_t* group, int64_t num_blocks, int64_t block_bytes,
                LoadBlock load, float (&out)[M][kGroupRows]) {
  __m512 acc[M], acc_sums[M];  // d-scaled dots; the sum terms (two chains, so neither waits on the other)
  for (int m = 0; m < M; ++m) acc[m] = acc_sums[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    // Past the group's end the stream goes on into the thread's next group.
    prefetch_stream_ahead(group + b * block_bytes, block_bytes);
    __m512i codes[8];
    __m512 d;
    const __m512 sum_factor = load(group + b * block_bytes, codes, d);
    for (int m = 0; m < M; ++m) {
      const int64_t xb = m * num_blocks + b;
      const int8_t* x_codes = x.codes + xb * kBlockCols;
      __m512i dot0 = _mm512_setzero_si512(), dot1 = _mm512_setzero_si512();
      for (int i = 0; i < 8; i += 2) {
        dot0 = _mm512_dpbusd_epi32(dot0, codes[i], _mm512_set1_epi32(x_word(x_codes, i)));
        dot1 = _mm512_dpbusd_epi32(dot1, codes[i + 1], _mm512_set1_epi32(x_word(x_codes, i + 1)));
      }
      const float* scale_and_sum = x.scales_and_sums + 2 * xb;
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(scale_and_sum[0])),
                               _mm512_cvtepi32_ps(_mm512_add_epi32(dot0, dot1)), acc[m]);
      acc_sums[m] = _mm512_fmadd_ps(sum_factor, _mm512_set1_ps(scale_and_sum[1]), acc_sums[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out[m], _mm512_add_ps(acc[m], acc_sums[m]));
}
#else
// The same for AVX2, in two passes of 8 rows: each half's accumulators fit AVX2's 16
// registers; the second pass reads the group (5-15 KB) from cache. unit_dots(codes_half,
// x_codes, dots) adds to dots[m] (int32, one lane per row) the half's dot products with x
// row m's block codes; kWithMins: the format's m term (Q4_1; Q8_0 has none).
template <int M, bool kWithMins, typename UnitDots>
void group_avx2(const QuantizedRows& x, const uint8_t* group, int64_t num_blocks, int64_t block_bytes,
                int64_t code_bytes, UnitDots unit_dots, float (&out)[M][kGroupRows]) {
  for (int half = 0; half < 2; ++half) {
    __m256 acc[M], acc_min[M];
    for (int m = 0; m < M; ++m) acc[m] = acc_min[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* block = group + b * block_bytes;
      const int8_t* x_codes[M];
      __m256i dots[M];
      for (int m = 0; m < M; ++m) {
        x_codes[m] = x.codes + (m * num_blocks + b) * kBlockCols;
        dots[m] = _mm256_setzero_si256();
      }
      unit_dots(block + 32 * half, x_codes, dots);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + code_bytes + 16 * half)));
      for (int m = 0; m < M; ++m) {
        const float* scale_and_sum = x.scales_and_sums + 2 * (m * num_blocks + b);
        acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(scale_and_sum[0])), _mm256_cvtepi32_ps(dots[m]), acc[m]);
      }
      if constexpr (kWithMins) {
        const __m256 mins =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + code_bytes + 32 + 16 * half)));
        for (int m = 0; m < M; ++m)
          acc_min[m] = _mm256_fmadd_ps(mins, _mm256_set1_ps(x.scales_and_sums[2 * (m * num_blocks + b) + 1]), acc_min[m]);
      }
    }
    for (int m = 0; m < M; ++m)
      _mm256_storeu_ps(out[m] + 8 * half, kWithMins ? _mm256_add_ps(acc[m], acc_min[m]) : acc[m]);
  }
}
#endif

// One group of 16 Q4_1 rows over all blocks: out[m][j] = x row m . W row j (no bias).
template <int M>
void q4_1_group(const QuantizedRows& x, const uint8_t* group, int64_t num_blocks, float (&out)[M][kGroupRows]) {
#ifdef PDSERVE_ROW_GROUPS_VNNI
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  group_vnni<M>(x, group, num_blocks, kQ4GroupBlockBytes,
                [&](const uint8_t* block, __m512i (&codes)[8], __m512& d) {
    for (int unit = 0; unit < 4; ++unit) {
      const __m512i packed = _mm512_loadu_si512(block + 64 * unit);
      codes[2 * unit] = _mm512_and_si512(packed, low_mask);
      codes[2 * unit + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_mask);
    }
    d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kQ4CodeBytes)));
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kQ4CodeBytes + 32)));  // m
  }, out);
#else
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  group_avx2<M, true>(x, group, num_blocks, kQ4GroupBlockBytes, kQ4CodeBytes,
                      [&](const uint8_t* codes_half, const int8_t* const (&x_codes)[M], __m256i (&dots)[M]) {
    for (int unit = 0; unit < 4; ++unit) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes_half + 64 * unit));
      const __m256i low = _mm256_and_si256(packed, low_mask);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_mask);
      for (int m = 0; m < M; ++m) {
        // u8 code x s8 x pairs summed in int16 (at most 2 * 15 * 127: no saturation), then int32.
        const __m256i p0 =
            _mm256_madd_epi16(_mm256_maddubs_epi16(low, _mm256_set1_epi32(x_word(x_codes[m], 2 * unit))), ones);
        const __m256i p1 =
            _mm256_madd_epi16(_mm256_maddubs_epi16(high, _mm256_set1_epi32(x_word(x_codes[m], 2 * unit + 1))), ones);
        dots[m] = _mm256_add_epi32(dots[m], _mm256_add_epi32(p0, p1));
      }
    }
  }, out);
#endif
}

// One group of 16 Q8_0 rows over all blocks: out[m][j] = x row m . W row j (no bias).
template <int M>
void q8_0_group(const QuantizedRows& x, const uint8_t* group, int64_t num_blocks, float (&out)[M][kGroupRows]) {
#ifdef PDSERVE_ROW_GROUPS_VNNI
  // vpdpbusd takes one side unsigned: the codes + 128 (their sign bit flipped), and
  // 128 * the sum of x's codes comes off again through the sum term (-128 d: a power of
  // two, so exact). Every dot is at most 32 * 255 * 127 < 2^24: exact in fp32.
  const __m512i sign_bit = _mm512_set1_epi8(static_cast<char>(0x80));
  group_vnni<M>(x, group, num_blocks, kQ8GroupBlockBytes,
                [&](const uint8_t* block, __m512i (&codes)[8], __m512& d) {
    for (int i = 0; i < 8; ++i) codes[i] = _mm512_xor_si512(_mm512_loadu_si512(block + 64 * i), sign_bit);
    d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kQ8CodeBytes)));
    return _mm512_mul_ps(d, _mm512_set1_ps(-128.f));
  }, out);
#else
  // maddubs takes one side unsigned: |code| against x's code with the code's sign (at most
  // 2 * 128 * 127 per int16: no saturation), as llama.cpp does.
  const __m256i ones = _mm256_set1_epi16(1);
  group_avx2<M, false>(x, group, num_blocks, kQ8GroupBlockBytes, kQ8CodeBytes,
                       [&](const uint8_t* codes_half, const int8_t* const (&x_codes)[M], __m256i (&dots)[M]) {
    for (int i = 0; i < 8; ++i) {
      const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes_half + 64 * i));
      const __m256i magnitudes = _mm256_sign_epi8(codes, codes);
      for (int m = 0; m < M; ++m) {
        const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(x_word(x_codes[m], i)), codes);
        dots[m] = _mm256_add_epi32(dots[m], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, signed_x), ones));
      }
    }
  }, out);
#endif
}

// The last group's r < 16 rows laid out as a full group (rows r.. zero: codes and scales
// 0), for a format of num_units 4-byte words per row and block followed by num_scales
// fp16 values per row (Q4_1: 4 and 2, Q8_0: 8 and 1).
inline std::vector<uint8_t> pad_group(const uint8_t* group, int64_t num_rows, int64_t num_blocks, int num_units,
                                      int num_scales) {
  const int64_t row_bytes = 4 * num_units + 2 * num_scales, full_bytes = kGroupRows * row_bytes;
  std::vector<uint8_t> padded(num_blocks * full_bytes, 0);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* src = group + b * row_bytes * num_rows;
    uint8_t* dst = padded.data() + b * full_bytes;
    for (int unit = 0; unit < num_units; ++unit)
      std::memcpy(dst + 4 * kGroupRows * unit, src + 4 * num_rows * unit, 4 * num_rows);
    for (int scale = 0; scale < num_scales; ++scale)
      std::memcpy(dst + (4 * num_units + 2 * scale) * kGroupRows, src + (4 * num_units + 2 * scale) * num_rows,
                  2 * num_rows);
  }
  return padded;
}

// The last group of W [N, K / 32 * row bytes] padded to 16 rows (pad_group) where N is not a
// multiple of 16; empty where it is.
template <BlockFormat kFormat>
std::vector<uint8_t> pad_last_group(const uint8_t* w, int64_t N, int64_t num_blocks) {
  constexpr int64_t kRowBytes = kFormat == BlockFormat::kQ4_1 ? kQ4RowBytes : kQ8RowBytes;
  const int64_t num_rows = N % kGroupRows;
  if (num_rows == 0) return {};
  const uint8_t* group = w + (N - num_rows) * num_blocks * kRowBytes;
  return kFormat == BlockFormat::kQ4_1 ? pad_group(group, num_rows, num_blocks, 4, 2)
                                       : pad_group(group, num_rows, num_blocks, 8, 1);
}

constexpr int64_t kXTileRows = 64;  // x rows whose codes stay in L2 while a thread's groups pass
// x rows one pass over a group serves, their sums in registers: 8 in AVX-512's 32 (16
// accumulators, the block's 8 code vectors, d and the sum factor), 4 in AVX2's 16 (whose
// kernel goes over each group in two halves). A pass of 8 unpacks each block's codes once
// for twice the rows: a step of SmolLM2's Q4_1 layers on the Zen 5 at 16 / 32 / 64 / 96
// rows 5.94 -> 5.59, 10.62 -> 9.83, 22.51 -> 20.61, 32.20 -> 27.19 ms against passes of 4.
#ifdef PDSERVE_ROW_GROUPS_VNNI
constexpr int64_t kGroupPassRows = 8;
#else
constexpr int64_t kGroupPassRows = 4;
#endif

// One thread's part of y [M, N] = x @ W^T (+ bias): W's row groups [begin, end), over x's
// rows in tiles of kXTileRows (their codes stay in L2 while the groups pass), each group
// (6-15 KB for SmolLM2) serving up to kGroupPassRows rows a pass from L1, so W is read
// from memory once. xq: x's M rows quantized (quantize_x_blocks); padded_last: the last
// group as pad_last_group made it, where N % 16 != 0. Sums are fp32, rounded to T once
// with the bias added.
template <BlockFormat kFormat, typename T>
void row_groups_gemv(const BlockQuantizedX& xq, int64_t M, const uint8_t* w, int64_t N, int64_t num_blocks,
                     const uint8_t* padded_last, const T* bias, T* y, int64_t begin, int64_t end) {
  constexpr int64_t kRowBytes = kFormat == BlockFormat::kQ4_1 ? kQ4RowBytes : kQ8RowBytes;
  for (int64_t tile = 0; tile < M; tile += kXTileRows) {
    const int64_t tile_end = std::min(M, tile + kXTileRows);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kGroupRows, num_rows = std::min(kGroupRows, N - n0);
      const uint8_t* group = num_rows < kGroupRows ? padded_last : w + n0 * num_blocks * kRowBytes;
      // Passes of kGroupPassRows rows, then of 4, then the 1-3 left. Each row's sums are the
      // same in any pass: a row's bits do not depend on the rows beside it.
      for (int64_t m0 = tile; m0 < tile_end;) {
        const auto pass = [&](auto rows) {
          constexpr int R = decltype(rows)::value;
          float out[R][kGroupRows];
          const QuantizedRows x_rows = xq.rows_from(m0, num_blocks);
          if constexpr (kFormat == BlockFormat::kQ4_1)
            q4_1_group<R>(x_rows, group, num_blocks, out);
          else
            q8_0_group<R>(x_rows, group, num_blocks, out);
          for (int m = 0; m < R; ++m)
            for (int64_t j = 0; j < num_rows; ++j)
              y[(m0 + m) * N + n0 + j] = T(out[m][j] + (bias == nullptr ? 0.0f : static_cast<float>(bias[n0 + j])));
          m0 += R;
        };
        if constexpr (kGroupPassRows == 8) {
          if (tile_end - m0 >= 8) {
            pass(std::integral_constant<int, 8>{});
            continue;
          }
        }
        for_num_rows(std::min<int64_t>(4, tile_end - m0), pass);
      }
    }
  }
}
#endif

}  // namespace pdserve_cpu

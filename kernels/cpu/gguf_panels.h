// GGUF's Q4_1 and Q8_0 row groups (gguf_row_groups.h) dequantized into bf16 column panels
// (panel_gemm.h's layout), for prompts: a step of many rows multiplies each weight by
// every row of x, so the weight is worth widening once per call and the products are
// panel_gemm's bf16 outer products with x as it is (bf16), as the dense bf16 model's are.
//
// Why not the row-group GEMV: it quantizes x to int8 per 32 columns, which on prompts
// costs agreement with the dense model (gemv.cpp, q4_1_linear); and not torch's int4
// kernel: ~0.6 ms per row of x over SmolLM2's projections, linear in the rows.
//
// The weight is d q + m (Q4_1) or d q (Q8_0) computed in fp32 (one FMA or product) and
// rounded once to bf16 (nearest even); a panel p holds output rows [32 p, 32 p + 32),
// groups 2 p and 2 p + 1.
#pragma once

#include "gguf_row_groups.h"
#include "panel_layout.h"

#if defined(PDSERVE_ROW_GROUPS_VNNI) && defined(__AVX512BF16__)
#define PDSERVE_GGUF_PANELS 1

#include <c10/util/BFloat16.h>

namespace pdserve_cpu {

// vpermw's indices that interleave two 16-value halves: element 2 i from i, 2 i + 1 from 16 + i.
inline __m512i interleave_halves_index() {
  alignas(64) int16_t index[32];
  for (int i = 0; i < 16; ++i) {
    index[2 * i] = static_cast<int16_t>(i);
    index[2 * i + 1] = static_cast<int16_t>(16 + i);
  }
  return _mm512_load_si512(index);
}

// Columns 2 pair and 2 pair + 1 of 16 rows (one per lane, fp32) as vdpbf16ps's pairs of
// bf16, stored at k_pair's 16 lanes of the panel's half (rows 0-15 or 16-31).
inline void store_pair(__m512 first, __m512 second, __m512i interleave, int64_t k_pair, int half,
                       c10::BFloat16* panel) {
  // Elements 0-15: the first column's rows, 16-31: the second's; interleaved, lane j
  // holds row j's pair.
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(second, first);
  _mm512_storeu_si512(panel + (k_pair * kPanelCols + 16 * half) * 2, _mm512_permutexvar_epi16(interleave, both));
}

// Q4_1 groups 2 p and 2 p + 1 (from `groups`, group 2 p's first byte; num_blocks blocks of
// 32 columns each) into one panel [K / 2][32][2] of bf16.
inline void q4_1_groups_to_panel(const uint8_t* groups, int64_t num_blocks, c10::BFloat16* panel) {
  const __m512i low_mask = _mm512_set1_epi32(0x0F);
  const __m512i interleave = interleave_halves_index();
  for (int half = 0; half < 2; ++half) {
    const uint8_t* group = groups + half * num_blocks * kQ4GroupBlockBytes;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* block = group + b * kQ4GroupBlockBytes;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kQ4CodeBytes)));
      const __m512 m =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kQ4CodeBytes + 32)));
      for (int unit = 0; unit < 4; ++unit) {
        // Lane j: row j's columns 8 unit + c, c < 4 in byte c's low nibble, the others in
        // byte c - 4's high one.
        const __m512i packed = _mm512_loadu_si512(block + 64 * unit);
        __m512 columns[8];  // lane j: row j's weight in column 8 unit + c
        for (int c = 0; c < 8; ++c) {
          const __m512i codes = _mm512_and_si512(_mm512_srli_epi32(packed, 8 * (c & 3) + 4 * (c >> 2)), low_mask);
          columns[c] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(codes), m);
        }
        for (int pair = 0; pair < 4; ++pair)
          store_pair(columns[2 * pair], columns[2 * pair + 1], interleave, 16 * b + 4 * unit + pair, half, panel);
      }
    }
  }
}

// Q8_0 groups 2 p and 2 p + 1 into one panel, as q4_1_groups_to_panel.
inline void q8_0_groups_to_panel(const uint8_t* groups, int64_t num_blocks, c10::BFloat16* panel) {
  const __m512i interleave = interleave_halves_index();
  for (int half = 0; half < 2; ++half) {
    const uint8_t* group = groups + half * num_blocks * kQ8GroupBlockBytes;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* block = group + b * kQ8GroupBlockBytes;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kQ8CodeBytes)));
      for (int unit = 0; unit < 8; ++unit) {
        // Lane j: row j's int8 codes of columns 4 unit + c in byte c.
        const __m512i packed = _mm512_loadu_si512(block + 64 * unit);
        __m512 columns[4];
        for (int c = 0; c < 4; ++c) {  // byte c sign-extended: up to the top, then back down
          const __m512i codes = _mm512_srai_epi32(_mm512_slli_epi32(packed, 24 - 8 * c), 24);
          columns[c] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(codes));
        }
        for (int pair = 0; pair < 2; ++pair)
          store_pair(columns[2 * pair], columns[2 * pair + 1], interleave, 16 * b + 2 * unit + pair, half, panel);
      }
    }
  }
}

}  // namespace pdserve_cpu
#endif

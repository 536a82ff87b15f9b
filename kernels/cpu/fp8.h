// 8-bit float KV cache codes (OCP FP8: E4M3FN and E5M2, vLLM's kv_cache_dtype "fp8_e4m3" and
// "fp8_e5m2"), no scales: a code is the value itself, as torch's float8_e4m3fn and
// float8_e5m2 store it. Writes round to nearest even and saturate at the largest finite code,
// infinities too, as torch's E4M3 conversion does (its E5M2 one overflows to inf, and one
// infinite key poisons every later softmax of its sequence); NaN stays NaN. Reads widen exactly (every code is a bf16),
// E4M3's to its value / 2^8 (kWidenedScale), which spares a multiply per value.
//
// With AVX-512 writes take sixteen values a time (integer rounding of the fp32 bits) and
// reads 32 codes a time (through fp16: a shift, vcvtph2ps), else one at a time; both give the
// same bits.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include "vec_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace pdserve_cpu {

template <typename F>
struct Fp8Format;
template <>
struct Fp8Format<c10::Float8_e4m3fn> {
  static constexpr int kMantissa = 3, kBias = 7;
  static constexpr uint32_t kMaxCode = 0x7E;  // 448; 0x7F is NaN
  static constexpr float kMax = 448.f;
};
template <>
struct Fp8Format<c10::Float8_e5m2> {
  static constexpr int kMantissa = 2, kBias = 15;
  static constexpr uint32_t kMaxCode = 0x7B;  // 57344; 0x7C is inf
  static constexpr float kMax = 57344.f;
};

template <typename C>
constexpr bool kIsFp8 = std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>;

template <typename F>
struct Fp8Bits {
  using Fmt = Fp8Format<F>;
  static constexpr int kDrop = 23 - Fmt::kMantissa;  // fp32 mantissa bits a code drops
  static constexpr uint32_t kRebias = static_cast<uint32_t>(127 - Fmt::kBias) << Fmt::kMantissa;
  static constexpr uint32_t kMinNormal = static_cast<uint32_t>(127 - Fmt::kBias + 1) << 23;  // as fp32 bits
  // Subnormal codes count multiples of 2^(1 - bias - mantissa bits).
  static constexpr float kSubnormalScale = static_cast<float>(1u << (Fmt::kBias - 1 + Fmt::kMantissa));
  // A code's magnitude bits shifted into an fp16's are its value times 2^(bias - 15).
  static constexpr int kHalfShift = 10 - Fmt::kMantissa;
  static constexpr float kHalfScale = Fmt::kBias == 15 ? 1.f : static_cast<float>(1u << (15 - Fmt::kBias));
};

template <typename F>
inline uint8_t fp8_code(float x) {
  using B = Fp8Bits<F>;
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (bits >> 24) & 0x80, mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7F);  // NaN
  uint32_t code;
  if (mag < B::kMinNormal) {
    code = static_cast<uint32_t>(std::nearbyint(std::bit_cast<float>(mag) * B::kSubnormalScale));
  } else {
    const uint32_t rounded = mag + ((1u << (B::kDrop - 1)) - 1) + ((mag >> B::kDrop) & 1);
    code = std::min((rounded >> B::kDrop) - B::kRebias, Fp8Format<F>::kMaxCode);
  }
  return static_cast<uint8_t>(sign | code);
}

template <typename F>
inline float fp8_value(uint8_t code) {
  using B = Fp8Bits<F>;
  if constexpr (std::is_same_v<F, c10::Float8_e4m3fn>)
    if ((code & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  const uint16_t half = static_cast<uint16_t>(((code & 0x7F) << B::kHalfShift) | ((code & 0x80) << 8));
  return static_cast<float>(c10::Half(half, c10::Half::from_bits())) * B::kHalfScale;
}

#if defined(__AVX512F__)
template <typename F>
inline __m128i fp8_codes16(__m512 x) {
  using B = Fp8Bits<F>;
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(mag, B::kDrop), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32((1 << (B::kDrop - 1)) - 1)), lsb);
  __m512i code = _mm512_min_epu32(_mm512_sub_epi32(_mm512_srli_epi32(rounded, B::kDrop), _mm512_set1_epi32(B::kRebias)),
                                  _mm512_set1_epi32(Fp8Format<F>::kMaxCode));
  const __mmask16 subnormal = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(B::kMinNormal));
  const __m512 scaled = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(B::kSubnormalScale));
  code = _mm512_mask_mov_epi32(code, subnormal,
                               _mm512_cvtps_epi32(_mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT |
                                                                                   _MM_FROUND_NO_EXC)));
  code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7F800000)),
                               _mm512_set1_epi32(0x7F));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign));
}

#if defined(__AVX512BW__)
// 32 codes as fp16 bits in 16-bit lanes: E5M2 is an fp16's top byte; E4M3's magnitude bits
// go to fp16's bits 13..7 (its value times 2^-8) and its sign to bit 15, its NaN to fp16's.
template <typename F>
inline __m512i fp8_halves32(__m256i codes) {
  const __m512i c = _mm512_cvtepu8_epi16(codes);
  if constexpr (std::is_same_v<F, c10::Float8_e5m2>) {
    return _mm512_slli_epi16(c, 8);
  } else {
    const __m512i shifted = _mm512_slli_epi16(c, 7);  // the sign lands on bit 14: adding it to itself carries it to 15
    const __m512i half = _mm512_add_epi16(shifted, _mm512_and_si512(shifted, _mm512_set1_epi16(0x4000)));
    const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(c, _mm512_set1_epi16(0x7F)), _mm512_set1_epi16(0x7F));
    return _mm512_mask_mov_epi16(half, nan, _mm512_set1_epi16(0x7E00));
  }
}

// 32 codes' widened values (value / kWidenedScale<F>): the first 16 in lo, the next 16 in hi.
template <typename F>
inline void fp8_widened32(__m256i codes, __m512& lo, __m512& hi) {
  const __m512i half = fp8_halves32<F>(codes);
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
}

inline void store32(float* p, __m512 lo, __m512 hi) {
  _mm512_storeu_ps(p, lo);
  _mm512_storeu_ps(p + 16, hi);
}
inline void store32(c10::BFloat16* p, __m512 lo, __m512 hi) {  // exact: every code's value is a bf16
#if defined(__AVX512BF16__)
  _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
#else
  const __m512i odd_words = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
                                             27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  _mm512_storeu_si512(p, _mm512_permutex2var_epi16(_mm512_castps_si512(lo), odd_words, _mm512_castps_si512(hi)));
#endif
}
#endif
#endif

// codes[i] = the code of src[i], i < n.
template <typename F, typename T>
inline void quantize_fp8(const T* __restrict src, uint8_t* __restrict codes, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), fp8_codes16<F>((__m512)load_vec(src + i)));
#endif
  for (; i < n; ++i) codes[i] = fp8_code<F>(to_float(src[i]));
}

// Codes widen to their value divided by this power of two: E4M3's by 2^8, which leaves them
// as fp16 holds them (no multiply a value); the attention's scale and output make it up
// exactly. E5M2's widen to their value.
template <typename F>
constexpr float kWidenedScale = Fp8Bits<F>::kHalfScale;

// dst[i] = the value of codes[i] / kWidenedScale<F>, i < n, as T (float or bf16: exact).
template <typename F, typename T>
inline void widen_fp8(const uint8_t* __restrict codes, T* __restrict dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BW__)
  for (; i + 32 <= n; i += 32) {
    __m512 lo, hi;
    fp8_widened32<F>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i)), lo, hi);
    store32(dst + i, lo, hi);
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<T>(fp8_value<F>(codes[i]) / kWidenedScale<F>);
}

}  // namespace pdserve_cpu

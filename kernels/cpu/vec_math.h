// Float vectors and the few math primitives the CPU attention kernel needs, written
// with GCC/Clang vector extensions so -march=native picks the instructions (zmm with
// AVX-512, ymm otherwise). Loads convert bf16/fp16 to fp32.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

namespace pdserve_cpu {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.x) << 16); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <int64_t kHeadDim, typename T>
inline float dot(const float* __restrict q, const T* __restrict k, int64_t head_dim) {
  const int64_t dim = kHeadDim > 0 ? kHeadDim : head_dim;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < dim; ++d) acc += q[d] * to_float(k[d]);
  return acc;
}

template <int64_t kHeadDim, typename T>
inline void axpy(float* __restrict acc, float p, const T* __restrict v, int64_t head_dim) {
  const int64_t dim = kHeadDim > 0 ? kHeadDim : head_dim;
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) acc[d] += p * to_float(v[d]);
}

// Explicit vectors for the head_dims the kernel is specialised for (GCC/Clang vector
// extensions: zmm with AVX-512, else ymm/xmm pairs). One Vec holds kLanes floats.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t Vec16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t VecU32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// AVX512-BF16's dot products (vdpbf16ps: bf16 pairs multiplied exactly, summed in fp32):
// the attention's bf16 paths (attention_bf16.h) and the decode loop's LoRA deltas
// (lora_deltas.h) take them where the build has them.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PDSERVE_BF16_DOT 1
constexpr int64_t kBf16PerVec = 32;  // bf16 values in one 512-bit register

inline __m512bh load_bf16x32(const c10::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(static_cast<const void*>(p));
}
#endif

inline Vec load_vec(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline Vec load_vec(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  Vec16 h;
  std::memcpy(&h, p, sizeof h);
  return (Vec)(__builtin_convertvector(h, VecU32) << 16);
}
inline Vec load_vec(const c10::Half* p) {
  Vec v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
// Horizontal sum by halving (log2(kLanes) shuffle + add steps, not kLanes extracts).
inline float hsum(Vec v) {
  typedef float Half8 __attribute__((vector_size(8 * sizeof(float))));
  typedef float Half4 __attribute__((vector_size(4 * sizeof(float))));
#if defined(__AVX512F__)
  const Half8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const Half8 h8 = v;
#endif
  const Half4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// Horizontal max by halving, as hsum.
inline float hmax(Vec v) {
  typedef float Half8 __attribute__((vector_size(8 * sizeof(float))));
  typedef float Half4 __attribute__((vector_size(4 * sizeof(float))));
  auto max = [](auto a, auto b) { return a > b ? a : b; };
#if defined(__AVX512F__)
  const Half8 h8 = max(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                       __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
#else
  const Half8 h8 = v;
#endif
  const Half4 h4 = max(__builtin_shufflevector(h8, h8, 0, 1, 2, 3), __builtin_shufflevector(h8, h8, 4, 5, 6, 7));
  return std::max(std::max(h4[0], h4[2]), std::max(h4[1], h4[3]));
}

typedef int32_t VecI32 __attribute__((vector_size(kLanes * sizeof(int32_t))));

// exp(r) for |r| <= ln(2) / 2 (Cephes' polynomial).
inline Vec exp_polynomial(Vec r) {
  Vec y = Vec{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  return y * r * r + r + 1.f;
}

// 4th-degree Taylor polynomial of exp(r) for |r| <= ln 2 / 2: relative error <= 5.6e-5,
// for results rounded to bf16 (a relative 2^-9).
inline Vec exp_polynomial_bf16(Vec r) {
  Vec y = Vec{} + (1.f / 24.f);
  y = y * r + (1.f / 6.f);
  y = y * r + 0.5f;
  y = y * r + 1.f;
  return y * r + 1.f;
}

// 2^n polynomial(r) for x = n ln 2 + r (|r| <= ln 2 / 2), x clamped to -87 first: exp(x) for
// the softmax's x <= 0 on a whole Vec (glibc's expf has no vector variant without
// -ffast-math), Cephes' range reduction.
template <typename Polynomial>
inline Vec exp_reduced(Vec x, Polynomial polynomial) {
#if defined(__AVX512F__)
  // The same reduction in fewer instructions: round to nearest and scalef for 2^n, where the
  // generic form's floor and exponent bits take ~10 more (a 1,024-token prompt's attention
  // ~10% faster); with exp_polynomial all of [-90, 0] agrees with the generic form but for 8
  // of 1.1e9 floats, by 1 ulp.
  const __m512 clamped = _mm512_max_ps((__m512)x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const Vec r = (Vec)_mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped));
  return (Vec)_mm512_scalef_ps((__m512)polynomial(r), n);
#else
  x = x < -87.f ? Vec{} - 87.f : x;
  const Vec t = x * 1.44269504f + 0.5f;
  VecI32 n = __builtin_convertvector(t, VecI32);  // truncates; floor for negative t below
  Vec nf = __builtin_convertvector(n, Vec);
  const VecI32 too_big = nf > t;  // -1 where trunc rounded up
  n += too_big;
  nf = __builtin_convertvector(n, Vec);
  const Vec r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  return polynomial(r) * (Vec)((n + 127) << 23);
#endif
}

// exp(x) for x <= 0, relative error ~1e-7.
inline Vec exp_nonpositive(Vec x) { return exp_reduced(x, exp_polynomial); }

// exp(x) for x <= 0 where the result is rounded to bf16 next (the probabilities of the bf16
// P.V tiles): on every float in [-87, 0] relative error <= 5.6e-5, and 0.01% of them round to
// another bf16 than exp_nonpositive's; ~3 fewer multiply-adds (a 1,024-token prompt's
// attention ~8% faster on the Xeon of model 207).
inline Vec exp_nonpositive_bf16(Vec x) { return exp_reduced(x, exp_polynomial_bf16); }

// A vector's values rounded to T (bf16: to nearest even, as c10 rounds) and widened back.
inline Vec round_as(Vec v, float) { return v; }
inline Vec round_as(Vec v, c10::BFloat16) {
  VecU32 u;
  std::memcpy(&u, &v, sizeof u);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline void store_vec(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
inline void store_vec(c10::BFloat16* p, Vec v) {
  const Vec rounded = round_as(v, c10::BFloat16{});  // exact in bf16: its top 16 bits are the value
  for (int64_t i = 0; i < kLanes; ++i) p[i].x = static_cast<uint16_t>(std::bit_cast<uint32_t>(rounded[i]) >> 16);
}

}  // namespace pdserve_cpu

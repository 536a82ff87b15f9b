// The first index of a row's largest value, as torch.argmax answers it: NaN ranks above
// every number (the first NaN wins), ties go to the lowest index. bf16 values are compared
// as the fp32 values they widen to exactly, so a bf16 row has the argmax of its fp32 copy.
// Two vector passes: the first for the maximum (and whether a NaN is there), the second for
// the first lane equal to it, the row still in L2 from the first. A row may be taken in
// parts (one thread's columns each): merge_argmax joins them in column order.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "vec_math.h"

namespace pdserve_cpu {

// A bit per lane of mask (lanes of all ones or zeros) that is set, lane 0 lowest: one
// instruction where extracting the lanes one by one takes kLanes.
inline uint32_t lane_bits(VecI32 mask) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask);
#elif defined(__AVX__)
  return static_cast<uint32_t>(_mm256_movemask_ps((__m256)mask));
#else
  uint32_t bits = 0;
  for (int64_t lane = 0; lane < kLanes; ++lane) bits |= static_cast<uint32_t>(mask[lane] != 0) << lane;
  return bits;
#endif
}

inline bool any_lane(VecI32 mask) { return lane_bits(mask) != 0; }

// A bit per lane of v equal to target (lane 0 lowest).
inline uint32_t equal_lanes(Vec v, Vec target) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
#elif defined(__AVX__)
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, target, _CMP_EQ_OQ)));
#else
  uint32_t bits = 0;
  for (int64_t lane = 0; lane < kLanes; ++lane) bits |= static_cast<uint32_t>(v[lane] == target[lane]) << lane;
  return bits;
#endif
}

// The argmax of some columns of a row.
struct ArgmaxPart {
  int64_t index = -1;  // the winning column; -1: no columns
  float value = 0.f;   // its value
  bool is_nan = false;  // the value is the first NaN
};

// The argmax of x [n] (n >= 0), its index counted from x.
template <typename T>
ArgmaxPart argmax_part(const T* x, int64_t n) {
  if (n <= 0) return {};
  Vec maxima = Vec{} - std::numeric_limits<float>::infinity();
  VecI32 nan_lanes{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = load_vec(x + i);
    nan_lanes |= (v != v);
    maxima = v > maxima ? v : maxima;
  }
  float maximum = -std::numeric_limits<float>::infinity();
  bool has_nan = any_lane(nan_lanes);
  for (int64_t lane = 0; lane < kLanes; ++lane) maximum = std::max(maximum, maxima[lane]);
  for (int64_t j = i; j < n; ++j) {
    has_nan |= std::isnan(to_float(x[j]));
    maximum = std::max(maximum, to_float(x[j]));
  }
  if (has_nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(to_float(x[j]))) return {j, to_float(x[j]), true};
  }
  const Vec target = Vec{} + maximum;
  for (i = 0; i + kLanes <= n; i += kLanes) {
    const uint32_t equal = equal_lanes(load_vec(x + i), target);
    if (equal != 0) return {i + std::countr_zero(equal), maximum, false};
  }
  for (; i < n; ++i)
    if (to_float(x[i]) == maximum) return {i, maximum, false};
  return {0, to_float(x[0]), false};  // unreachable: the maximum is one of the values
}

// into: the argmax of the columns before next's (indices counted alike); next's wins only
// with a NaN first or a larger value, so ties keep the lower index.
inline void merge_argmax(ArgmaxPart& into, const ArgmaxPart& next) {
  if (next.index < 0 || into.is_nan) return;
  if (into.index < 0 || next.is_nan || next.value > into.value) into = next;
}

}  // namespace pdserve_cpu

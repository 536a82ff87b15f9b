// Greedy sampling's argmax over each row of fp32 or bf16 logits, as torch.argmax(dim=-1)
// answers it: the first index of the row's largest value, or of its first NaN where it has
// one. bf16 rows are compared as the fp32 values they widen to exactly, so a bf16 row has
// the argmax of its fp32 copy: greedy steps skip that copy (64 rows of a 49k vocabulary:
// 12.6 MB written and read again per decode step).
//
// torch's CPU argmax compares (value, index) pairs one element at a time: ~2.6 ms for 64
// rows of a 49,152-token vocabulary on the 2-core Zen 4 EPYC, more than a decode step's
// sampling and bookkeeping together. Here each row takes two vector passes, the first
// for its maximum (and whether it holds a NaN), the second for the first lane equal to it,
// the row still in L2 (196 KiB) from the first.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "check_message.h"
#include "vec_math.h"

namespace {

using pdserve_cpu::kLanes;
using pdserve_cpu::load_vec;
using pdserve_cpu::Vec;
typedef int32_t VecI32 __attribute__((vector_size(kLanes * sizeof(int32_t))));

// Rows per thread's task: a row is ~50k comparisons, too little to split alone.
constexpr int64_t kRowsPerTask = 4;

inline bool any_lane(VecI32 mask) {
  int32_t acc = 0;
  for (int64_t i = 0; i < kLanes; ++i) acc |= mask[i];
  return acc != 0;
}

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

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  using pdserve_cpu::to_float;
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
  if (has_nan) {  // torch ranks NaN above every number: the first NaN wins
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(to_float(x[j]))) return j;
  }
  const Vec target = Vec{} + maximum;
  for (i = 0; i + kLanes <= n; i += kLanes) {
    const uint32_t equal = equal_lanes(load_vec(x + i), target);
    if (equal != 0) return i + std::countr_zero(equal);
  }
  for (; i < n; ++i)
    if (to_float(x[i]) == maximum) return i;
  return 0;  // unreachable: the maximum is one of the row's values
}

template <typename T>
void argmax_each_row(const at::Tensor& logits, int64_t* out) {
  const int64_t num_rows = logits.size(0), n = logits.size(1), row_stride = logits.stride(0);
  const T* x = logits.const_data_ptr<T>();
  at::parallel_for(0, num_rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(x + r * row_stride, n);
  });
}

// logits [num_rows, vocab_size] fp32 or bf16, each row contiguous -> [num_rows] int64
at::Tensor argmax_rows(const at::Tensor& logits) {
  const bool dtype_taken = logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16;
  PDSERVE_CHECK_VALUE(logits.dim() == 2 && dtype_taken && logits.stride(1) == 1,
                      "argmax_rows: fp32 or bf16 [num_rows, vocab_size] logits with contiguous rows expected, got ",
                      logits.scalar_type(), " ", logits.sizes(), " strides ", logits.strides());
  PDSERVE_CHECK_VALUE(logits.size(1) > 0, "argmax_rows: rows of at least one value expected");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  if (logits.scalar_type() == at::kFloat)
    argmax_each_row<float>(logits, out.data_ptr<int64_t>());
  else
    argmax_each_row<c10::BFloat16>(logits, out.data_ptr<int64_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_sampling, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(pdserve_sampling, CPU, m) { m.impl("argmax_rows", &argmax_rows); }

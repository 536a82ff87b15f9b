// Greedy sampling's argmax over each row of fp32 or bf16 logits, as torch.argmax(dim=-1)
// answers it (argmax.h): greedy steps skip the fp32 copy of bf16 logits (64 rows of a 49k
// vocabulary: 12.6 MB written and read again per decode step).
//
// Random sampling's draw (draw_rows): each row's softmax CDF inverted at one uniform number,
// in three vector passes over the row where torch's softmax, float64 copy, cumulative sum,
// search and clamp took eight (~0.25 ms a row of a 49k vocabulary on the Zen 5 EPYC).
//
// torch's CPU argmax compares (value, index) pairs one element at a time: ~2.6 ms for 64
// rows of a 49,152-token vocabulary on the 2-core Zen 4 EPYC, more than a decode step's
// sampling and bookkeeping together; argmax.h's two vector passes a row take a fraction.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "argmax.h"
#include "check_message.h"

namespace {

// Rows per thread's task: a row is ~50k comparisons, too little to split alone.
constexpr int64_t kRowsPerTask = 4;

template <typename T>
void argmax_each_row(const at::Tensor& logits, int64_t* out) {
  const int64_t num_rows = logits.size(0), n = logits.size(1), row_stride = logits.stride(0);
  const T* x = logits.const_data_ptr<T>();
  at::parallel_for(0, num_rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = pdserve_cpu::argmax_part(x + r * row_stride, n).index;
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

// Columns whose weights are summed as one float before the float64 running total: short
// enough that a float sum of at most kChunk weights <= 1 loses nothing a draw can see.
constexpr int64_t kChunk = 32 * pdserve_cpu::kLanes;

// exp(x - maximum) for each lane of x, 0 where x is -inf (a token truncation removed: it must
// not be drawn, where exp_nonpositive's clamp at -87 would give it 1.6e-38).
inline pdserve_cpu::Vec weights_of(pdserve_cpu::Vec x, float maximum) {
  using pdserve_cpu::Vec;
  using pdserve_cpu::VecI32;
  const Vec w = pdserve_cpu::exp_nonpositive(x - maximum);
  const VecI32 finite = x != -std::numeric_limits<float>::infinity();
  return (Vec)((VecI32)w & finite);
}

inline float weight_of(float x, float maximum) {
  if (x == -std::numeric_limits<float>::infinity()) return 0.f;
  return weights_of(pdserve_cpu::Vec{} + x, maximum)[0];  // the same polynomial as the vectors
}

// The token of row x [n] whose interval of the softmax CDF holds u in [0, 1).
int64_t draw_row(const float* x, int64_t n, double u) {
  using pdserve_cpu::kLanes;
  using pdserve_cpu::Vec;
  const pdserve_cpu::ArgmaxPart top = pdserve_cpu::argmax_part(x, n);
  if (top.is_nan || top.value == -std::numeric_limits<float>::infinity() ||
      top.value == std::numeric_limits<float>::infinity())
    return top.index;  // no distribution to draw from: the first NaN, largest or +inf value
  const float maximum = top.value;
  const int64_t num_chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> chunk_sums(num_chunks);
  double total = 0.0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t begin = c * kChunk, end = std::min(n, begin + kChunk);
    Vec acc{};
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes) acc += weights_of(pdserve_cpu::load_vec(x + i), maximum);
    float sum = pdserve_cpu::hsum(acc);
    for (; i < end; ++i) sum += weight_of(x[i], maximum);
    chunk_sums[c] = sum;
    total += sum;
  }
  const double target = u * total;
  double below = 0.0;  // the weight of the columns before chunk c
  for (int64_t c = 0; c < num_chunks; ++c) {
    if (below + chunk_sums[c] <= target) {
      below += chunk_sums[c];
      continue;
    }
    // Column by column in float64: the first whose running total passes the target has a
    // weight > 0. The chunk's float sum may differ from this in its last bits; when the
    // columns fall short, the search goes on in the next chunk.
    const int64_t begin = c * kChunk, end = std::min(n, begin + kChunk);
    for (int64_t i = begin; i < end; ++i) {
      below += weight_of(x[i], maximum);
      if (below > target) return i;
    }
  }
  // u * total rounded up to total: the last column with a weight (as torch's clamp to the
  // first index where the CDF reaches its end).
  for (int64_t i = n - 1; i >= 0; --i)
    if (weight_of(x[i], maximum) > 0.f) return i;
  return top.index;
}

// logits [num_rows, vocab_size] fp32 (temperature applied, -inf where truncated), each row
// contiguous; uniforms [num_rows] float64 in [0, 1) -> [num_rows] int64
at::Tensor draw_rows(const at::Tensor& logits, const at::Tensor& uniforms) {
  PDSERVE_CHECK_VALUE(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
                      "draw_rows: fp32 [num_rows, vocab_size] logits with contiguous rows expected, got ",
                      logits.scalar_type(), " ", logits.sizes(), " strides ", logits.strides());
  PDSERVE_CHECK_VALUE(logits.size(1) > 0, "draw_rows: rows of at least one value expected");
  PDSERVE_CHECK_VALUE(uniforms.dim() == 1 && uniforms.scalar_type() == at::kDouble &&
                          uniforms.size(0) == logits.size(0) && uniforms.is_contiguous(),
                      "draw_rows: float64 [num_rows] uniforms expected, got ", uniforms.scalar_type(), " ",
                      uniforms.sizes());
  const int64_t num_rows = logits.size(0), n = logits.size(1), row_stride = logits.stride(0);
  at::Tensor out = at::empty({num_rows}, logits.options().dtype(at::kLong));
  const float* x = logits.const_data_ptr<float>();
  const double* u = uniforms.const_data_ptr<double>();
  int64_t* token_ids = out.data_ptr<int64_t>();
  at::parallel_for(0, num_rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) token_ids[r] = draw_row(x + r * row_stride, n, u[r]);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_sampling, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("draw_rows(Tensor logits, Tensor uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_sampling, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("draw_rows", &draw_rows);
}

// Greedy sampling's argmax over each row of fp32 or bf16 logits, as torch.argmax(dim=-1)
// answers it (argmax.h): greedy steps skip the fp32 copy of bf16 logits (64 rows of a 49k
// vocabulary: 12.6 MB written and read again per decode step).
//
// Random sampling's draw (draw_rows): each row's softmax CDF inverted at one uniform number,
// in three vector passes over the row where torch's softmax, float64 copy, cumulative sum,
// search and clamp took eight (~0.25 ms a row of a 49k vocabulary on the Zen 5 EPYC).
//
// top_p (top_p_mask_rows_): the smallest set of most likely tokens whose mass reaches p, found
// from a histogram of the logits' distance below the row's maximum (1/16 nat a bucket) instead
// of a softmax, top-k candidates and a sort: only the tokens of the one bucket where the mass
// crosses p are sorted.
//
// torch's CPU argmax compares (value, index) pairs one element at a time: ~2.6 ms for 64
// rows of a 49,152-token vocabulary on the 2-core Zen 4 EPYC, more than a decode step's
// sampling and bookkeeping together; argmax.h's two vector passes a row take a fraction.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
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

// Buckets of the top_p histogram: kBucketsPerNat per nat of distance below the maximum, up
// to kNearNats; every token further below (weight < e^-16, 1.1e-7 of the top one) shares
// the last bucket.
constexpr float kBucketsPerNat = 16.f;
constexpr float kNearNats = 16.f;
constexpr int32_t kFarBucket = static_cast<int32_t>(kBucketsPerNat * kNearNats);

// Keep the most likely tokens of row x [n] until their mass reaches p: a token stays while
// the mass ranked above it is < p (so the one that crosses p stays, and the top one); the
// others become -inf. Ties within the bucket where the mass crosses p rank by column.
void top_p_row(float* x, int64_t n, float p, std::vector<int32_t>& buckets) {
  using pdserve_cpu::kLanes;
  using pdserve_cpu::Vec;
  using pdserve_cpu::VecI32;
  const pdserve_cpu::ArgmaxPart top = pdserve_cpu::argmax_part(x, n);
  if (top.is_nan || top.value == -std::numeric_limits<float>::infinity() ||
      top.value == std::numeric_limits<float>::infinity())
    return;  // no distribution to truncate
  const float maximum = top.value;
  buckets.resize(n);
  double mass[kFarBucket + 1] = {};
  Vec far_acc{};  // the far bucket's weights, summed as vectors: most of a vocabulary lies there
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = pdserve_cpu::load_vec(x + i);
    const Vec distance = maximum - v;  // >= 0; +inf for -inf logits
    const VecI32 near = distance < kNearNats;
    const Vec scaled = near ? distance * kBucketsPerNat : Vec{};  // no conversion of inf
    VecI32 bucket = __builtin_convertvector(scaled, VecI32);
    bucket = near ? bucket : VecI32{} + kFarBucket;
    std::memcpy(buckets.data() + i, &bucket, sizeof bucket);
    const Vec w = weights_of(v, maximum);
    far_acc += (Vec)((VecI32)w & ~near);
    for (int64_t lane = 0; lane < kLanes; ++lane)
      if (near[lane]) mass[std::min(bucket[lane], kFarBucket)] += w[lane];
  }
  for (; i < n; ++i) {
    const float distance = maximum - x[i];
    const int32_t bucket =
        distance < kNearNats ? std::min(static_cast<int32_t>(distance * kBucketsPerNat), kFarBucket) : kFarBucket;
    buckets[i] = bucket;
    mass[bucket] += weight_of(x[i], maximum);
  }
  mass[kFarBucket] += pdserve_cpu::hsum(far_acc);
  double total = 0.0;
  for (double m : mass) total += m;
  const double target = static_cast<double>(p) * total;
  double above = 0.0;  // the mass of the buckets before `crossing`
  int32_t crossing = 0;
  while (crossing < kFarBucket && above + mass[crossing] < target) above += mass[crossing++];
  // Tokens of buckets past `crossing` have at least `target` above them; those of `crossing`
  // are ranked one by one.
  std::vector<std::pair<float, int64_t>> ranked;  // (-weight, column): most likely first
  for (i = 0; i < n; ++i) {
    if (buckets[i] > crossing)
      x[i] = -std::numeric_limits<float>::infinity();
    else if (buckets[i] == crossing && x[i] != -std::numeric_limits<float>::infinity())
      ranked.emplace_back(-weight_of(x[i], maximum), i);
  }
  std::sort(ranked.begin(), ranked.end());
  for (const auto& [negative_weight, column] : ranked) {
    if (above >= target) x[column] = -std::numeric_limits<float>::infinity();
    above -= negative_weight;
  }
}

// logits [num_rows, vocab_size] fp32 (temperature applied), each row contiguous, truncated in
// place; top_p [num_rows] fp32, 1 for a row to leave whole.
void top_p_mask_rows_(at::Tensor logits, const at::Tensor& top_p) {
  PDSERVE_CHECK_VALUE(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
                      "top_p_mask_rows_: fp32 [num_rows, vocab_size] logits with contiguous rows expected, got ",
                      logits.scalar_type(), " ", logits.sizes(), " strides ", logits.strides());
  PDSERVE_CHECK_VALUE(top_p.dim() == 1 && top_p.scalar_type() == at::kFloat && top_p.size(0) == logits.size(0) &&
                          top_p.is_contiguous(),
                      "top_p_mask_rows_: fp32 [num_rows] top_p expected, got ", top_p.scalar_type(), " ",
                      top_p.sizes());
  const int64_t num_rows = logits.size(0), n = logits.size(1), row_stride = logits.stride(0);
  float* x = logits.data_ptr<float>();
  const float* p = top_p.const_data_ptr<float>();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> buckets;
    for (int64_t r = begin; r < end; ++r)
      if (p[r] < 1.f) top_p_row(x + r * row_stride, n, p[r], buckets);
  });
}

}  // namespace

TORCH_LIBRARY(pdserve_sampling, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("draw_rows(Tensor logits, Tensor uniforms) -> Tensor");
  m.def("top_p_mask_rows_(Tensor(a!) logits, Tensor top_p) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_sampling, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("draw_rows", &draw_rows);
  m.impl("top_p_mask_rows_", &top_p_mask_rows_);
}

// Greedy sampling's argmax over each row of fp32 or bf16 logits, as torch.argmax(dim=-1)
// answers it (argmax.h): greedy steps skip the fp32 copy of bf16 logits (64 rows of a 49k
// vocabulary: 12.6 MB written and read again per decode step).
//
// Random sampling over the rows of a logits tensor, each row by sample_row.h: the draw
// (draw_rows: the softmax CDF inverted at one uniform number, in three vector passes over the
// row where torch's softmax, float64 copy, cumulative sum, search and clamp took eight, ~0.25
// ms a row of a 49k vocabulary on the Zen 5 EPYC) and the truncations in place, min_p
// (min_p_mask_rows_), top_k (top_k_mask_rows_) and top_p (top_p_mask_rows_); and the
// logprobs the sampler reports (logprobs_rows: the log-softmax at the taken token and at the
// row's top tokens, without writing the whole log-softmax or sorting it).
//
// torch's CPU argmax compares (value, index) pairs one element at a time: ~2.6 ms for 64
// rows of a 49,152-token vocabulary on the 2-core Zen 4 EPYC, more than a decode step's
// sampling and bookkeeping together; argmax.h's two vector passes a row take a fraction.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "argmax.h"
#include "check_message.h"
#include "sample_row.h"

namespace {

using namespace pdserve_cpu::sampling;

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

// One in-place truncation over the rows of logits [num_rows, vocab_size] fp32 (contiguous
// rows), row r by row_op(row, vocab_size, per_row[r], scratch): per_row [num_rows] of dtype
// (`expected` names it, as "fp32 [num_rows] top_p"; op names the caller in errors), rows_per_task
// rows to a thread's task, each task with its own scratch.
template <typename V, typename RowOp>
void truncate_rows(const char* op, at::Tensor& logits, const at::Tensor& per_row, at::ScalarType dtype,
                   const char* expected, int64_t rows_per_task, RowOp row_op) {
  PDSERVE_CHECK_VALUE(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1, op,
                      ": fp32 [num_rows, vocab_size] logits with contiguous rows expected, got ",
                      logits.scalar_type(), " ", logits.sizes(), " strides ", logits.strides());
  PDSERVE_CHECK_VALUE(per_row.dim() == 1 && per_row.scalar_type() == dtype && per_row.size(0) == logits.size(0) &&
                          per_row.is_contiguous(),
                      op, ": ", expected, " expected, got ", per_row.scalar_type(), " ", per_row.sizes());
  const int64_t num_rows = logits.size(0), n = logits.size(1), row_stride = logits.stride(0);
  float* x = logits.data_ptr<float>();
  const V* values = per_row.const_data_ptr<V>();
  at::parallel_for(0, num_rows, rows_per_task, [&](int64_t begin, int64_t end) {
    RowScratch scratch;
    for (int64_t r = begin; r < end; ++r) row_op(x + r * row_stride, n, values[r], scratch);
  });
}

// logits [num_rows, vocab_size] fp32, each row contiguous, truncated in place: a token less
// likely than min_p times the most likely one (its logit below the maximum + log(min_p))
// becomes -inf; min_p [num_rows] fp32, 0 for a row to leave whole.
void min_p_mask_rows_(at::Tensor logits, const at::Tensor& min_p) {
  truncate_rows<float>("min_p_mask_rows_", logits, min_p, at::kFloat, "fp32 [num_rows] min_p", kRowsPerTask,
                       [](float* row, int64_t n, float p, RowScratch&) { min_p_row(row, n, p); });
}

// logits [num_rows, vocab_size] fp32, each row contiguous, truncated in place; top_k
// [num_rows] int64, <= 0 or >= vocab_size for a row to leave whole.
void top_k_mask_rows_(at::Tensor logits, const at::Tensor& top_k) {
  truncate_rows<int64_t>("top_k_mask_rows_", logits, top_k, at::kLong, "int64 [num_rows] top_k", 1,
                         [](float* row, int64_t n, int64_t k, RowScratch& scratch) {
                           top_k_row(row, n, k, scratch.candidates);
                         });
}

// logits [num_rows, vocab_size] fp32 (temperature applied), each row contiguous, truncated in
// place; top_p [num_rows] fp32, 1 for a row to leave whole.
void top_p_mask_rows_(at::Tensor logits, const at::Tensor& top_p) {
  truncate_rows<float>("top_p_mask_rows_", logits, top_p, at::kFloat, "fp32 [num_rows] top_p", 1,
                       [](float* row, int64_t n, float p, RowScratch& scratch) {
                         top_p_row(row, n, p, scratch.buckets);
                       });
}

// logits [num_rows, vocab_size] fp32 (before temperature and truncation), each row
// contiguous; token_ids [num_rows] int64, the token each row took; num_top in [0, vocab_size]
// -> (logprobs [num_rows, 1 + num_top] fp32: log_softmax(row) at its token, then at its top
// num_top tokens; top_ids [num_rows, num_top] int64, the top tokens, most likely first, equal
// logits by id) (row_logprobs).
std::tuple<at::Tensor, at::Tensor> logprobs_rows(const at::Tensor& logits, const at::Tensor& token_ids,
                                                 int64_t num_top) {
  PDSERVE_CHECK_VALUE(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
                      "logprobs_rows: fp32 [num_rows, vocab_size] logits with contiguous rows expected, got ",
                      logits.scalar_type(), " ", logits.sizes(), " strides ", logits.strides());
  const int64_t num_rows = logits.size(0), n = logits.size(1), row_stride = logits.stride(0);
  PDSERVE_CHECK_VALUE(token_ids.dim() == 1 && token_ids.scalar_type() == at::kLong && token_ids.size(0) == num_rows &&
                          token_ids.is_contiguous(),
                      "logprobs_rows: int64 [num_rows] token_ids expected, got ", token_ids.scalar_type(), " ",
                      token_ids.sizes());
  PDSERVE_CHECK_VALUE(num_top >= 0 && num_top <= n, "logprobs_rows: num_top must be in [0, ", n, "], got ", num_top);
  const int64_t* ids = token_ids.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < num_rows; ++r)
    PDSERVE_CHECK_VALUE(ids[r] >= 0 && ids[r] < n, "logprobs_rows: token id ", ids[r], " of row ", r,
                        " is outside the vocabulary's ", n);
  at::Tensor logprobs = at::empty({num_rows, 1 + num_top}, logits.options());
  at::Tensor top_ids = at::empty({num_rows, num_top}, logits.options().dtype(at::kLong));
  const float* x = logits.const_data_ptr<float>();
  float* out = logprobs.data_ptr<float>();
  int64_t* top = top_ids.data_ptr<int64_t>();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<float, int64_t>> heap;
    for (int64_t r = begin; r < end; ++r) {
      float* row_out = out + r * (1 + num_top);
      row_logprobs(x + r * row_stride, n, ids[r], num_top, row_out, top + r * num_top, row_out + 1, heap);
    }
  });
  return {logprobs, top_ids};
}

}  // namespace

TORCH_LIBRARY(pdserve_sampling, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("draw_rows(Tensor logits, Tensor uniforms) -> Tensor");
  m.def("min_p_mask_rows_(Tensor(a!) logits, Tensor min_p) -> ()");
  m.def("top_k_mask_rows_(Tensor(a!) logits, Tensor top_k) -> ()");
  m.def("top_p_mask_rows_(Tensor(a!) logits, Tensor top_p) -> ()");
  m.def("logprobs_rows(Tensor logits, Tensor token_ids, int num_top) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pdserve_sampling, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("draw_rows", &draw_rows);
  m.impl("min_p_mask_rows_", &min_p_mask_rows_);
  m.impl("top_k_mask_rows_", &top_k_mask_rows_);
  m.impl("top_p_mask_rows_", &top_p_mask_rows_);
  m.impl("logprobs_rows", &logprobs_rows);
}

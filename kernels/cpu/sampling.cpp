// Greedy sampling's argmax over each row of fp32 or bf16 logits, as torch.argmax(dim=-1)
// answers it (argmax.h): greedy steps skip the fp32 copy of bf16 logits (64 rows of a 49k
// vocabulary: 12.6 MB written and read again per decode step).
//
// Random sampling over the rows of a logits tensor, each row by sample_row.h: the draw
// (draw_rows: the softmax CDF inverted at one uniform number, in three vector passes over the
// row where torch's softmax, float64 copy, cumulative sum, search and clamp took eight, ~0.25
// ms a row of a 49k vocabulary on the Zen 5 EPYC) and the truncations in place, min_p
// (min_p_mask_rows_), top_k (top_k_mask_rows_) and top_p (top_p_mask_rows_).
//
// torch's CPU argmax compares (value, index) pairs one element at a time: ~2.6 ms for 64
// rows of a 49,152-token vocabulary on the 2-core Zen 4 EPYC, more than a decode step's
// sampling and bookkeeping together; argmax.h's two vector passes a row take a fraction.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
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

}  // namespace

TORCH_LIBRARY(pdserve_sampling, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("draw_rows(Tensor logits, Tensor uniforms) -> Tensor");
  m.def("min_p_mask_rows_(Tensor(a!) logits, Tensor min_p) -> ()");
  m.def("top_k_mask_rows_(Tensor(a!) logits, Tensor top_k) -> ()");
  m.def("top_p_mask_rows_(Tensor(a!) logits, Tensor top_p) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_sampling, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("draw_rows", &draw_rows);
  m.impl("min_p_mask_rows_", &min_p_mask_rows_);
  m.impl("top_k_mask_rows_", &top_k_mask_rows_);
  m.impl("top_p_mask_rows_", &top_p_mask_rows_);
}

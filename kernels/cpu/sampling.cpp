// Greedy sampling's argmax over each row of fp32 or bf16 logits, as torch.argmax(dim=-1)
// answers it (argmax.h): greedy steps skip the fp32 copy of bf16 logits (64 rows of a 49k
// vocabulary: 12.6 MB written and read again per decode step).
//
// torch's CPU argmax compares (value, index) pairs one element at a time: ~2.6 ms for 64
// rows of a 49,152-token vocabulary on the 2-core Zen 4 EPYC, more than a decode step's
// sampling and bookkeeping together; argmax.h's two vector passes a row take a fraction.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

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

}  // namespace

TORCH_LIBRARY(pdserve_sampling, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(pdserve_sampling, CPU, m) { m.impl("argmax_rows", &argmax_rows); }

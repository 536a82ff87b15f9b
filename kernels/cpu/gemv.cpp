// Matrix-vector products for decode steps: y [M, N] = x [M, K] @ W [N, K]^T (+ bias), M
// small (a few decode rows), x bf16, W either bf16 in its plain row-major layout or
// GGUF's Q4_1 blocks as the file stores them.
//
// At one token a linear is a stream over its weight, and what sets the speed is how the
// weight is read. Each thread here reads its share of W's rows strictly in order, one row
// at a time, so the hardware prefetcher sees a single sequential stream: ~31 GB/s on
// the 2-core EPYC, against ~18-20 GB/s for oneDNN's packed GEMV (whose blocked layout
// reads several rows at once) and for the same kernel taking four rows at a time.
// AVX512-BF16's dot product takes pairs of bf16 into fp32 lanes; the sum is fp32 and
// rounds to bf16 once. Q4_1 (per 32 columns: fp16 d, fp16 m, 16 bytes of nibbles, the
// weight d * q + m) streams its 20-byte blocks the same way: the nibbles become bf16
// codes through a 16-entry table, one dot product per x row gives sum q x, and
// y = sum over blocks of d * (sum q x) + m * (sum x), in fp32 with d and m exact.
// Built without AVX512-BF16, the ops raise and callers keep their other kernels.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string_view>
#include <vector>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 4;  // rows of x; more would read W once per group of them
constexpr int64_t kStep = 32;    // bf16 values per 512-bit load
constexpr int64_t kQ4Block = 32;      // Q4_1 columns per block
constexpr int64_t kQ4BlockBytes = 20;  // fp16 d, fp16 m, 16 bytes of nibbles

#ifdef __AVX512BF16__
template <int M>
void gemv_rows(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* y,
               int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const at::BFloat16* row = w + n * K;
    // Two accumulators per x row halve the chain of dependent dot products.
    __m512 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 2 * kStep <= K; k += 2 * kStep) {
      __m512i w0 = _mm512_loadu_si512(row + k);
      __m512i w1 = _mm512_loadu_si512(row + k + kStep);
      for (int m = 0; m < M; ++m) {
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], (__m512bh)w1,
                                     (__m512bh)_mm512_loadu_si512(x + m * K + k + kStep));
      }
    }
    if (k < K) {  // K is a multiple of kStep: one step left at most
      __m512i w0 = _mm512_loadu_si512(row + k);
      for (int m = 0; m < M; ++m)
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
    }
    const float b = bias == nullptr ? 0.0f : static_cast<float>(bias[n]);
    for (int m = 0; m < M; ++m)
      y[m * N + n] = at::BFloat16(_mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) + b);
  }
}

// x_sums [M, K / 32]: each row's sum over each block's columns, for the m terms.
template <int M>
void q4_1_rows(const at::BFloat16* x, const float* x_sums, const uint8_t* blocks, const at::BFloat16* bias,
               at::BFloat16* y, int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t num_blocks = K / kQ4Block;
  // bf16 bit patterns of 0.0 .. 15.0, indexed by code.
  alignas(64) int16_t table_bits[32];
  for (int i = 0; i < 32; ++i) table_bits[i] = static_cast<int16_t>(c10::BFloat16(static_cast<float>(i % 16)).x);
  const __m512i table = _mm512_load_si512(table_bits);
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = blocks + n * num_blocks * kQ4BlockBytes;
    __m512 acc[M];
    float m_terms[M];
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm512_setzero_ps();
      m_terms[m] = 0.f;
    }
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* block = row + b * kQ4BlockBytes;
      uint16_t d_bits, m_bits;
      std::memcpy(&d_bits, block, 2);
      std::memcpy(&m_bits, block + 2, 2);
      const float d = _cvtsh_ss(d_bits), min = _cvtsh_ss(m_bits);
      const __m128i nibbles = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
      // Columns 0-15 are the low nibbles, 16-31 the high ones.
      const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(nibbles, 4), low_mask),
                                             _mm_and_si128(nibbles, low_mask));
      const __m512i q = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes), table);  // 32 bf16 codes
      const __m512 d_vec = _mm512_set1_ps(d);
      for (int m = 0; m < M; ++m) {
        const __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)q,
                                            (__m512bh)_mm512_loadu_si512(x + m * K + b * kQ4Block));
        acc[m] = _mm512_fmadd_ps(d_vec, dot, acc[m]);
        m_terms[m] += min * x_sums[m * num_blocks + b];
      }
    }
    const float bias_n = bias == nullptr ? 0.0f : static_cast<float>(bias[n]);
    for (int m = 0; m < M; ++m) y[m * N + n] = at::BFloat16(_mm512_reduce_add_ps(acc[m]) + m_terms[m] + bias_n);
  }
}
#endif

void check_x_and_bias(const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t N, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x must be bf16 [M, K], got ",
              x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, op, ": 1 to ", kMaxRows, " rows of x, got ", x.size(0));
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous(), op,
                ": a contiguous bf16 bias of ", N, " values expected");
  }
}

at::Tensor q4_1_gemv(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& blocks) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) % kQ4BlockBytes == 0,
              "q4_1_gemv: blocks must be contiguous uint8 [N, K / 32 * 20], got ", blocks.scalar_type(), " ",
              blocks.sizes());
  const int64_t N = blocks.size(0), K = blocks.size(1) / kQ4BlockBytes * kQ4Block;
  check_x_and_bias(x, bias, N, "q4_1_gemv");
  TORCH_CHECK(x.size(1) == K, "q4_1_gemv: x has ", x.size(1), " columns, the blocks ", K);
#ifdef __AVX512BF16__
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), num_blocks = K / kQ4Block;
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  std::vector<float> x_sums(M * num_blocks);
  for (int64_t i = 0; i < M * num_blocks; ++i) {
    float sum = 0.f;
    for (int64_t j = 0; j < kQ4Block; ++j) sum += static_cast<float>(xp[i * kQ4Block + j]);
    x_sums[i] = sum;
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const at::BFloat16* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const float* sp = x_sums.data();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    switch (M) {
      case 1: q4_1_rows<1>(xp, sp, wp, bp, yp, K, N, begin, end); break;
      case 2: q4_1_rows<2>(xp, sp, wp, bp, yp, K, N, begin, end); break;
      case 3: q4_1_rows<3>(xp, sp, wp, bp, yp, K, N, begin, end); break;
      default: q4_1_rows<4>(xp, sp, wp, bp, yp, K, N, begin, end); break;
    }
  });
  return y;
#else
  TORCH_CHECK(false, "q4_1_gemv: built for a CPU without AVX512-BF16");
#endif
}

at::Tensor bf16_gemv(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "bf16_gemv: the weight must be contiguous bf16 [N, K], got ", weight.scalar_type(), " ",
              weight.sizes(), weight.is_contiguous() ? "" : " (not contiguous)");
  check_x_and_bias(x, bias, weight.size(0), "bf16_gemv");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K == weight.size(1), "bf16_gemv: x has ", K, " columns, the weight ", weight.size(1));
  TORCH_CHECK(K % kStep == 0, "bf16_gemv: in_features must be a multiple of ", kStep, ", got ", K);
#ifdef __AVX512BF16__
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // Contiguous row ranges per thread: each thread's reads stay one sequential stream.
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    switch (M) {
      case 1: gemv_rows<1>(xp, wp, bp, yp, K, N, begin, end); break;
      case 2: gemv_rows<2>(xp, wp, bp, yp, K, N, begin, end); break;
      case 3: gemv_rows<3>(xp, wp, bp, yp, K, N, begin, end); break;
      default: gemv_rows<4>(xp, wp, bp, yp, K, N, begin, end); break;
    }
  });
  return y;
#else
  TORCH_CHECK(false, "bf16_gemv: built for a CPU without AVX512-BF16");
#endif
}

// The compiled model's linears by the id its graphs hold (a oneDNN-packed weight is opaque
// to the compiler, so the graph names it by number): the packed weight, and the
// row-major bf16 copy where steps of up to kMaxRows rows take the GEMV. Choosing here, in
// one C++ op, saves the ~5 us of a Python op per call (121 calls per step of SmolLM2).
struct PrepackedLinear {
  at::Tensor packed;
  std::optional<at::Tensor> row_major;
};
std::mutex linears_mutex;
std::vector<std::optional<PrepackedLinear>> linears;

void register_linear(int64_t weight_id, const at::Tensor& packed, const std::optional<at::Tensor>& row_major) {
  TORCH_CHECK(weight_id >= 0, "register_linear: weight_id must be >= 0, got ", weight_id);
  if (row_major.has_value())
    TORCH_CHECK(row_major->dim() == 2 && row_major->scalar_type() == at::kBFloat16 && row_major->is_contiguous(),
                "register_linear: the row-major weight must be contiguous bf16 [N, K]");
  std::lock_guard<std::mutex> lock(linears_mutex);
  if (static_cast<int64_t>(linears.size()) <= weight_id) linears.resize(weight_id + 1);
  linears[weight_id] = PrepackedLinear{packed, row_major};
}

void release_linear(int64_t weight_id) {
  std::lock_guard<std::mutex> lock(linears_mutex);
  if (weight_id >= 0 && weight_id < static_cast<int64_t>(linears.size())) linears[weight_id].reset();
}

at::Tensor prepacked_linear(const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t weight_id,
                            int64_t out_features) {
  PrepackedLinear linear;
  {
    std::lock_guard<std::mutex> lock(linears_mutex);
    TORCH_CHECK(weight_id >= 0 && weight_id < static_cast<int64_t>(linears.size()) && linears[weight_id].has_value(),
                "prepacked_linear: no linear is registered as ", weight_id);
    linear = *linears[weight_id];
  }
  at::Tensor y;
  if (linear.row_major.has_value() && x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows) {
    y = bf16_gemv(x, bias, *linear.row_major);
  } else {
    static const auto pointwise =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                              std::string_view, c10::List<std::optional<at::Scalar>>,
                              std::optional<std::string_view>)>();
    c10::List<std::optional<at::Scalar>> scalars;
    scalars.push_back(at::Scalar(-1));
    y = pointwise.call(x.contiguous(), linear.packed, bias, "none", scalars, std::string_view(""));
  }
  TORCH_CHECK(y.size(-1) == out_features, "prepacked_linear: linear ", weight_id, " has ", y.size(-1),
              " outputs, the caller expects ", out_features);
  return y;
}

bool bf16_gemv_supported() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(pdserve_gemv, m) {
  m.def("bf16_gemv(Tensor x, Tensor? bias, Tensor weight) -> Tensor");
  m.def("q4_1_gemv(Tensor x, Tensor? bias, Tensor blocks) -> Tensor");
  m.def("supported() -> bool", &bf16_gemv_supported);
  m.def("register_linear(int weight_id, Tensor packed, Tensor? row_major) -> ()", &register_linear);
  m.def("release_linear(int weight_id) -> ()", &release_linear);
  m.def("prepacked_linear(Tensor x, Tensor? bias, int weight_id, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_gemv, CPU, m) {
  m.impl("bf16_gemv", &bf16_gemv);
  m.impl("q4_1_gemv", &q4_1_gemv);
  m.impl("prepacked_linear", &prepacked_linear);
}

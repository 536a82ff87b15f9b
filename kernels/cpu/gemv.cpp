// Matrix-vector products for decode steps: y [M, N] = x [M, K] @ W [N, K]^T (+ bias), M
// small (a few decode rows), W either plain row-major (bf16 or fp32, x of the same dtype)
// or GGUF's Q4_1 / Q8_0 blocks rearranged in groups of 16 rows (gguf_row_groups.h; x bf16
// or fp32, y in x's dtype).
//
// At one token a linear is a stream over its weight, and what sets the speed is how the
// weight is read. Each thread here reads its share of W's rows strictly in order, one row
// (or group of rows) at a time, so the hardware prefetcher sees a single sequential
// stream: ~31 GB/s on the 2-core Zen 4 EPYC, against ~18-20 GB/s for oneDNN's packed GEMV
// (whose blocked layout reads several rows at once) and for the same kernel taking four
// rows at a time. Each W row's stream is also asked for 4 KB ahead, non-temporally
// (stream_prefetch.h): on the Zen 5 EPYC an fp32 model's single stream 15.9 -> 15.0 and
// 17.0 -> 15.7 ms a token (the two forms taking turns per prompt, paired -0.34 / -0.51 ms).
//
// Two builds of the dense math, chosen at compile time (-march):
// - AVX512-BF16: a bf16 W's dot products take pairs of bf16 into fp32 lanes (no
//   conversion).
// - Elsewhere (AVX2 + FMA, or AVX-512 without BF16): bf16 x is widened to fp32 once per call,
//   W's bf16 values to fp32 in registers (a shift: exact), and every product is an fp32 FMA.
// GGUF blocks' products are integer in every build: x is quantized per 32-column block to int8
// (scale max |x| / 127, as llama.cpp's Q8_1), which changes the numerics by that rounding
// of x (tests/unit/kernels/test_cpu_linear.py states by how much).
// Sums are fp32 and round to the output dtype once.
// Built for a CPU with neither, the ops raise and callers keep their other kernels.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "check_message.h"
#include "gguf_panels.h"
#include "gguf_row_groups.h"
#include "panel_gemm.h"
#include "panel_gemm_amx.h"
#include "panel_gemm_fp32.h"
#include "stream_prefetch.h"

#if defined(__AVX512BF16__) || defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PDSERVE_GEMV 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 4;  // rows of x; more would read W once per group of them
// Steps of up to panel_gemm_max_rows() rows take panel_gemm where the linear has a panel
// copy (bf16 on AVX512-BF16, which then keeps no row-major copy for the GEMV); more take
// oneDNN (panel_gemm.h's measurements on the Zen 4 EPYC: even at 128 rows, behind from 192).
#ifdef PDSERVE_PANEL_GEMM_AMX
// With AMX, panel_gemm computes on the tiles (panel_gemm_amx.h), ahead of oneDNN's own AMX
// calls up to 128 rows on the 2-core Xeon; without them (refused by Linux, or
// PDSERVE_AMX_TILES=0) its vector tiles, several times slower, keep only the steps of up to
// 8 rows (behind oneDNN from 12 there). Prefill steps stay on oneDNN, so a linear always
// keeps its packed weight.
constexpr int64_t kMaxPanelRows = 128;
constexpr int64_t kMaxVectorPanelRows = 8;
constexpr bool kPanelsForAnyRows = false;
#else
constexpr int64_t kMaxPanelRows = 128;
// AMD from Zen 5 on (family 26) runs 512-bit vector ops at full width, where Zen 4 splits
// them in two halves: there panel_gemm stays ahead of oneDNN up to 1,024 rows (SmolLM2's
// 120 projections and head, 2 threads: 256 rows 71.5 vs 77.9 ms, 512 157.1 vs 167.5, 1,024
// 313.6 vs 326.5; level at 2,048).
constexpr int64_t kMaxPanelRowsFullWidth = 1024;
// Whether a linear may keep its panels alone, panel_gemm then serving steps of any size:
// at 2,048 rows it runs ~9% behind oneDNN on the Zen 4 EPYC, level at 256.
constexpr bool kPanelsForAnyRows = true;

bool amd_family_26_or_later() {
#if defined(__x86_64__)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amd = ebx == 0x68747541 && edx == 0x69746e65 && ecx == 0x444d4163;  // "AuthenticAMD"
  if (!amd || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  const unsigned base_family = (eax >> 8) & 0xf, family = base_family == 0xf ? base_family + ((eax >> 20) & 0xff) : base_family;
  return family >= 0x1a;
#else
  return false;
#endif
}
#endif
// kernels/cpu_linear.panel_gemm_max_rows() reads it.
int64_t panel_gemm_max_rows() {
#ifdef PDSERVE_PANEL_GEMM_AMX
  return pdserve_cpu::amx_tiles_usable() ? kMaxPanelRows : kMaxVectorPanelRows;
#else
  static const int64_t max_rows = amd_family_26_or_later() ? kMaxPanelRowsFullWidth : kMaxPanelRows;
  return max_rows;
#endif
}
// Steps of up to f32_panel_gemm_max_rows() fp32 rows take a linear's fp32 panels where it has
// them (panel_gemm_fp32.h; the linear then has no row-major copy). Builds without AVX-512:
// 2,048 (the scheduler's default step), where the AVX2 tiles stayed ahead of oneDNN's AVX2
// code at every count measured on SmolLM2's shapes (K <= 1,536), 1.3-3.1x at 8-64 rows,
// 1.1-1.3x at 96-512, 1.05-1.1x at 1,024-2,048. AVX-512 builds: 128, where the Zen 4 EPYC's
// AVX-512 tiles were 1.3-1.8x oneDNN's AVX-512 code at 4-48 rows, 1.07-1.13x at 64-128, level
// at 192-256 and behind it from ~512 (docs/benchmarks.md, "fp32 panels on AVX-512"). Past
// kF32UnblockedMaxRows the op runs the panels in blocks of rows (panel_gemm_fp32.h), with a
// row's bits unchanged: on the Zen 5 EPYC held to AVX2 the unblocked form fell to 0.88-0.99x
// oneDNN's AVX2 code at 2,048 rows, the blocks run at 0.98-1.0x (docs/benchmarks.md, "fp32
// panels in blocks of rows").
constexpr int64_t kMaxF32PanelRows = 2048;
constexpr int64_t kMaxF32PanelRowsAvx512 = 128;
int64_t f32_panel_gemm_max_rows() {
#if defined(PDSERVE_F32_PANEL_GEMM) && defined(__AVX512F__)
  return kMaxF32PanelRowsAvx512;
#elif defined(PDSERVE_F32_PANEL_GEMM)
  return kMaxF32PanelRows;
#else
  return 0;
#endif
}
// Steps of up to q8_0_max_rows() rows take a linear's Q8_0 blocks (a GGUF file's head) where it
// has them, more its panels or oneDNN. With AVX512-VNNI the row-group GEMV (8 rows a pass,
// prefetching) stays ahead of the head's bf16 panels at every count measured: SmolLM2's head
// on the 2-core Zen 5, 5 / 16 / 64 / 256 rows 0.59 / 1.00 / 3.52 / 13.75 ms against 0.94 /
// 1.32 / 4.33 / 16.09. Where panel_gemm runs on AMX tiles, and on AVX2 (two 8-row halves a
// pass), unmeasured past kMaxRows: they keep it.
constexpr int64_t kMaxQ8_0Rows = 256;
int64_t q8_0_max_rows() {
#ifdef PDSERVE_ROW_GROUPS_VNNI
#ifdef PDSERVE_PANEL_GEMM_AMX
  if (pdserve_cpu::amx_tiles_usable()) return kMaxRows;
#endif
  return kMaxQ8_0Rows;
#else
  return kMaxRows;
#endif
}
constexpr int64_t kStep = 32;    // bf16 values per 512-bit load; in_features' required multiple
// GGUF blocks (gguf_row_groups.h): columns per block, bytes per block and row.
using pdserve_cpu::BlockFormat;
using pdserve_cpu::for_num_rows;
using pdserve_cpu::is_panel_copy;
using pdserve_cpu::kBlockCols;
using pdserve_cpu::kPanelCols;
using pdserve_cpu::kQ4RowBytes;
using pdserve_cpu::kQ8RowBytes;

// dots<R>(m0) for x rows [m0, m0 + R) against one W row, covering x's M rows: all at once
// up to three; four as two pairs, the W row read again from L1 (all four at once ran
// ~40% slower than three on the Zen 4 EPYC, bf16 and fp32 alike). Each row's sums are
// the same either way.
template <int M, typename Dots>
inline void for_row_chunks(Dots&& dots) {
  if constexpr (M == 4) {
    dots.template operator()<2>(0);
    dots.template operator()<2>(2);
  } else {
    dots.template operator()<M>(0);
  }
}

#ifdef __AVX512BF16__
// x rows [m0, m0 + M) against one W row: each x row's two accumulators summed once.
template <int M>
inline void gemv_row_dots(const at::BFloat16* x, const at::BFloat16* row, const at::BFloat16* bias,
                          at::BFloat16* y, int64_t K, int64_t N, int64_t m0, int64_t n) {
  // Two accumulators per x row halve the chain of dependent dot products.
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const at::BFloat16* xm = x + m0 * K;
  int64_t k = 0;
  for (; k + 2 * kStep <= K; k += 2 * kStep) {
    __m512i w0 = _mm512_loadu_si512(row + k);
    __m512i w1 = _mm512_loadu_si512(row + k + kStep);
    for (int m = 0; m < M; ++m) {
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)w0, (__m512bh)_mm512_loadu_si512(xm + m * K + k));
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], (__m512bh)w1, (__m512bh)_mm512_loadu_si512(xm + m * K + k + kStep));
    }
  }
  if (k < K) {  // K is a multiple of kStep: one step left at most
    __m512i w0 = _mm512_loadu_si512(row + k);
    for (int m = 0; m < M; ++m)
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)w0, (__m512bh)_mm512_loadu_si512(xm + m * K + k));
  }
  const float b = bias == nullptr ? 0.0f : static_cast<float>(bias[n]);
  for (int m = 0; m < M; ++m)
    y[(m0 + m) * N + n] = at::BFloat16(_mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) + b);
}

template <int M>
void gemv_rows(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* y,
               int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const at::BFloat16* row = w + n * K;
    pdserve_cpu::prefetch_stream_ahead(row, K * static_cast<int64_t>(sizeof(at::BFloat16)));
    for_row_chunks<M>([&]<int R>(int64_t m0) { gemv_row_dots<R>(x, row, bias, y, K, N, m0, n); });
  }
}

#endif

#ifdef PDSERVE_GEMV
// The sum of a ymm's 8 lanes: the AVX2 build's vsum.
inline float hsum256(__m256 v) {
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

// fp32 vectors of the portable build: zmm with AVX-512, ymm with AVX2.
#if defined(__AVX512F__)
using VecF = __m512;
constexpr int64_t kLanes = 16;
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vset1(float v) { return _mm512_set1_ps(v); }
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VecF vload(const at::BFloat16* p) {  // bf16 is the top half of an fp32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(VecF v) { return _mm512_reduce_add_ps(v); }
#else
using VecF = __m256;
constexpr int64_t kLanes = 8;
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vset1(float v) { return _mm256_set1_ps(v); }
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VecF vload(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(VecF v) { return hsum256(v); }
#endif

// x [M, K] as fp32 rows, which the row loops below read for every W row: fp32 x in place
// (no ATen call, whose ~5 us adds up over the 120 linears of a step), bf16 x widened once.
struct FloatRows {
  std::vector<float> widened;
  const float* data;
};
FloatRows float_rows(const at::Tensor& x) {
  if (x.scalar_type() == at::kFloat && x.is_contiguous()) return {{}, x.data_ptr<float>()};
  FloatRows rows{std::vector<float>(x.numel()), nullptr};
  const at::Tensor xc = x.contiguous();
  if (x.scalar_type() == at::kBFloat16) {
    const at::BFloat16* src = xc.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < x.numel(); ++i) rows.widened[i] = static_cast<float>(src[i]);
  } else {
    std::memcpy(rows.widened.data(), xc.data_ptr<float>(), x.numel() * sizeof(float));
  }
  rows.data = rows.widened.data();
  return rows;
}

// fp32 x rows [m0, m0 + M) against one W row of type T (fp32, or bf16 widened in
// registers), fp32 FMAs.
template <int M, typename T>
inline void gemv_row_dots_fp32_math(const float* x, const T* row, const T* bias, T* y, int64_t K, int64_t N,
                                    int64_t m0, int64_t n) {
  VecF acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = vzero();
  const float* xm = x + m0 * K;
  int64_t k = 0;
  for (; k + 2 * kLanes <= K; k += 2 * kLanes) {
    const VecF w0 = vload(row + k), w1 = vload(row + k + kLanes);
    for (int m = 0; m < M; ++m) {
      acc[m][0] = vfma(w0, vload(xm + m * K + k), acc[m][0]);
      acc[m][1] = vfma(w1, vload(xm + m * K + k + kLanes), acc[m][1]);
    }
  }
  for (; k < K; k += kLanes) {  // K is a multiple of kStep, so of kLanes
    const VecF w0 = vload(row + k);
    for (int m = 0; m < M; ++m) acc[m][0] = vfma(w0, vload(xm + m * K + k), acc[m][0]);
  }
  const float b = bias == nullptr ? 0.0f : static_cast<float>(bias[n]);
  for (int m = 0; m < M; ++m) y[(m0 + m) * N + n] = T(vsum(acc[m][0] + acc[m][1]) + b);
}

// W of type T, fp32 x [M, K]: x's rows against each W row in turn.
template <int M, typename T>
void gemv_rows_fp32_math(const float* x, const T* w, const T* bias, T* y, int64_t K, int64_t N, int64_t n_begin,
                         int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const T* row = w + n * K;
    pdserve_cpu::prefetch_stream_ahead(row, K * static_cast<int64_t>(sizeof(T)));
    for_row_chunks<M>([&]<int R>(int64_t m0) { gemv_row_dots_fp32_math<R>(x, row, bias, y, K, N, m0, n); });
  }
}

#endif

void check_x_and_bias(const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t N, at::ScalarType dtype,
                      const char* op, int64_t max_rows = kMaxRows) {
  PDSERVE_CHECK(x.dim() == 2 && x.scalar_type() == dtype, op, ": x must be ", dtype, " [M, K], got ", x.scalar_type(),
                " ", x.sizes());
  PDSERVE_CHECK(x.size(0) >= 1, op, ": x has no rows");
  PDSERVE_CHECK(x.size(0) <= max_rows, op, ": 1 to ", max_rows, " rows of x, got ", x.size(0));
  if (bias.has_value()) {
    PDSERVE_CHECK(bias->scalar_type() == dtype && bias->numel() == N && bias->is_contiguous(), op, ": a contiguous ",
                  dtype, " bias of ", N, " values expected");
  }
}

// Row ranges per thread, contiguous: each thread's reads stay one sequential stream.
template <typename RowsFn>
void for_row_ranges(int64_t M, int64_t N, RowsFn rows) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for_num_rows(M, [&](auto num_rows) { rows(num_rows, begin, end); });
  });
}

// y [M, N] = x @ W^T (+ bias) over GGUF blocks in groups of 16 rows (gguf_row_groups.h),
// for any number of rows of x: decode steps and prompts alike. torch's int4 and int8
// kernels, the alternative, take ~0.6 ms per row of x over SmolLM2's Q4_1 projections
// (linear in the rows: 164 ms at 256 rows against 65 ms for oneDNN over bf16 weights).
// Each thread takes a run of groups (row_groups_gemv), so W is read from memory once per call.
constexpr int64_t kQuantizeGrainRows = 16;  // x's quantization splits over threads from this many rows

template <BlockFormat kFormat>
at::Tensor row_group_gemv(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& blocks,
                          const char* op) {
  constexpr int64_t kRowBytes = kFormat == BlockFormat::kQ4_1 ? kQ4RowBytes : kQ8RowBytes;
  PDSERVE_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                    blocks.size(1) % kRowBytes == 0,
                op, ": blocks must be contiguous uint8 [N, K / 32 * ", kRowBytes, "] (", op, "_blocks), got ",
                blocks.scalar_type(), " ", blocks.sizes());
  const int64_t N = blocks.size(0), K = blocks.size(1) / kRowBytes * kBlockCols;
  PDSERVE_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op,
                ": x must be bf16 or fp32, got ", x.scalar_type());
  check_x_and_bias(x, bias, N, x.scalar_type(), op, /*max_rows=*/std::numeric_limits<int64_t>::max());
  PDSERVE_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " columns, the blocks ", K);
#ifdef PDSERVE_ROW_GROUPS
  using pdserve_cpu::kGroupRows;
  const int64_t M = x.size(0), num_blocks = K / kBlockCols;
  const int64_t num_groups = (N + kGroupRows - 1) / kGroupRows;
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const at::Tensor xc = x.contiguous();
  pdserve_cpu::BlockQuantizedX xq(M * num_blocks);
  at::parallel_for(0, M, kQuantizeGrainRows, [&](int64_t begin, int64_t end) {
    if (x.scalar_type() == at::kBFloat16)
      pdserve_cpu::quantize_x_blocks(xc.const_data_ptr<c10::BFloat16>(), begin * num_blocks, end * num_blocks, xq);
    else
      pdserve_cpu::quantize_x_blocks(xc.const_data_ptr<float>(), begin * num_blocks, end * num_blocks, xq);
  });
  const std::vector<uint8_t> padded_last = pdserve_cpu::pad_last_group<kFormat>(wp, N, num_blocks);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "row_group_gemv", [&] {
    const scalar_t* bp = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    // 4 groups (64 rows) at least per thread, each thread's groups one stream.
    at::parallel_for(0, num_groups, 4, [&](int64_t begin, int64_t end) {
      pdserve_cpu::row_groups_gemv<kFormat>(xq, M, wp, N, num_blocks, padded_last.data(), bp, yp, begin, end);
    });
  });
  return y;
#else
  PDSERVE_CHECK(false, op, ": built for a CPU without AVX2, FMA and F16C");
#endif
}

at::Tensor q4_1_gemv(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& blocks) {
  return row_group_gemv<BlockFormat::kQ4_1>(x, bias, blocks, "q4_1_gemv");
}

at::Tensor q8_0_gemv(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& blocks) {
  return row_group_gemv<BlockFormat::kQ8_0>(x, bias, blocks, "q8_0_gemv");
}

at::Tensor gemv(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& weight) {
  PDSERVE_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat) &&
                    weight.is_contiguous(),
                "gemv: the weight must be contiguous bf16 or fp32 [N, K], got ", weight.scalar_type(), " ",
                weight.sizes(), weight.is_contiguous() ? "" : " (not contiguous)");
  check_x_and_bias(x, bias, weight.size(0), weight.scalar_type(), "gemv");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  PDSERVE_CHECK(K == weight.size(1), "gemv: x has ", K, " columns, the weight ", weight.size(1));
  PDSERVE_CHECK(K % kStep == 0, "gemv: in_features must be a multiple of ", kStep, ", got ", K);
#ifdef PDSERVE_GEMV
  at::Tensor y = at::empty({M, N}, x.options());
  if (weight.scalar_type() == at::kFloat) {
    const at::Tensor xc = x.contiguous();  // fp32 already: no widening copy
    const float* wp = weight.data_ptr<float>();
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    for_row_ranges(M, N, [&](auto rows, int64_t begin, int64_t end) {
      gemv_rows_fp32_math<decltype(rows)::value>(xc.data_ptr<float>(), wp, bp, yp, K, N, begin, end);
    });
    return y;
  }
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
#ifdef __AVX512BF16__
  const at::Tensor xc = x.contiguous();
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  for_row_ranges(M, N, [&](auto rows, int64_t begin, int64_t end) {
    gemv_rows<decltype(rows)::value>(xp, wp, bp, yp, K, N, begin, end);
  });
#else
  const FloatRows xf = float_rows(x);
  for_row_ranges(M, N, [&](auto rows, int64_t begin, int64_t end) {
    gemv_rows_fp32_math<decltype(rows)::value>(xf.data, wp, bp, yp, K, N, begin, end);
  });
#endif
  return y;
#else
  PDSERVE_CHECK(false, "gemv: built for a CPU without AVX2 and FMA");
#endif
}

// W [N, K]'s panel copy of `shape` (its dtype, named `dtype_name` in the errors), written
// into `out` where given, each thread packing a run of panels: pack(w, panels, K, begin, end).
template <typename T, typename Pack>
at::Tensor pack_panel_copy(const at::Tensor& weight, const std::optional<at::Tensor>& out,
                           const std::vector<int64_t>& shape, const char* dtype_name, Pack pack) {
  if (out.has_value())
    PDSERVE_CHECK(out->sizes() == at::IntArrayRef(shape) && out->scalar_type() == weight.scalar_type() &&
                      out->is_contiguous(),
                  "pack_panels: out must be contiguous ", dtype_name, " ", at::IntArrayRef(shape), ", got ",
                  out->scalar_type(), " ", out->sizes());
  const at::Tensor wc = weight.contiguous();
  at::Tensor panels = out.has_value() ? *out : at::empty(shape, weight.options());
  const T* wp = wc.const_data_ptr<T>();
  T* pp = panels.data_ptr<T>();
  const int64_t K = weight.size(1);
  at::parallel_for(0, shape[0], 1, [&](int64_t begin, int64_t end) { pack(wp, pp, K, begin, end); });
  return panels;
}

// W [N, K] fp32 row-major -> its panel copy [N / 16, K, 16] (panel_gemm_fp32.h), into `out`
// where given.
at::Tensor pack_f32_panels(const at::Tensor& weight, const std::optional<at::Tensor>& out) {
  const int64_t N = weight.size(0), K = weight.size(1);
  PDSERVE_CHECK(N % pdserve_cpu::kF32PanelCols == 0 && N > 0 && K > 0,
                "pack_panels: an fp32 weight's out_features must be a multiple of 16, got [", N, ", ", K, "]");
#ifdef PDSERVE_F32_PANEL_GEMM
  return pack_panel_copy<float>(weight, out, {N / pdserve_cpu::kF32PanelCols, K, pdserve_cpu::kF32PanelCols}, "fp32",
                                 pdserve_cpu::pack_f32_panels);
#else
  PDSERVE_CHECK(false, "pack_panels: built for a CPU without AVX2 and FMA");
#endif
}

// W [N, K] row-major -> its panel copy, written into `out` where given (memory the caller
// chose: huge pages, so no second copy): bf16 [N / 32, K / 2, 32, 2] (panel_gemm.h), fp32
// [N / 16, K, 16] (panel_gemm_fp32.h).
at::Tensor pack_panels(const at::Tensor& weight, const std::optional<at::Tensor>& out) {
  PDSERVE_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
                "pack_panels: the weight must be bf16 or fp32 [N, K], got ", weight.scalar_type(), " ", weight.sizes());
  if (weight.scalar_type() == at::kFloat) return pack_f32_panels(weight, out);
  const int64_t N = weight.size(0), K = weight.size(1);
  PDSERVE_CHECK(N % kPanelCols == 0 && K % 2 == 0 && N > 0 && K > 0,
                "pack_panels: out_features must be a multiple of 32 and in_features of 2, got [", N, ", ", K, "]");
#ifdef PDSERVE_PANEL_GEMM
  return pack_panel_copy<at::BFloat16>(weight, out, {N / kPanelCols, K / 2, kPanelCols, 2}, "bf16",
                                       pdserve_cpu::pack_panels);
#else
  PDSERVE_CHECK(false, "pack_panels: built for a CPU without AVX512-BF16");
#endif
}

// panel_gemm's x [M, K] and bias [N]: the panels' dtype (named `dtype_name` in the errors).
void check_panel_gemm_inputs(const at::Tensor& x, const std::optional<at::Tensor>& bias, at::ScalarType dtype,
                             const char* dtype_name, int64_t K, int64_t N) {
  PDSERVE_CHECK(x.dim() == 2 && x.scalar_type() == dtype, "panel_gemm: x must be ", dtype_name, " [M, K] for ",
                dtype_name, " panels, got ", x.scalar_type(), " ", x.sizes());
  PDSERVE_CHECK(x.size(1) == K, "panel_gemm: x has ", x.size(1), " columns, the weight ", K);
  if (bias.has_value())
    PDSERVE_CHECK(bias->scalar_type() == dtype && bias->numel() == N && bias->is_contiguous(),
                  "panel_gemm: a contiguous ", dtype_name, " bias of ", N, " values expected");
}

// y [M, N] = x @ W^T (+ bias), fp32, W as pack_panels made it from an fp32 weight: what an
// fp32 linear's steps of up to f32_panel_gemm_max_rows() rows take (it then has no row-major
// copy).
at::Tensor f32_panel_gemm(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& panels) {
  const int64_t num_panels = panels.size(0), N = num_panels * pdserve_cpu::kF32PanelCols, K = panels.size(1);
  check_panel_gemm_inputs(x, bias, at::kFloat, "fp32", K, N);
#ifdef PDSERVE_F32_PANEL_GEMM
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const at::Tensor xc = x.contiguous();
  if (M > pdserve_cpu::kF32UnblockedMaxRows) {
    // Each thread a run of whole tiles of rows, in blocks packed where it reads them.
    const int64_t tile_rows = pdserve_cpu::kF32TileRows;
    at::parallel_for(0, (M + tile_rows - 1) / tile_rows, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> x_block;  // kept: a prompt's calls reuse it
      x_block.resize(pdserve_cpu::f32_block_floats(K));
      pdserve_cpu::f32_panel_gemm_rows(xc.const_data_ptr<float>(), panels.const_data_ptr<float>(),
                                       bias.has_value() ? bias->const_data_ptr<float>() : nullptr,
                                       y.data_ptr<float>(), K, N, begin * tile_rows, std::min(M, end * tile_rows),
                                       x_block.data());
    });
    return y;
  }
  at::Tensor x_tiles = xc;  // one row: already as the tiles read it
  if (M > 1) {
    x_tiles = at::empty({M, K}, x.options());
    at::parallel_for(0, pdserve_cpu::num_f32_x_tiles(M), 1, [&](int64_t begin, int64_t end) {
      pdserve_cpu::pack_f32_x_tiles(xc.const_data_ptr<float>(), x_tiles.data_ptr<float>(), M, K, begin, end);
    });
  }
  const pdserve_cpu::F32PanelGemm gemm{x_tiles.const_data_ptr<float>(), panels.const_data_ptr<float>(),
                                       bias.has_value() ? bias->const_data_ptr<float>() : nullptr,
                                       y.data_ptr<float>(), M, K, N};
  // Each thread a run of whole panels, read front to back.
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    pdserve_cpu::f32_panel_gemm_panels(gemm, begin, end);
  });
  return y;
#else
  PDSERVE_CHECK(false, "panel_gemm: built for a CPU without AVX2 and FMA");
#endif
}

// y [M, N] = x @ W^T (+ bias), any number of rows, W as pack_panels made it: bf16 (what a
// bf16 linear's decode steps take on AVX512-BF16, which then has no row-major copy), or fp32
// (f32_panel_gemm).
at::Tensor panel_gemm(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& panels) {
  if (pdserve_cpu::is_f32_panel_copy(panels)) return f32_panel_gemm(x, bias, panels);
  PDSERVE_CHECK(is_panel_copy(panels),
                "panel_gemm: the panels must be contiguous bf16 [N / 32, K / 2, 32, 2] or fp32 [N / 16, K, 16] "
                "(pack_panels), got ", panels.scalar_type(), " ", panels.sizes());
  const int64_t num_panels = panels.size(0), N = num_panels * kPanelCols, K = panels.size(1) * 2;
  check_panel_gemm_inputs(x, bias, at::kBFloat16, "bf16", K, N);
#ifdef PDSERVE_PANEL_GEMM
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const at::Tensor xc = x.contiguous();
  const at::BFloat16* xp = xc.const_data_ptr<at::BFloat16>();
  const at::BFloat16* pp = panels.const_data_ptr<at::BFloat16>();
  const at::BFloat16* bp = bias.has_value() ? bias->const_data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
#ifdef PDSERVE_PANEL_GEMM_AMX
  if (K % pdserve_cpu::kAmxK == 0 && pdserve_cpu::amx_tiles_usable()) {
    // The A tiles read whole blocks of 16 rows: a last partial block from a zero-padded copy
    // (this thread's, kept between calls: the workers read it while this thread waits).
    const int64_t num_tail = M % pdserve_cpu::kAmxRows;
    thread_local std::vector<at::BFloat16> tail;
    if (num_tail > 0) {
      tail.assign(pdserve_cpu::kAmxRows * K, at::BFloat16(0.f));
      std::memcpy(tail.data(), xp + (M - num_tail) * K, num_tail * K * sizeof(at::BFloat16));
    }
    const at::BFloat16* tail_rows = num_tail > 0 ? tail.data() : nullptr;
    at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
      pdserve_cpu::panel_gemm_panels_amx(xp, tail_rows, pp, bp, yp, M, K, N, begin, end);
    });
    return y;
  }
#endif
  // Each thread a run of whole panels, read front to back.
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    pdserve_cpu::panel_gemm_panels(xp, pp, bp, yp, M, K, N, begin, end);
  });
  return y;
#else
  PDSERVE_CHECK(false, "panel_gemm: built for a CPU without AVX512-BF16");
#endif
}

#ifdef PDSERVE_GGUF_PANELS
// Rows of x per pass over a thread's panels: 120 rows of K = 1,536 are 360 KB of bf16,
// which stay in L2 (1 MB a core on Zen 4 and 5) beside the panel being multiplied.
constexpr int64_t kPromptTileRows = 10 * pdserve_cpu::kPanelTileRows;
// A thread's widened panels at a time, written and read back within L2: at 2 MB (all of a
// thread's share of SmolLM2's gate_up) they spilled to L3 and a pass over the 120
// projections cost ~5 ms more (Zen 5: 24 rows 16.8 against 11.3 ms, 128-256 KB level).
constexpr int64_t kWidenedBytes = 256 << 10;

// From this many rows widening the weight pays: over SmolLM2's 120 projections on the
// Zen 5 EPYC, against torch's int4 kernel, 8 rows 7.75 against 6.75 ms, 12 rows 8.37
// against 9.20, 16 rows 9.89 against 11.96.
constexpr int64_t kPromptGemmMinRows = 12;

// Whether gguf_prompt_gemm takes this step: bf16 rows, at least min_rows of them, and whole panels.
bool gguf_prompt_gemm_applies(const at::Tensor& x, const at::Tensor& blocks, int64_t min_rows = kPromptGemmMinRows) {
  return x.dim() == 2 && x.size(0) >= min_rows && x.scalar_type() == at::kBFloat16 && blocks.dim() == 2 &&
         blocks.size(0) % pdserve_cpu::kPanelCols == 0;
}

// y [M, N] bf16 = x [M, K] bf16 @ W^T over Q4_1 or Q8_0 row groups for a prompt
// (gguf_panels.h): each thread widens its share of W's panels into bf16, kWidenedBytes at a
// time, and runs panel_gemm over each batch for every tile of x's rows. On the Zen 5 EPYC,
// SmolLM2's 120 projections as Q4_1: 64 rows 20.7 ms against torch's int4 kernel's 42.8,
// 256 rows 60.9 against 162.3, 1,024 rows 222 ms (int4 ~650; oneDNN over the dense bf16
// weights 227). Its products differ
// from the dense bf16 model's only by the weight's rounding; torch's int4 kernel also
// rounds d and m to bf16 (1.7e-3 against 3.0e-3 of the output's norm from fp32 math on
// bf16 x, measured on two layers).
template <BlockFormat kFormat>
at::Tensor gguf_prompt_gemm(const at::Tensor& x, const at::Tensor& blocks, const char* op) {
  constexpr int64_t kRowBytes = kFormat == BlockFormat::kQ4_1 ? kQ4RowBytes : kQ8RowBytes;
  PDSERVE_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.size(1) % kRowBytes == 0,
                op, ": blocks must be contiguous uint8 [N, K / 32 * ", kRowBytes, "], got ", blocks.scalar_type(),
                " ", blocks.sizes());
  const int64_t M = x.size(0), N = blocks.size(0), num_blocks = blocks.size(1) / kRowBytes,
                K = num_blocks * kBlockCols;
  PDSERVE_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " columns, the blocks ", K);
  using pdserve_cpu::kPanelCols;
  at::Tensor y = at::empty({M, N}, x.options());
  const at::Tensor xc = x.contiguous();
  const c10::BFloat16* xp = xc.const_data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const uint8_t* wp = blocks.const_data_ptr<uint8_t>();
  const int64_t panel_values = K * kPanelCols, panel_bytes = kPanelCols * blocks.size(1);
  // Panels widened at a time (one at least): a bounded buffer that stays in L2.
  const int64_t batch_panels = std::max<int64_t>(1, kWidenedBytes / (panel_values * 2));
  at::parallel_for(0, N / kPanelCols, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<c10::BFloat16> panels;  // kept: a prompt's 120 calls reuse it
    panels.resize(std::min(end - begin, batch_panels) * panel_values);
    for (int64_t first = begin; first < end; first += batch_panels) {
      const int64_t last = std::min(end, first + batch_panels);
      for (int64_t p = first; p < last; ++p) {
        c10::BFloat16* panel = panels.data() + (p - first) * panel_values;
        if constexpr (kFormat == BlockFormat::kQ4_1)
          pdserve_cpu::q4_1_groups_to_panel(wp + p * panel_bytes, num_blocks, panel);
        else
          pdserve_cpu::q8_0_groups_to_panel(wp + p * panel_bytes, num_blocks, panel);
      }
      for (int64_t m0 = 0; m0 < M; m0 += kPromptTileRows)
        pdserve_cpu::panel_gemm_panels(xp + m0 * K, panels.data(), nullptr, yp + m0 * N + first * kPanelCols,
                                       std::min(kPromptTileRows, M - m0), K, N, 0, last - first);
    }
  });
  return y;
}
#endif

// Whether this build has gguf_prompt_gemm (AVX512-BF16 and VNNI): a bf16 model's Q4_1 and
// int8 linears then need no copy for torch's kernels (kernels/cpu_linear.gguf_prompt_gemm_available).
bool gguf_prompt_gemm_built() {
#ifdef PDSERVE_GGUF_PANELS
  return true;
#else
  return false;
#endif
}

// A Q4_1 linear's one op for a compiled graph (the graph cannot branch on its unbacked
// token count): the row-group GEMV over the file's blocks for steps of up to kMaxRows rows
// where the blocks are given, gguf_prompt_gemm for bf16 steps from kPromptGemmMinRows rows
// (AVX512-BF16), torch's int4 kernel on its packed copy otherwise; x bf16 or fp32, the
// result in x's dtype. In C++ it saves a Python op's ~14 us per call (120 calls
// per step of SmolLM2). The GEMV takes any number of rows and is 2-3x faster than torch's
// kernel at every count, but it quantizes x to int8 per 32 columns (as llama.cpp does), and
// on prompts that rounding measurably costs agreement with the dense model (bundled
// SmolLM2 in bf16, 8 prompts x 32 greedy tokens, every step of 5+ rows on the GEMV: 0.64 ->
// 0.34 agreeing, perplexity 22.62 -> 22.74), where it lands in the KV cache that every
// later token reads. So prompts take x
// as it is (bf16), and larger decode-only steps take the GEMV in the native decode loop
// (decode_layers.cpp), which calls it directly.
at::Tensor q4_1_linear(const at::Tensor& x, const std::optional<at::Tensor>& packed,
                       const std::optional<at::Tensor>& scales_and_zeros, const std::optional<at::Tensor>& blocks,
                       int64_t group_size) {
  if (blocks.has_value() && x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows)
    return q4_1_gemv(x, std::nullopt, *blocks);
  const bool has_int4 = packed.has_value() && scales_and_zeros.has_value();
#ifdef PDSERVE_GGUF_PANELS
  // A linear without torch's copy (a bf16 model's, kept lean) takes the panels from 5 rows.
  if (blocks.has_value() && gguf_prompt_gemm_applies(x, *blocks, has_int4 ? kPromptGemmMinRows : kMaxRows + 1))
    return gguf_prompt_gemm<BlockFormat::kQ4_1>(x, *blocks, "q4_1_linear");
#endif
  PDSERVE_CHECK(has_int4, "q4_1_linear: this linear keeps no torch int4 copy, which a step of ", x.sizes(), " ",
                x.scalar_type(), " rows needs (a bf16 model's linears drop it where the prompt GEMM runs)");
  static const auto int4_mm = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("aten::_weight_int4pack_mm_for_cpu", "")
                                  .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&)>();
  // torch's int4 kernel takes bf16 x; an fp32 model's rows go over and come back, so that
  // its decode rows (the GEMV above) need no conversion in the graph at all.
  if (x.scalar_type() == at::kFloat)
    return int4_mm.call(x.to(at::kBFloat16), *packed, group_size, *scales_and_zeros).to(at::kFloat);
  return int4_mm.call(x, *packed, group_size, *scales_and_zeros);
}

// An int8 weight-only linear's one op for a compiled graph: decode steps of up to kMaxRows
// rows take the Q8_0 GEMV over its codes, each row's scale as every block's d (exact where
// the loader built the blocks: the scale fits fp16), bf16 prompts from kPromptGemmMinRows
// rows gguf_prompt_gemm over the same blocks, others torch's int8 kernel (bf16 x: an fp32
// model's rows go over and come back), for the reasons q4_1_linear gives.
at::Tensor int8_linear(const at::Tensor& x, const std::optional<at::Tensor>& codes, const at::Tensor& scales,
                       const std::optional<at::Tensor>& q8_0_blocks) {
  if (q8_0_blocks.has_value() && x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows)
    return q8_0_gemv(x, std::nullopt, *q8_0_blocks);
#ifdef PDSERVE_GGUF_PANELS
  // A linear without torch's codes (a bf16 model's, kept lean) takes the panels from 5 rows.
  if (q8_0_blocks.has_value() &&
      gguf_prompt_gemm_applies(x, *q8_0_blocks, codes.has_value() ? kPromptGemmMinRows : kMaxRows + 1))
    return gguf_prompt_gemm<BlockFormat::kQ8_0>(x, *q8_0_blocks, "int8_linear");
#endif
  PDSERVE_CHECK(codes.has_value(), "int8_linear: this linear keeps no int8 codes for torch's kernel, which a step of ",
                x.sizes(), " ", x.scalar_type(), " rows needs (a bf16 model's linears drop them where the prompt GEMM "
                "runs)");
  static const auto int8_mm = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("aten::_weight_int8pack_mm", "")
                                  .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  if (x.scalar_type() == at::kFloat) return int8_mm.call(x.to(at::kBFloat16), *codes, scales).to(at::kFloat);
  return int8_mm.call(x, *codes, scales);
}

// The compiled model's linears by the id its graphs hold (a oneDNN-packed weight is opaque
// to the compiler, so the graph names it by number): the packed weight (or none, where the
// panels serve every step), and where steps of up to kMaxRows rows take a GEMV, what it
// reads: a row-major copy (bf16 or fp32), or Q8_0 blocks (a GGUF's own head). Choosing
// here, in one C++ op, saves the ~5 us of a Python op per call (121 calls per step of
// SmolLM2).
struct PrepackedLinear {
  // none: the linear keeps one copy, its panels, and panel_gemm serves every step
  std::optional<at::Tensor> packed;
  std::optional<at::Tensor> row_major;
  std::optional<at::Tensor> q8_0_blocks;
  std::optional<at::Tensor> panels;  // pack_panels' copy of a bf16 or fp32 weight, or none
};
std::mutex linears_mutex;
std::vector<std::optional<PrepackedLinear>> linears;

void register_linear(int64_t weight_id, const std::optional<at::Tensor>& packed,
                     const std::optional<at::Tensor>& row_major, const std::optional<at::Tensor>& q8_0_blocks,
                     const std::optional<at::Tensor>& panels) {
  PDSERVE_CHECK(weight_id >= 0, "register_linear: weight_id must be >= 0, got ", weight_id);
  PDSERVE_CHECK(packed.has_value() || panels.has_value(),
                "register_linear: a linear without oneDNN's packed weight needs panels for every step");
  if (row_major.has_value())
    PDSERVE_CHECK(row_major->dim() == 2 && row_major->is_contiguous() &&
                      (row_major->scalar_type() == at::kBFloat16 || row_major->scalar_type() == at::kFloat),
                  "register_linear: the row-major weight must be contiguous bf16 or fp32 [N, K]");
  if (q8_0_blocks.has_value())
    PDSERVE_CHECK(q8_0_blocks->dim() == 2 && q8_0_blocks->is_contiguous() && q8_0_blocks->scalar_type() == at::kByte &&
                      q8_0_blocks->size(1) % kQ8RowBytes == 0,
                  "register_linear: Q8_0 blocks must be contiguous uint8 [N, K / 32 * 34]");
  if (panels.has_value())
    PDSERVE_CHECK(is_panel_copy(*panels) || pdserve_cpu::is_f32_panel_copy(*panels),
                  "register_linear: panels must be contiguous bf16 [N / 32, K / 2, 32, 2] or fp32 [N / 16, K, 16] "
                  "(pack_panels)");
  std::lock_guard<std::mutex> lock(linears_mutex);
  if (static_cast<int64_t>(linears.size()) <= weight_id) linears.resize(weight_id + 1);
  linears[weight_id] = PrepackedLinear{packed, row_major, q8_0_blocks, panels};
}

void release_linear(int64_t weight_id) {
  std::lock_guard<std::mutex> lock(linears_mutex);
  if (weight_id >= 0 && weight_id < static_cast<int64_t>(linears.size())) linears[weight_id].reset();
}

// The rows oneDNN's matmul is called with for num_rows rows of x: oneDNN builds (JIT-compiles)
// a primitive for every new row count, ~5 ms for each of a model's four linear shapes on the
// Xeon of model 207, which every prompt of a new length paid (its cache, 1,024 primitives,
// then thrashed under a serving mix). Rounded up to a multiple of 16, or of 1/32 of the row
// count's power of two from 512 rows (padding <= 3.1%), a few hundred primitives serve every
// step up to thousands of tokens. 0 (not 2-D) stays 0.
int64_t onednn_rows(int64_t num_rows) {
  if (num_rows <= 0) return num_rows;
  const int64_t granule = std::max<int64_t>(16, static_cast<int64_t>(std::bit_floor(static_cast<uint64_t>(num_rows))) / 32);
  return (num_rows + granule - 1) / granule * granule;
}

// The most rows of x prepacked_linear sends to panel_gemm over panels of x's dtype
// (panel_gemm_max_rows for bf16, f32_panel_gemm_max_rows for fp32); -1 where this build
// multiplies no panels of that dtype.
int64_t panel_rows_limit(at::ScalarType dtype) {
  if (dtype == at::kFloat) return f32_panel_gemm_max_rows();
#ifdef PDSERVE_PANEL_GEMM
  if (dtype == at::kBFloat16) return panel_gemm_max_rows();
#endif
  return -1;
}

// weight_id: a 0-d int64 CPU tensor, so that one compiled decoder layer serves every layer
// (each passes its own ids as inputs; an int would be a constant of the compiled code).
at::Tensor prepacked_linear(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                            const at::Tensor& weight_id_tensor, int64_t out_features) {
  PDSERVE_CHECK(weight_id_tensor.dim() == 0 && weight_id_tensor.scalar_type() == at::kLong &&
                    weight_id_tensor.is_cpu(),
                "prepacked_linear: weight_id must be a 0-d int64 CPU tensor");
  const int64_t weight_id = *weight_id_tensor.const_data_ptr<int64_t>();
  PrepackedLinear linear;
  {
    std::lock_guard<std::mutex> lock(linears_mutex);
    PDSERVE_CHECK(weight_id >= 0 && weight_id < static_cast<int64_t>(linears.size()) && linears[weight_id].has_value(),
                  "prepacked_linear: no linear is registered as ", weight_id);
    linear = *linears[weight_id];
  }
  at::Tensor y;
  const int64_t num_rows = x.dim() == 2 ? x.size(0) : 0;  // 0 for another shape: only oneDNN takes it
  const int64_t panel_rows = panel_rows_limit(x.scalar_type());
  if (num_rows >= 1 && num_rows <= q8_0_max_rows() && linear.q8_0_blocks.has_value()) {
    y = q8_0_gemv(x, bias, *linear.q8_0_blocks);
  } else if (num_rows >= 1 && num_rows <= kMaxRows && linear.row_major.has_value()) {
    y = gemv(x, bias, *linear.row_major);
  } else if (x.dim() == 2 && linear.panels.has_value() && x.scalar_type() == linear.panels->scalar_type() &&
             panel_rows >= 0 && (num_rows <= panel_rows || !linear.packed.has_value())) {
    y = panel_gemm(x, bias, *linear.panels);
  } else {
    PDSERVE_CHECK(linear.packed.has_value(), "prepacked_linear: linear ", weight_id,
                  " keeps only panels, which take [M, K] inputs of their dtype; got ", x.scalar_type(), " ", x.sizes());
    static const auto pointwise =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                              std::string_view, c10::List<std::optional<at::Scalar>>,
                              std::optional<std::string_view>)>();
    c10::List<std::optional<at::Scalar>> scalars;
    scalars.push_back(at::Scalar(-1));
    const int64_t padded_rows = onednn_rows(num_rows);
    if (padded_rows == num_rows) {
      y = pointwise.call(x.contiguous(), *linear.packed, bias, "none", scalars, std::string_view(""));
    } else {
      at::Tensor padded = at::empty({padded_rows, x.size(1)}, x.options());  // [padded_rows, K]
      padded.narrow(0, 0, num_rows).copy_(x);
      padded.narrow(0, num_rows, padded_rows - num_rows).zero_();
      y = pointwise.call(padded, *linear.packed, bias, "none", scalars, std::string_view("")).narrow(0, 0, num_rows);
    }
  }
  PDSERVE_CHECK(y.size(-1) == out_features, "prepacked_linear: linear ", weight_id, " has ", y.size(-1),
                " outputs, the caller expects ", out_features);
  return y;
}

bool panels_for_any_rows() { return kPanelsForAnyRows; }

// Whether this library was built with panel_gemm's AMX tiles (-march with AMX-BF16).
bool panel_gemm_amx_built() {
#ifdef PDSERVE_PANEL_GEMM_AMX
  return true;
#else
  return false;
#endif
}

// Whether panel_gemm computes on AMX tiles (panel_gemm_amx.h) in this process.
bool panel_gemm_amx_tiles() {
#ifdef PDSERVE_PANEL_GEMM_AMX
  return pdserve_cpu::amx_tiles_usable();
#else
  return false;
#endif
}

// Which build of the math this library holds: "avx512_bf16", "fp32_fma" or "" (none).
std::string gemv_isa() {
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(PDSERVE_GEMV)
  return "fp32_fma";
#else
  return "";
#endif
}

}  // namespace

TORCH_LIBRARY(pdserve_gemv, m) {
  m.def("gemv(Tensor x, Tensor? bias, Tensor weight) -> Tensor");
  m.def("q4_1_gemv(Tensor x, Tensor? bias, Tensor blocks) -> Tensor");
  m.def("q8_0_gemv(Tensor x, Tensor? bias, Tensor blocks) -> Tensor");
  m.def("q4_1_linear(Tensor x, Tensor? packed, Tensor? scales_and_zeros, Tensor? blocks, int group_size) -> Tensor");
  m.def("gguf_prompt_gemm_built() -> bool", &gguf_prompt_gemm_built);
  m.def("int8_linear(Tensor x, Tensor? codes, Tensor scales, Tensor? q8_0_blocks) -> Tensor");
  m.def("isa() -> str", &gemv_isa);
  m.def("pack_panels(Tensor weight, Tensor? out=None) -> Tensor");
  m.def("panel_gemm(Tensor x, Tensor? bias, Tensor panels) -> Tensor");
  m.def("panel_gemm_max_rows() -> int", &panel_gemm_max_rows);
  m.def("f32_panel_gemm_max_rows() -> int", &f32_panel_gemm_max_rows);
  m.def("q8_0_max_rows() -> int", &q8_0_max_rows);
  m.def("panels_for_any_rows() -> bool", &panels_for_any_rows);
  m.def("onednn_rows(int num_rows) -> int", &onednn_rows);
  m.def("panel_gemm_amx_built() -> bool", &panel_gemm_amx_built);
  m.def("panel_gemm_amx_tiles() -> bool", &panel_gemm_amx_tiles);
  m.def("register_linear(int weight_id, Tensor? packed, Tensor? row_major, Tensor? q8_0_blocks=None, "
        "Tensor? panels=None) -> ()",
        &register_linear);
  m.def("release_linear(int weight_id) -> ()", &release_linear);
  m.def("prepacked_linear(Tensor x, Tensor? bias, Tensor weight_id, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_gemv, CPU, m) {
  m.impl("gemv", &gemv);
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_gemm", &panel_gemm);
  m.impl("q4_1_gemv", &q4_1_gemv);
  m.impl("q8_0_gemv", &q8_0_gemv);
  m.impl("q4_1_linear", &q4_1_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("prepacked_linear", &prepacked_linear);
}

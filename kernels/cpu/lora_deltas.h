// LoRA adapters' deltas inside the native decode loop (decode_layers.cpp): each adapter a
// step's rows name adds scaling * (x A^T) B^T to those rows of a projection's output, after
// the projection's GEMV, as the compiled model's pdserve::add_lora_deltas does
// (common/engine/lora/layers.py): the shrink x A^T rounded to the model's dtype, the expand
// rounded to it, then y + scaling * delta rounded once, each accumulated in fp32.
//
// Adapters are registered once (register_decode_adapter: per layer the stacked A [k r, K] and
// B [N, k r] of qkv, o, gate_up and down, or none where the adapter does not target the
// projection) and named per step by id, one per row (-1: the base model). B is kept
// transposed in panels of kPanelCols columns, [N / kPanelCols, k r, kPanelCols] (bf16 on
// AVX512-BF16: ranks in pairs, paired_ranks), so that the expand runs along a thread's own
// output columns reading one contiguous stream: in a parallel region each thread shrinks its
// share of the rows' k r values, the threads meet, and each expands into the columns its GEMV
// wrote. A step of few rows skips the meeting: each thread shrinks every row itself, into its
// own scratch (a barrier costs more than the shrinks of a few rows).
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>

#include "check_message.h"
#include "vec_math.h"

namespace pdserve_cpu::lora {

constexpr int kNumProjections = 4;  // qkv, o, gate_up, down: a Llama layer's linears, in that order

// The expands take kRows rows and kChunks vectors of columns at once: each B^T vector read
// serves kRows rows, and the kRows * kChunks accumulators hide the FMAs' latency. Fewer rows
// where the vector registers are fewer (AVX2: 16). A panel of B^T is kChunks vectors wide.
constexpr int kChunks = 4;
constexpr int kRows = kLanes == 16 ? 4 : 2;
constexpr int64_t kPanelCols = kChunks * kLanes;
// Steps of up to this many rows shrink on every thread (no barrier).
constexpr int64_t kRedundantShrinkRows = 4;

// Each layer's projections' input and output widths, {K, N}, in kNumProjections' order: what an
// adapter's matrices must fit.
using Widths = std::vector<std::array<std::pair<int64_t, int64_t>, kNumProjections>>;

// Whether a bf16 adapter's expands run on AVX512-BF16 dot products (vdpbf16ps: a pair of
// ranks a lane, multiplied exactly and summed in fp32), its B^T panels then holding ranks in
// pairs; its shrinks, too, take x and A as bf16 pairs. A decode step of the bundled model
// with a rank-16 adapter on every projection, the Zen 5 EPYC: the deltas' added time at 1 / 8
// / 32 rows 0.78 / 1.54 / 4.34 -> 0.45 / 0.84 / 1.87 ms (docs/benchmarks.md, "The LoRA deltas
// in the loop on bf16 dot products").
#ifdef PDSERVE_BF16_DOT
inline bool paired_ranks(at::ScalarType dtype) { return dtype == at::kBFloat16; }
#else
inline bool paired_ranks(at::ScalarType) { return false; }
#endif

struct Pair {
  at::Tensor a;  // [R, K] the model's dtype; undefined: the adapter leaves the projection alone
  // B^T in column panels, zero past N: [ceil(N / kPanelCols), R, kPanelCols], or where
  // paired_ranks [ceil(N / kPanelCols), ceil(R / 2), kPanelCols, 2] (an odd R's last pair
  // padded with a zero rank)
  at::Tensor panels;
  int64_t out_features = 0;  // N
};

struct Adapter {
  std::vector<std::array<Pair, kNumProjections>> layers;
  float scaling;
  at::ScalarType dtype;
};

// The rows of a step that use one adapter.
struct Group {
  std::shared_ptr<const Adapter> adapter;
  std::vector<int64_t> rows;
};

// A step's adapters: its rows grouped by adapter, and scratch for each row's shrink [M, max R]
// (each thread its own where every thread shrinks every row: redundant).
struct Step {
  std::vector<Group> groups;
  std::vector<float> shrunk;
  int64_t max_rank = 0;
  int64_t num_rows = 0;  // M
  bool redundant = false;
  float* scratch(int t) { return shrunk.data() + (redundant ? t : 0) * num_rows * max_rank; }
};

inline std::mutex adapters_mutex;
inline std::vector<std::shared_ptr<const Adapter>> adapters;  // by id; released: null

using OptionalTensors = c10::List<std::optional<at::Tensor>>;

inline int64_t register_adapter(const OptionalTensors& a, const OptionalTensors& b, double scaling) {
  PDSERVE_CHECK_VALUE(a.size() == b.size() && a.size() > 0 && a.size() % kNumProjections == 0,
                      "register_decode_adapter: per layer an A and a B (or none) for each of qkv, o, gate_up, down");
  Adapter adapter{{}, static_cast<float>(scaling), at::ScalarType::Undefined};
  adapter.layers.resize(a.size() / kNumProjections);
  for (size_t i = 0; i < a.size(); ++i) {
    const std::optional<at::Tensor> ai = a.get(i), bi = b.get(i);
    PDSERVE_CHECK_VALUE(ai.has_value() == bi.has_value(), "register_decode_adapter: an A and a B together, or neither");
    if (!ai.has_value()) continue;
    if (adapter.dtype == at::ScalarType::Undefined) adapter.dtype = ai->scalar_type();
    PDSERVE_CHECK_VALUE(ai->dim() == 2 && bi->dim() == 2 && bi->size(1) == ai->size(0) &&
                            ai->scalar_type() == adapter.dtype && bi->scalar_type() == adapter.dtype &&
                            (adapter.dtype == at::kFloat || adapter.dtype == at::kBFloat16),
                        "register_decode_adapter: A [R, K] and B [N, R], both bf16 or both fp32 as the others, got ",
                        ai->scalar_type(), " ", ai->sizes(), " and ", bi->scalar_type(), " ", bi->sizes());
    const int64_t N = bi->size(0), R = bi->size(1), num_panels = (N + kPanelCols - 1) / kPanelCols;
    const bool paired = paired_ranks(adapter.dtype);
    const int64_t padded_rank = paired ? (R + 1) / 2 * 2 : R;
    at::Tensor padded = at::zeros({num_panels * kPanelCols, padded_rank}, bi->options());
    padded.narrow(0, 0, N).narrow(1, 0, R).copy_(*bi);
    at::Tensor panels =
        paired ? padded.view({num_panels, kPanelCols, padded_rank / 2, 2}).permute({0, 2, 1, 3}).contiguous()
               : padded.view({num_panels, kPanelCols, R}).transpose(1, 2).contiguous();
    adapter.layers[i / kNumProjections][i % kNumProjections] = Pair{ai->contiguous(), panels, N};
  }
  std::lock_guard<std::mutex> lock(adapters_mutex);
  adapters.push_back(std::make_shared<const Adapter>(std::move(adapter)));
  return static_cast<int64_t>(adapters.size()) - 1;
}

inline void release_adapter(int64_t adapter_id) {
  std::lock_guard<std::mutex> lock(adapters_mutex);
  if (adapter_id >= 0 && adapter_id < static_cast<int64_t>(adapters.size())) adapters[adapter_id].reset();
}

// The step of a model with these layers' input and output widths ([layer][projection] = {K, N})
// whose rows name lora_ids [M] int64 (-1: none): checked against the model (layers, widths,
// dtype), the adapters held for the step.
inline Step make_step(const at::Tensor& lora_ids, int64_t M, int num_threads, const Widths& widths,
                      at::ScalarType dtype, const char* op) {
  PDSERVE_CHECK_VALUE(lora_ids.dim() == 1 && lora_ids.numel() == M && lora_ids.scalar_type() == at::kLong &&
                          lora_ids.is_contiguous(),
                      op, ": lora_ids must be contiguous [num_tokens ", M, "] int64, got ", lora_ids.scalar_type(), " ",
                      lora_ids.sizes());
  Step step;
  const int64_t* ids = lora_ids.const_data_ptr<int64_t>();
  std::vector<int64_t> group_of;  // adapter id -> its group's index + 1 (0: none yet)
  for (int64_t m = 0; m < M; ++m) {
    const int64_t id = ids[m];
    if (id < 0) continue;
    if (id >= static_cast<int64_t>(group_of.size()) || group_of[id] == 0) {
      std::shared_ptr<const Adapter> adapter;
      {
        std::lock_guard<std::mutex> lock(adapters_mutex);
        if (id < static_cast<int64_t>(adapters.size())) adapter = adapters[id];
      }
      PDSERVE_CHECK_VALUE(adapter != nullptr, op, ": row ", m, " names LoRA adapter ", id, ", which is not registered");
      if (id >= static_cast<int64_t>(group_of.size())) group_of.resize(id + 1, 0);  // a registered id: bounded
      PDSERVE_CHECK_VALUE(adapter->layers.size() == widths.size() &&
                              (adapter->dtype == dtype || adapter->dtype == at::ScalarType::Undefined),
                          op, ": LoRA adapter ", id, " has ", static_cast<int64_t>(adapter->layers.size()),
                          " layers of ", adapter->dtype, "; the model ", static_cast<int64_t>(widths.size()), " of ",
                          dtype);
      for (size_t l = 0; l < widths.size(); ++l)
        for (int j = 0; j < kNumProjections; ++j) {
          const Pair& p = adapter->layers[l][j];
          if (!p.a.defined()) continue;
          PDSERVE_CHECK_VALUE(p.a.size(1) == widths[l][j].first && p.out_features == widths[l][j].second, op,
                              ": LoRA adapter ", id, "'s layer ", static_cast<int64_t>(l), " projection ", j,
                              " is A ", p.a.sizes(), " and B [", p.out_features, ", ", p.a.size(0),
                              "]; the model's is ", widths[l][j].first, " -> ", widths[l][j].second);
          step.max_rank = std::max(step.max_rank, p.a.size(0));
        }
      step.groups.push_back(Group{std::move(adapter), {}});
      group_of[id] = static_cast<int64_t>(step.groups.size());
    }
    step.groups[group_of[id] - 1].rows.push_back(m);
  }
  step.num_rows = M;
  step.redundant = M <= kRedundantShrinkRows;
  step.shrunk.resize((step.redundant ? num_threads : 1) * M * step.max_rank);
  return step;
}

inline float round_to(float v, float) { return v; }
inline float round_to(float v, c10::BFloat16) { return to_float(c10::BFloat16(v)); }

// The shrinks take kDots rows of A at once, so that x is read once for them and their
// accumulators run side by side (one alone waits on each FMA's latency).
constexpr int64_t kDots = 8;

// out[i] = x [K] . A's row i, rounded to T, for i < n <= kDots (kN: n known, else 0).
template <typename T, int64_t kN>
inline void dots(const T* x, const T* a, int64_t K, int64_t n, float* out) {
  const int64_t count = kN > 0 ? kN : n;
  Vec acc[kDots] = {};
  int64_t k = 0;
#ifdef PDSERVE_BF16_DOT
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // 32 of K at a time, as pairs
    __m512 pairs[kDots];
    for (int64_t i = 0; i < count; ++i) pairs[i] = _mm512_setzero_ps();
    for (; k + kBf16PerVec <= K; k += kBf16PerVec) {
      const __m512bh xv = load_bf16x32(x + k);
      for (int64_t i = 0; i < count; ++i) pairs[i] = _mm512_dpbf16_ps(pairs[i], xv, load_bf16x32(a + i * K + k));
    }
    for (int64_t i = 0; i < count; ++i) acc[i] = (Vec)pairs[i];
  }
#endif
  for (; k + kLanes <= K; k += kLanes) {
    const Vec xv = load_vec(x + k);
    for (int64_t i = 0; i < count; ++i) acc[i] += xv * load_vec(a + i * K + k);
  }
  for (int64_t i = 0; i < count; ++i) {
    float sum = hsum(acc[i]);
    for (int64_t kk = k; kk < K; ++kk) sum += to_float(x[kk]) * to_float(a[i * K + kk]);
    out[i] = round_to(sum, T{});
  }
}

// Part `part` of `num_parts` of the step's shrinks for projection j of layer l: each named
// row's x [K] times its adapter's A^T, rounded to T, into shrunk[m * max_rank ...] (a
// scratch of the step's). The parts split the (row, kDots rows of A) items evenly; every
// part must be done before an expand reads them.
template <typename T>
void shrink_part(const Step& step, size_t l, int j, const T* x, int64_t K, int part, int num_parts, float* shrunk) {
  int64_t total = 0;
  for (const Group& g : step.groups) {
    const Pair& p = g.adapter->layers[l][j];
    if (p.a.defined()) total += static_cast<int64_t>(g.rows.size()) * ((p.a.size(0) + kDots - 1) / kDots);
  }
  const int64_t begin = total * part / num_parts, end = total * (part + 1) / num_parts;
  int64_t first = 0;  // the group's first item
  for (const Group& g : step.groups) {
    const Pair& p = g.adapter->layers[l][j];
    if (!p.a.defined()) continue;
    const int64_t R = p.a.size(0), blocks = (R + kDots - 1) / kDots;
    const int64_t num_items = static_cast<int64_t>(g.rows.size()) * blocks;
    const T* a = p.a.const_data_ptr<T>();
    for (int64_t i = std::max(begin, first); i < std::min(end, first + num_items); ++i) {
      const int64_t m = g.rows[(i - first) / blocks], r0 = (i - first) % blocks * kDots;
      float* out = shrunk + m * step.max_rank + r0;
      if (R - r0 >= kDots)
        dots<T, kDots>(x + m * K, a + r0 * K, K, kDots, out);
      else
        dots<T, 0>(x + m * K, a + r0 * K, K, R - r0, out);
    }
    first += num_items;
  }
}

// Row out's kLanes columns from col (those before c1) += scaling * sums rounded to T, rounded
// to T: an expand's last step.
template <typename T>
inline void add_delta(T* out, int64_t col, int64_t c1, Vec sums, float scaling) {
  T* o = out + col;
  if (col + kLanes <= c1) {
    store_vec(o, load_vec(o) + (Vec{} + scaling) * round_as(sums, T{}));
  } else {  // the last columns of a width that is not whole vectors
    for (int64_t lane = 0; col + lane < c1; ++lane)
      o[lane] = T(to_float(o[lane]) + scaling * round_to(sums[lane], T{}));
  }
}

// Columns [c0, c1) (c0 a multiple of kLanes) of the rows out[i] [N] (i < kN): += scaling *
// round(s[i] [R] . B^T's columns), rounded to T, from B^T's panels.
template <typename T, int kN>
void expand_rows(const float* const* s, T* const* out, const Pair& p, int64_t R, float scaling, int64_t c0,
                 int64_t c1) {
  const T* panels = p.panels.const_data_ptr<T>();
  for (int64_t panel = c0 / kPanelCols; panel * kPanelCols < c1; ++panel) {
    const int64_t base = panel * kPanelCols;
    const int q0 = static_cast<int>((std::max(c0, base) - base) / kLanes);
    const int q1 = static_cast<int>((std::min(c1, base + kPanelCols) - base + kLanes - 1) / kLanes);
    const T* b = panels + panel * R * kPanelCols;
    Vec acc[kN][kChunks] = {};
    if (q0 == 0 && q1 == kChunks) {  // a whole panel: every loop bound known
      for (int64_t r = 0; r < R; ++r) {
        Vec bv[kChunks];
        for (int q = 0; q < kChunks; ++q) bv[q] = load_vec(b + r * kPanelCols + q * kLanes);
        for (int i = 0; i < kN; ++i) {
          const Vec sv = Vec{} + s[i][r];
          for (int q = 0; q < kChunks; ++q) acc[i][q] += sv * bv[q];
        }
      }
    } else {
      for (int64_t r = 0; r < R; ++r)
        for (int q = q0; q < q1; ++q) {
          const Vec bv = load_vec(b + r * kPanelCols + q * kLanes);
          for (int i = 0; i < kN; ++i) acc[i][q] += (Vec{} + s[i][r]) * bv;
        }
    }
    for (int i = 0; i < kN; ++i)
      for (int q = q0; q < q1; ++q) add_delta(out[i], base + q * kLanes, c1, acc[i][q], scaling);
  }
}

#ifdef PDSERVE_BF16_DOT
// expand_rows for bf16 panels of paired ranks: each row's shrink (bf16 values: the shrinks
// round to it) as pairs broadcast to every lane, one vdpbf16ps per pair of ranks and vector
// of columns where the fp32 form takes two FMAs and two conversions of B^T.
template <int kN>
void expand_rows_paired(const float* const* s, c10::BFloat16* const* out, const Pair& p, int64_t R, float scaling,
                        int64_t c0, int64_t c1) {
  static_assert(kLanes == 16);
  const int64_t num_pairs = (R + 1) / 2;
  thread_local std::vector<uint32_t> words;  // [kN, num_pairs]: row i's ranks 2 r and 2 r + 1 as one word
  words.resize(kN * num_pairs);
  for (int i = 0; i < kN; ++i)
    for (int64_t r = 0; r < num_pairs; ++r) {
      const uint16_t lo = c10::BFloat16(s[i][2 * r]).x;
      const uint16_t hi = 2 * r + 1 < R ? c10::BFloat16(s[i][2 * r + 1]).x : uint16_t{0};
      words[i * num_pairs + r] = static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
    }
  const c10::BFloat16* panels = p.panels.const_data_ptr<c10::BFloat16>();
  for (int64_t panel = c0 / kPanelCols; panel * kPanelCols < c1; ++panel) {
    const int64_t base = panel * kPanelCols;
    const int q0 = static_cast<int>((std::max(c0, base) - base) / kLanes);
    const int q1 = static_cast<int>((std::min(c1, base + kPanelCols) - base + kLanes - 1) / kLanes);
    const c10::BFloat16* b = panels + panel * num_pairs * kPanelCols * 2;
    __m512 acc[kN][kChunks];
    for (int i = 0; i < kN; ++i)
      for (int q = 0; q < kChunks; ++q) acc[i][q] = _mm512_setzero_ps();
    if (q0 == 0 && q1 == kChunks) {  // a whole panel: every loop bound known
      for (int64_t r = 0; r < num_pairs; ++r) {
        __m512bh bv[kChunks];
        for (int q = 0; q < kChunks; ++q) bv[q] = load_bf16x32(b + (r * kPanelCols + q * kLanes) * 2);
        for (int i = 0; i < kN; ++i) {
          const __m512bh sv = (__m512bh)_mm512_set1_epi32(static_cast<int>(words[i * num_pairs + r]));
          for (int q = 0; q < kChunks; ++q) acc[i][q] = _mm512_dpbf16_ps(acc[i][q], sv, bv[q]);
        }
      }
    } else {
      for (int64_t r = 0; r < num_pairs; ++r)
        for (int q = q0; q < q1; ++q) {
          const __m512bh bv = load_bf16x32(b + (r * kPanelCols + q * kLanes) * 2);
          for (int i = 0; i < kN; ++i)
            acc[i][q] = _mm512_dpbf16_ps(
                acc[i][q], (__m512bh)_mm512_set1_epi32(static_cast<int>(words[i * num_pairs + r])), bv);
        }
    }
    for (int i = 0; i < kN; ++i)
      for (int q = q0; q < q1; ++q) add_delta(out[i], base + q * kLanes, c1, (Vec)acc[i][q], scaling);
  }
}
#endif

// Columns [c0, c1) (c0 a multiple of kLanes) of projection j of layer l's output y [M, N],
// for rows [row_begin, row_end): y += scaling * round(shrunk B^T), rounded to T, shrunk the
// scratch the shrinks filled.
template <typename T>
void expand(const Step& step, size_t l, int j, T* y, int64_t N, int64_t c0, int64_t c1, int64_t row_begin,
            int64_t row_end, const float* shrunk) {
  if (c0 >= c1) return;
  for (const Group& g : step.groups) {
    const Pair& p = g.adapter->layers[l][j];
    if (!p.a.defined()) continue;
    const int64_t R = p.a.size(0);
    const float* s[kRows];
    T* out[kRows];
    int n = 0;
    auto rows = [&]<int kN>() {
#ifdef PDSERVE_BF16_DOT
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        expand_rows_paired<kN>(s, out, p, R, g.adapter->scaling, c0, c1);
        return;
      }
#endif
      expand_rows<T, kN>(s, out, p, R, g.adapter->scaling, c0, c1);
    };
    auto flush = [&] {
      switch (n) {
        case 4: if constexpr (kRows >= 4) rows.template operator()<4>(); break;
        case 3: if constexpr (kRows >= 3) rows.template operator()<3>(); break;
        case 2: rows.template operator()<2>(); break;
        case 1: rows.template operator()<1>(); break;
        default: break;
      }
      n = 0;
    };
    for (const int64_t m : g.rows) {
      if (m < row_begin || m >= row_end) continue;
      s[n] = shrunk + m * step.max_rank;
      out[n] = y + m * N;
      if (++n == kRows) flush();
    }
    flush();
  }
}

}  // namespace pdserve_cpu::lora

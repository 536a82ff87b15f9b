// LoRA adapters' deltas inside the native decode loop (decode_layers.cpp): each adapter a
// step's rows name adds scaling * (x A^T) B^T to those rows of a projection's output, after
// the projection's GEMV, as the compiled model's pdserve::add_lora_deltas does
// (common/engine/lora/layers.py): the shrink x A^T rounded to the model's dtype, the expand
// rounded to it, then y + scaling * delta rounded once, each accumulated in fp32.
//
// Adapters are registered once (register_decode_adapter: per layer the stacked A [k r, K] and
// B [N, k r] of qkv, o, gate_up and down, or none where the adapter does not target the
// projection) and named per step by id, one per row (-1: the base model). B is kept
// transposed in panels of kPanelCols columns, [N / kPanelCols, k r, kPanelCols], so that the
// expand runs along a thread's own output columns reading one contiguous stream: in a
// parallel region each thread shrinks its share of the rows' k r values, the threads meet,
// and each expands into the columns its GEMV wrote. A step of few rows skips the meeting:
// each thread shrinks every row itself, into its own scratch (a barrier costs more than the
// shrinks of a few rows).
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

struct Pair {
  at::Tensor a;       // [R, K] the model's dtype; undefined: the adapter leaves the projection alone
  at::Tensor panels;  // [ceil(N / kPanelCols), R, kPanelCols]: B^T in column panels, zero past N
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
    at::Tensor padded = at::zeros({num_panels * kPanelCols, R}, bi->options());
    padded.narrow(0, 0, N).copy_(*bi);
    at::Tensor panels = padded.view({num_panels, kPanelCols, R}).transpose(1, 2).contiguous();  // [P, R, cols]
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

// Columns [c0, c1) (c0 a multiple of kLanes) of the rows out[i] [N] (i < kN): += scaling *
// round(s[i] [R] . B^T's columns), rounded to T, from B^T's panels.
template <typename T, int kN>
void expand_rows(const float* const* s, T* const* out, const Pair& p, int64_t R, float scaling, int64_t c0,
                 int64_t c1) {
  const Vec scale = Vec{} + scaling;
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
      for (int q = q0; q < q1; ++q) {
        const int64_t col = base + q * kLanes;
        T* o = out[i] + col;
        if (col + kLanes <= c1) {
          store_vec(o, load_vec(o) + scale * round_as(acc[i][q], T{}));
        } else {  // the last columns of a width that is not whole vectors
          for (int64_t lane = 0; col + lane < c1; ++lane)
            o[lane] = T(to_float(o[lane]) + scaling * round_to(acc[i][q][lane], T{}));
        }
      }
  }
}

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
    auto flush = [&] {
      switch (n) {
        case 4: if constexpr (kRows >= 4) expand_rows<T, 4>(s, out, p, R, g.adapter->scaling, c0, c1); break;
        case 3: if constexpr (kRows >= 3) expand_rows<T, 3>(s, out, p, R, g.adapter->scaling, c0, c1); break;
        case 2: expand_rows<T, 2>(s, out, p, R, g.adapter->scaling, c0, c1); break;
        case 1: expand_rows<T, 1>(s, out, p, R, g.adapter->scaling, c0, c1); break;
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

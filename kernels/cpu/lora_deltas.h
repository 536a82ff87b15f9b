// LoRA adapters' deltas inside the native decode loop (decode_layers.cpp): each adapter a
// step's rows name adds scaling * (x A^T) B^T to those rows of a projection's output, after
// the projection's GEMV, as the compiled model's pdserve::add_lora_deltas does
// (common/engine/lora/layers.py): the shrink x A^T rounded to the model's dtype, the expand
// rounded to it, then y + scaling * delta rounded once, each accumulated in fp32.
//
// Adapters are registered once (register_decode_adapter: per layer the stacked A [k r, K] and
// B [N, k r] of qkv, o, gate_up and down, or none where the adapter does not target the
// projection) and named per step by id, one per row (-1: the base model). B is kept
// transposed, [k r, N], so that the expand runs along a thread's own output columns: in a
// parallel region each thread shrinks its share of the rows' k r values, the threads meet,
// and each expands into the columns its GEMV wrote.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
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

struct Pair {
  at::Tensor a;   // [R, K] the model's dtype; undefined: the adapter leaves the projection alone
  at::Tensor bt;  // [R, N], B transposed
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

// A step's adapters: its rows grouped by adapter, and scratch for each row's shrink [M, max R].
struct Step {
  std::vector<Group> groups;
  std::vector<float> shrunk;
  int64_t max_rank = 0;
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
    adapter.layers[i / kNumProjections][i % kNumProjections] = Pair{ai->contiguous(), bi->t().contiguous()};
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
inline Step make_step(const at::Tensor& lora_ids, int64_t M,
                      const std::vector<std::array<std::pair<int64_t, int64_t>, kNumProjections>>& widths,
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
    if (id >= static_cast<int64_t>(group_of.size())) group_of.resize(id + 1, 0);
    if (group_of[id] == 0) {
      std::shared_ptr<const Adapter> adapter;
      {
        std::lock_guard<std::mutex> lock(adapters_mutex);
        if (id < static_cast<int64_t>(adapters.size())) adapter = adapters[id];
      }
      PDSERVE_CHECK_VALUE(adapter != nullptr, op, ": row ", m, " names LoRA adapter ", id, ", which is not registered");
      PDSERVE_CHECK_VALUE(adapter->layers.size() == widths.size() &&
                              (adapter->dtype == dtype || adapter->dtype == at::ScalarType::Undefined),
                          op, ": LoRA adapter ", id, " has ", static_cast<int64_t>(adapter->layers.size()),
                          " layers of ", adapter->dtype, "; the model ", static_cast<int64_t>(widths.size()), " of ",
                          dtype);
      for (size_t l = 0; l < widths.size(); ++l)
        for (int j = 0; j < kNumProjections; ++j) {
          const Pair& p = adapter->layers[l][j];
          if (!p.a.defined()) continue;
          PDSERVE_CHECK_VALUE(p.a.size(1) == widths[l][j].first && p.bt.size(1) == widths[l][j].second, op,
                              ": LoRA adapter ", id, "'s layer ", static_cast<int64_t>(l), " projection ", j,
                              " is A ", p.a.sizes(), ", B^T ", p.bt.sizes(), "; the model's is ", widths[l][j].first,
                              " -> ", widths[l][j].second);
          step.max_rank = std::max(step.max_rank, p.a.size(0));
        }
      step.groups.push_back(Group{std::move(adapter), {}});
      group_of[id] = static_cast<int64_t>(step.groups.size());
    }
    step.groups[group_of[id] - 1].rows.push_back(m);
  }
  step.shrunk.resize(M * step.max_rank);
  return step;
}

template <typename T>
inline float dot_rows(const T* a, const T* b, int64_t n) {
  Vec acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load_vec(a + i) * load_vec(b + i);
  float sum = hsum(acc);
  for (; i < n; ++i) sum += to_float(a[i]) * to_float(b[i]);
  return sum;
}

inline float round_to(float v, float) { return v; }
inline float round_to(float v, c10::BFloat16) { return to_float(c10::BFloat16(v)); }

// Part `part` of `num_parts` of the step's shrinks for projection j of layer l: each named
// row's x [K] times its adapter's A^T, rounded to T, into step.shrunk[m * max_rank ...].
// The parts split the (row, rank) values evenly; every part must be done before an expand.
template <typename T>
void shrink_part(Step& step, size_t l, int j, const T* x, int64_t K, int part, int num_parts) {
  int64_t total = 0;
  for (const Group& g : step.groups) {
    const Pair& p = g.adapter->layers[l][j];
    if (p.a.defined()) total += static_cast<int64_t>(g.rows.size()) * p.a.size(0);
  }
  const int64_t begin = total * part / num_parts, end = total * (part + 1) / num_parts;
  int64_t first = 0;  // the group's first item
  for (const Group& g : step.groups) {
    const Pair& p = g.adapter->layers[l][j];
    if (!p.a.defined()) continue;
    const int64_t R = p.a.size(0), num_items = static_cast<int64_t>(g.rows.size()) * R;
    const T* a = p.a.const_data_ptr<T>();
    for (int64_t i = std::max(begin, first); i < std::min(end, first + num_items); ++i) {
      const int64_t m = g.rows[(i - first) / R], r = (i - first) % R;
      step.shrunk[m * step.max_rank + r] = round_to(dot_rows(x + m * K, a + r * K, K), T{});
    }
    first += num_items;
  }
}

// Columns [c0, c1) of projection j of layer l's output y [M, N], for rows [row_begin,
// row_end): y += scaling * round(shrunk B^T), rounded to T (the shrinks done).
template <typename T>
void expand(const Step& step, size_t l, int j, T* y, int64_t N, int64_t c0, int64_t c1, int64_t row_begin,
            int64_t row_end) {
  for (const Group& g : step.groups) {
    const Pair& p = g.adapter->layers[l][j];
    if (!p.a.defined()) continue;
    const int64_t R = p.a.size(0);
    const T* bt = p.bt.const_data_ptr<T>();
    const Vec scaling = Vec{} + g.adapter->scaling;
    for (const int64_t m : g.rows) {
      if (m < row_begin || m >= row_end) continue;
      const float* s = step.shrunk.data() + m * step.max_rank;
      T* out = y + m * N;
      int64_t c = c0;
      for (; c + kLanes <= c1; c += kLanes) {
        Vec acc = {};
        for (int64_t r = 0; r < R; ++r) acc += s[r] * load_vec(bt + r * N + c);
        store_vec(out + c, load_vec(out + c) + scaling * round_as(acc, T{}));
      }
      for (; c < c1; ++c) {
        float acc = 0.f;
        for (int64_t r = 0; r < R; ++r) acc += s[r] * to_float(bt[r * N + c]);
        out[c] = T(to_float(out[c]) + g.adapter->scaling * round_to(acc, T{}));
      }
    }
  }
}

}  // namespace pdserve_cpu::lora

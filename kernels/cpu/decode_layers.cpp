// A decode step's decoder layers in one native call, for Llama-shaped models on the CPU.
//
// At one token a compiled step spends about as long around its kernels as in them: the
// inductor wrapper's Python, an op dispatch from Python per linear and per attention, an
// OpenMP region for each small fused kernel, the size checks at every layer call. At 64
// tokens that serial work still leaves the other threads idle for a fifth of the step.
// This loop runs a decode-only step through every layer from C++: the norms, RoPE,
// residuals and SiLU row by row (on one thread below 2 * kRowsPerTask rows, over the
// threads from there: for_rows), the linears through the GEMV ops up to kMaxGemvTokens
// rows (pdserve_gemv: dense rows, bf16 column panels, Q4_1 or Q8_0 blocks) and through
// pdserve_gemv::prepacked_linear beyond (the compiled model's own op: panel_gemm or
// oneDNN), attention through the fused write-and-attend op (pdserve_cpu), each reached
// through the dispatcher from here. GGUF-block projections (Q4_1, Q8_0) take their GEMV
// at any row count (gemv.cpp's row groups: one read of the weight per step, 2-3x torch's
// int4 / int8 kernels). A model whose every projection is a prepacked linear or GGUF
// blocks takes steps of any size; the others up to kMaxGemvTokens. Where every projection
// is GGUF blocks or column panels (bf16 or fp32), the whole step runs in one OpenMP region
// (run_layers_in_regions) rather than a fork and join per projection and attention; a step
// of such a model can take the embedding lookup, the head and each row's next token (its
// argmax, or a draw from its softmax, after any penalties or held-back stop tokens, and its
// logprobs) into the same region too (decode_tokens).
//
// Numerics follow the compiled graph's: each fused pointwise step computes in fp32 from
// the dtype's inputs and rounds once; RMSNorm rounds the normalised value before scaling
// (as the model does); the sum of a residual rounds once.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <omp.h>

#include "amx_tiles.h"
#include "argmax.h"
#include "attention_team.h"
#include "check_message.h"
#include "gguf_row_groups.h"
#include "lora_deltas.h"
#include "panel_gemm.h"
#include "panel_gemm_fp32.h"
#include "panel_layout.h"
#include "region_barrier.h"
#include "sample_row.h"
#include "step_sampling.h"
#include "vec_math.h"

namespace {

constexpr int64_t kMaxGemvTokens = 4;  // the dense GEMVs' limit on rows of x (GGUF blocks: none)
// Rows of pointwise work (a norm, RoPE, SiLU over one token) per thread's task: below two
// tasks' worth the rows stay on the calling thread, where an OpenMP region would cost more.
constexpr int64_t kRowsPerTask = 8;

// How a linear's decode GEMV reads its weight.
enum LinearKind : int64_t { kDense = 0, kQ4_1 = 1, kQ8_0 = 2, kPanels = 3 };

struct Linear {
  LinearKind kind;
  // dense [N, K] bf16/fp32, GGUF blocks in row groups [N, K / 32 * bytes] uint8, or column
  // panels (pdserve_gemv::pack_panels): bf16 [N / 32, K / 2, 32, 2] or fp32 [N / 16, K, 16]
  at::Tensor weight;
  int64_t out_features;  // N
  std::optional<at::Tensor> bias;  // [N], the model's dtype
  // [] int64: the id pdserve_gemv::prepacked_linear knows the linear by, for steps past
  // kMaxGemvTokens rows; none: a dense linear serves GEMV steps only.
  std::optional<at::Tensor> weight_id;
  int64_t in_features = 0;  // K, for GGUF blocks and panels (the parallel regions' GEMVs)
  std::vector<uint8_t> padded_last;  // GGUF blocks: the last group as 16 rows where N % 16 != 0
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;  // [hidden_size], the model's dtype
  Linear qkv, o, gate_up, down;
  int64_t sliding_window;  // 0: none
};

// The embedding and the output projection, for steps that end in each row's next token
// (decode_tokens): the token ids in, the next tokens out.
struct TokenHead {
  at::Tensor embedding;  // [num_embeddings, hidden_size], the model's dtype
  Linear linear;         // the output projection: GGUF blocks or column panels
  int64_t vocab_size;    // the columns sampling reads (the projection may pad past them)
};

struct Model {
  std::vector<Layer> layers;
  std::optional<at::Tensor> final_norm;  // [hidden_size]; None: return the residual stream
  at::Tensor cos, sin;                   // [max_position, rotary_dim / 2] fp32
  int64_t num_heads, num_kv_heads, head_dim;
  double rms_norm_eps, attention_scale;
  int64_t max_tokens;  // kMaxGemvTokens, or no limit where every linear has a weight_id or GGUF blocks
  // Steps of up to this many tokens run in one parallel region (run_layers_in_regions): any
  // number where every linear is GGUF blocks, as many as the prepacked op takes panels for
  // where some are panels (past it they take its oneDNN call), 0 for other models
  // (region_tokens_limit).
  int64_t max_region_tokens = 0;
  // Some layer's linear is fp32 panels: the region gives each thread whole tiles of x (row_share).
  bool layers_have_f32_panels = false;
  std::optional<TokenHead> token_head;  // none: registered without one
  // Steps decode_tokens serves (head_tokens_limit): where the model has a token head its
  // region can run, as far as the head's own op takes the region's GEMV, else 0.
  int64_t max_head_tokens = 0;
  pdserve_cpu::lora::Widths projection_widths;  // what a LoRA adapter's matrices must fit (lora_step)
};

std::mutex models_mutex;
std::vector<std::shared_ptr<const Model>> models;  // by id; released: null

bool takes_any_rows(LinearKind kind) { return kind == kQ4_1 || kind == kQ8_0; }

// An fp32 model's column panels [N / 16, K, 16] (panel_gemm_fp32.h), not bf16 ones.
bool has_f32_panels(const Linear& l) { return l.kind == kPanels && l.weight.scalar_type() == at::kFloat; }

at::Tensor linear(const Linear& l, const at::Tensor& x) {
  if (x.size(0) > kMaxGemvTokens && !takes_any_rows(l.kind)) {
    using Prepacked = at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, int64_t);
    static const auto prepacked = c10::Dispatcher::singleton()
                                      .findSchemaOrThrow("pdserve_gemv::prepacked_linear", "")
                                      .typed<Prepacked>();
    return prepacked.call(x, l.bias, *l.weight_id, l.out_features);
  }
  using Gemv = at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&);
  static const auto dense = c10::Dispatcher::singleton().findSchemaOrThrow("pdserve_gemv::gemv", "").typed<Gemv>();
  static const auto q4_1 =
      c10::Dispatcher::singleton().findSchemaOrThrow("pdserve_gemv::q4_1_gemv", "").typed<Gemv>();
  static const auto q8_0 =
      c10::Dispatcher::singleton().findSchemaOrThrow("pdserve_gemv::q8_0_gemv", "").typed<Gemv>();
  static const auto panels =
      c10::Dispatcher::singleton().findSchemaOrThrow("pdserve_gemv::panel_gemm", "").typed<Gemv>();
  switch (l.kind) {
    case kQ4_1: return q4_1.call(x, l.bias, l.weight);
    case kQ8_0: return q8_0.call(x, l.bias, l.weight);
    case kPanels: return panels.call(x, l.bias, l.weight);
    default: return dense.call(x, l.bias, l.weight);
  }
}

// One layer's attention: the step's new K/V written at slot_mapping, then q attended over
// the block tables (pdserve_cpu's fused kernel, through the dispatcher).
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                  const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                  int64_t sliding_window) {
  using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, double, int64_t, double);
  static const auto attention = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("pdserve_cpu::paged_attention_with_kv_write", "")
                                    .typed<Attention>();
  return attention.call(q, k, v, k_cache, v_cache, slot_mapping, block_tables, query_start_loc, seq_lens, scale,
                        sliding_window, 0.0);
}

// The attention library's team API (attention_team.h), looked up once.
const pdserve_cpu::TeamAttentionApi& team_attention_api() {
  static const pdserve_cpu::TeamAttentionApi* api = [] {
    const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("pdserve_cpu::team_attention_api", "").typed<int64_t()>();
    return reinterpret_cast<const pdserve_cpu::TeamAttentionApi*>(op.call());
  }();
  return *api;
}

using pdserve_cpu::kLanes;
using pdserve_cpu::load_vec;
using pdserve_cpu::to_float;
using pdserve_cpu::sampling::check_history;
using pdserve_cpu::sampling::check_logprobs;
using pdserve_cpu::sampling::check_sampling;
using pdserve_cpu::sampling::draw_token;
using pdserve_cpu::sampling::DrawScratch;
using pdserve_cpu::sampling::draws;
using pdserve_cpu::sampling::has_history;
using pdserve_cpu::sampling::reports_logprobs;
using pdserve_cpu::sampling::StepSampling;
using pdserve_cpu::sampling::take_with_history;
using pdserve_cpu::sampling::widen_row;
using pdserve_cpu::sampling::write_logprobs;
using pdserve_cpu::Vec;
using pdserve_cpu::VecU32;

namespace lora = pdserve_cpu::lora;
using pdserve_cpu::round_as;
using pdserve_cpu::store_vec;

// out [M, H] = round(x / rms(x)) * weight, per row (x, out [M, H] contiguous).
template <typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t M, int64_t H, double eps) {
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * H;
    T* out_row = out + m * H;
    int64_t i = 0;
    Vec sums{};
    for (; i + kLanes <= H; i += kLanes) {
      const Vec v = load_vec(row + i);
      sums += v * v;
    }
    float sum_sq = pdserve_cpu::hsum(sums);
    for (int64_t j = i; j < H; ++j) sum_sq += to_float(row[j]) * to_float(row[j]);
    const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(H) + static_cast<float>(eps));
    for (i = 0; i + kLanes <= H; i += kLanes)
      store_vec(out_row + i, load_vec(weight + i) * round_as(load_vec(row + i) * inv_rms, T{}));
    for (; i < H; ++i) out_row[i] = T(to_float(weight[i]) * to_float(T(to_float(row[i]) * inv_rms)));
  }
}

// Rotate-half RoPE in place over the first 2 * half dims of each head of a token's q and k
// (num_rotated heads, adjacent in qkv's row), with cos/sin rounded to the dtype as the model
// rounds its tables.
template <typename T>
void rope(T* qkv_row, int64_t num_rotated, int64_t head_dim, const float* cos, const float* sin, int64_t half) {
  for (int64_t h = 0; h < num_rotated; ++h) {
    T* head = qkv_row + h * head_dim;
    int64_t i = 0;
    for (; i + kLanes <= half; i += kLanes) {
      const Vec c = round_as(load_vec(cos + i), T{}), s = round_as(load_vec(sin + i), T{});
      const Vec x1 = load_vec(head + i), x2 = load_vec(head + i + half);
      store_vec(head + i, x1 * c - x2 * s);
      store_vec(head + i + half, x2 * c + x1 * s);
    }
    for (; i < half; ++i) {
      const float c = to_float(T(cos[i])), s = to_float(T(sin[i]));
      const float x1 = to_float(head[i]), x2 = to_float(head[i + half]);
      head[i] = T(x1 * c - x2 * s);
      head[i + half] = T(x2 * c + x1 * s);
    }
  }
}

// x [n] += y [n], in place.
template <typename T>
void add_into(T* x, const T* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store_vec(x + i, load_vec(x + i) + load_vec(y + i));
  for (; i < n; ++i) x[i] = T(to_float(x[i]) + to_float(y[i]));
}

// out [M, I] = silu(gate) * up from gate_up [M, 2I]; sigmoid from exp(-|g|) <= 1, which
// the vector exp takes (its range is x <= 0).
template <typename T>
void silu_and_mul(const T* gate_up, T* out, int64_t M, int64_t I) {
  for (int64_t m = 0; m < M; ++m) {
    const T* gate = gate_up + m * 2 * I;
    const T* up = gate + I;
    int64_t i = 0;
    for (; i + kLanes <= I; i += kLanes) {
      const Vec g = load_vec(gate + i);
      const Vec e = pdserve_cpu::exp_nonpositive(g < 0 ? g : -g);  // exp(-|g|)
      const Vec sigmoid = (g < 0 ? e : Vec{} + 1.0f) / (e + 1.0f);
      store_vec(out + m * I + i, g * sigmoid * load_vec(up + i));
    }
    for (; i < I; ++i) {
      const float g = to_float(gate[i]);
      out[m * I + i] = T(g / (1.0f + std::exp(-g)) * to_float(up[i]));
    }
  }
}

// f(begin, end) over rows [0, M): on this thread for a few rows, over the threads beyond.
template <typename F>
void for_rows(int64_t M, const F& f) {
  if (M < 2 * kRowsPerTask) {
    f(0, M);
    return;
  }
  at::parallel_for(0, M, kRowsPerTask, f);
}

// y [M, N] += each named row's LoRA delta of projection j of layer l from x [M, K]
// (lora_deltas.h): on this thread for a few rows, else the shrinks and then the expands'
// columns over the threads.
template <typename T>
void add_lora_deltas(lora::Step& step, size_t l, int j, const T* x, int64_t K, T* y, int64_t N, int64_t M) {
  float* shrunk = step.scratch(0);
  if (M < 2 * kRowsPerTask) {
    lora::shrink_part(step, l, j, x, K, 0, 1, shrunk);
    lora::expand(step, l, j, y, N, 0, N, 0, M, shrunk);
    return;
  }
  const int n = at::get_num_threads();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t part = b; part < e; ++part) lora::shrink_part(step, l, j, x, K, static_cast<int>(part), n, shrunk);
  });
  const int64_t num_panels = (N + lora::kPanelCols - 1) / lora::kPanelCols;
  at::parallel_for(0, num_panels, 1, [&](int64_t b, int64_t e) {
    lora::expand(step, l, j, y, N, b * lora::kPanelCols, std::min(e * lora::kPanelCols, N), 0, M, shrunk);
  });
}

// lora_rows: the step's LoRA adapters and their rows (none: no row names one).
template <typename T>
at::Tensor run_layers(const Model& model, const at::Tensor& hidden, const at::Tensor& positions,
                      at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
                      const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                      lora::Step* lora_rows = nullptr) {
  const int64_t M = hidden.size(0), H = hidden.size(1);
  const int64_t num_heads = model.num_heads, num_kv_heads = model.num_kv_heads, head_dim = model.head_dim;
  const int64_t half = model.cos.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  at::Tensor x = hidden.clone();      // [M, H] the residual stream
  at::Tensor normed = at::empty({M, H}, x.options());  // [M, H]
  at::Tensor act;  // [M, I], the MLP's activations: allocated at the first layer, reused by the others
  T* xp = x.data_ptr<T>();
  T* np = normed.data_ptr<T>();
  const double eps = model.rms_norm_eps;
  for (size_t l = 0; l < model.layers.size(); ++l) {
    const Layer& layer = model.layers[l];
    for_rows(M, [&](int64_t b, int64_t e) {
      rms_norm<T>(xp + b * H, layer.input_norm.data_ptr<T>(), np + b * H, e - b, H, eps);
    });
    at::Tensor qkv = linear(layer.qkv, normed);  // [M, (num_heads + 2 num_kv_heads) head_dim]
    T* qkv_p = qkv.data_ptr<T>();
    const int64_t qkv_width = qkv.size(1);
    if (lora_rows != nullptr) add_lora_deltas<T>(*lora_rows, l, 0, np, H, qkv_p, qkv_width, M);
    for_rows(M, [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m)
        rope<T>(qkv_p + m * qkv_width, num_heads + num_kv_heads, head_dim,
                model.cos.data_ptr<float>() + pos[m] * half, model.sin.data_ptr<float>() + pos[m] * half, half);
    });
    at::Tensor heads = qkv.view({M, num_heads + 2 * num_kv_heads, head_dim});
    at::Tensor q = heads.narrow(1, 0, num_heads);                   // [M, num_heads, head_dim]
    at::Tensor k = heads.narrow(1, num_heads, num_kv_heads);        // [M, num_kv_heads, head_dim]
    at::Tensor v = heads.narrow(1, num_heads + num_kv_heads, num_kv_heads);
    at::Tensor attended = attend(q, k, v, k_caches[l], v_caches[l], slot_mapping, block_tables, query_start_loc,
                                 seq_lens, model.attention_scale, layer.sliding_window);  // [M, num_heads, head_dim]
    at::Tensor o = linear(layer.o, attended.view({M, num_heads * head_dim}));  // [M, H]
    if (lora_rows != nullptr)
      add_lora_deltas<T>(*lora_rows, l, 1, attended.const_data_ptr<T>(), num_heads * head_dim, o.data_ptr<T>(), H, M);
    const T* op = o.data_ptr<T>();
    for_rows(M, [&](int64_t b, int64_t e) {
      add_into<T>(xp + b * H, op + b * H, (e - b) * H);
      rms_norm<T>(xp + b * H, layer.post_attention_norm.data_ptr<T>(), np + b * H, e - b, H, eps);
    });
    at::Tensor gate_up = linear(layer.gate_up, normed);  // [M, 2 I]
    const int64_t I = gate_up.size(1) / 2;
    if (lora_rows != nullptr) add_lora_deltas<T>(*lora_rows, l, 2, np, H, gate_up.data_ptr<T>(), 2 * I, M);
    if (!act.defined() || act.size(1) != I) act = at::empty({M, I}, x.options());
    const T* gate_up_p = gate_up.data_ptr<T>();
    T* act_p = act.data_ptr<T>();
    for_rows(M, [&](int64_t b, int64_t e) { silu_and_mul<T>(gate_up_p + b * 2 * I, act_p + b * I, e - b, I); });
    at::Tensor down = linear(layer.down, act);  // [M, H]
    if (lora_rows != nullptr)
      add_lora_deltas<T>(*lora_rows, l, 3, act.const_data_ptr<T>(), I, down.data_ptr<T>(), H, M);
    const T* dp = down.data_ptr<T>();
    for_rows(M, [&](int64_t b, int64_t e) { add_into<T>(xp + b * H, dp + b * H, (e - b) * H); });
  }
  if (!model.final_norm.has_value()) return x;
  for_rows(M, [&](int64_t b, int64_t e) {
    rms_norm<T>(xp + b * H, model.final_norm->data_ptr<T>(), np + b * H, e - b, H, eps);
  });
  return normed;
}

#ifdef PDSERVE_ROW_GROUPS
// Inside a parallel region: thread t's share [begin, end) of n items, in num_threads runs.
inline std::pair<int64_t, int64_t> share_of(int64_t n, int t, int num_threads) {
  return {n * t / num_threads, n * (t + 1) / num_threads};
}

// Output columns a linear's GEMV takes as one unit: a GGUF row group or a column panel.
inline int64_t unit_columns(const Linear& l) {
  return has_f32_panels(l) ? pdserve_cpu::kF32PanelCols
         : l.kind == kPanels ? pdserve_cpu::kPanelCols
                             : pdserve_cpu::kGroupRows;
}

// Thread t's units [begin, end) of a linear, as the linear's GEMV op splits them: GGUF
// blocks a run of at least 4 groups (64 rows) a thread, column panels a run of panels
// (each column's sums are the same on any split). In thread order.
inline std::pair<int64_t, int64_t> units_of(const Linear& l, int t, int num_threads) {
  const int64_t num_units = (l.out_features + unit_columns(l) - 1) / unit_columns(l);
  if (l.kind == kPanels) return share_of(num_units, t, num_threads);
  const int workers = static_cast<int>(std::clamp<int64_t>(num_units / 4, 1, num_threads));
  if (t >= workers) return {num_units, num_units};
  return share_of(num_units, t, workers);
}

// Thread t's output columns [begin, end) of a linear: its units_of.
inline std::pair<int64_t, int64_t> columns_of(const Linear& l, int t, int num_threads) {
  const auto [begin, end] = units_of(l, t, num_threads);
  return {std::min(begin * unit_columns(l), l.out_features), std::min(end * unit_columns(l), l.out_features)};
}

// What a thread's part of a linear reads x as, made ready by prepare_rows: GGUF blocks x's
// rows quantized per 32 columns, fp32 panels x's rows packed in their tiles
// (pack_f32_x_tiles), bf16 panels x itself.
struct PreparedX {
  pdserve_cpu::BlockQuantizedX blocks;
  std::vector<float> f32_tiles;  // [M, K] in f32_row_tiles(M)'s tiles, where fp32 panels read x
  PreparedX(int64_t M, int64_t K, bool f32_panels)
      : blocks(M * K / pdserve_cpu::kBlockCols), f32_tiles(f32_panels ? M * K : 0) {}
};

// Thread t's part of y [M, N] = x @ W^T (+ bias), its units_of: GGUF blocks from x's M
// rows quantized, fp32 column panels from x's tiles, bf16 ones from x itself.
template <typename T>
void gemv_share(const Linear& l, const T* x, const PreparedX& prepared, int64_t M, T* y, int t, int num_threads) {
  const T* bias = l.bias.has_value() ? l.bias->data_ptr<T>() : nullptr;
  const auto [begin, end] = units_of(l, t, num_threads);
  if (begin >= end) return;
  if (has_f32_panels(l)) {
#ifdef PDSERVE_F32_PANEL_GEMM
    if constexpr (std::is_same_v<T, float>) {
      const pdserve_cpu::F32PanelGemm gemm{prepared.f32_tiles.data(), l.weight.data_ptr<float>(), bias, y, M,
                                           l.in_features, l.out_features};
      pdserve_cpu::f32_panel_gemm_panels(gemm, begin, end);
    }
#endif
    return;
  }
  const pdserve_cpu::BlockQuantizedX& xq = prepared.blocks;
  if (l.kind == kPanels) {
#ifdef PDSERVE_PANEL_GEMM
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      pdserve_cpu::panel_gemm_panels(x, l.weight.data_ptr<c10::BFloat16>(), bias, y, M, l.in_features,
                                     l.out_features, begin, end);
    }
#endif
    return;
  }
  using pdserve_cpu::BlockFormat;
  const uint8_t* w = l.weight.data_ptr<uint8_t>();
  const int64_t num_blocks = l.in_features / pdserve_cpu::kBlockCols;
  if (l.kind == kQ4_1)
    pdserve_cpu::row_groups_gemv<BlockFormat::kQ4_1>(xq, M, w, l.out_features, num_blocks, l.padded_last.data(), bias,
                                                     y, begin, end);
  else
    pdserve_cpu::row_groups_gemv<BlockFormat::kQ8_0>(xq, M, w, l.out_features, num_blocks, l.padded_last.data(), bias,
                                                     y, begin, end);
}

// A thread's rows of a step: rows [row_begin, row_end), which are f32_row_tiles' tiles
// [tile_begin, tile_end) where the model has fp32 panels (so that a thread packs the tiles of
// its own rows, which no other thread writes), else share_of's.
struct RowShare {
  int64_t row_begin, row_end, tile_begin, tile_end;
};

inline RowShare row_share(int64_t M, bool whole_tiles, int t, int num_threads) {
  if (!whole_tiles) {
    const auto [begin, end] = share_of(M, t, num_threads);
    return {begin, end, 0, 0};
  }
#ifdef PDSERVE_F32_PANEL_GEMM
  const pdserve_cpu::RowTiles tiles = pdserve_cpu::f32_row_tiles(M);
  const auto [tile_begin, tile_end] = share_of(tiles.count, t, num_threads);
  auto first_row = [&](int64_t tile) { return tile < tiles.count ? tiles.first(tile) : M; };
  return {first_row(tile_begin), first_row(tile_end), tile_begin, tile_end};
#else
  const auto [begin, end] = share_of(M, t, num_threads);
  return {begin, end, 0, 0};
#endif
}

// A thread's rows of x [M, K] made ready for the linear: quantized per 32 columns for GGUF
// blocks (as the GEMV op quantizes its x), packed in tiles for fp32 panels (as the op
// packs them); bf16 panels read x as it is.
template <typename T>
void prepare_rows(const Linear& l, const T* x, int64_t M, const RowShare& share, PreparedX& prepared) {
  if (has_f32_panels(l)) {
#ifdef PDSERVE_F32_PANEL_GEMM
    if constexpr (std::is_same_v<T, float>)
      pdserve_cpu::pack_f32_x_tiles(x, prepared.f32_tiles.data(), M, l.in_features, share.tile_begin, share.tile_end);
#endif
    return;
  }
  if (l.kind == kPanels) return;
  const int64_t num_blocks = l.in_features / pdserve_cpu::kBlockCols;
  pdserve_cpu::quantize_x_blocks(x, share.row_begin * num_blocks, share.row_end * num_blocks, prepared.blocks);
}

// run_layers for a model whose every linear is GGUF blocks or column panels
// (region_tokens_limit): the same steps and the same bits, but the whole step runs in one
// OpenMP region whose threads meet at barriers (region_barrier.h), where run_layers forks and joins the
// threads for each projection and each attention. At one token a layer's projections take
// ~10-15 us each, and a fork and join with the ramp of each thread's weight stream cost
// ~1-2 us of that: 120 Q4_1 GEMVs of SmolLM2's shapes back to back, 2 threads on the Zen 5
// EPYC, 1.29 -> 1.07 ms in one region. The attention's work is planned once a step (every
// layer's items are the same) and each layer's is shared out by the attention library's
// team calls (attention_team.h): its own region cost ~5 us a layer at short contexts, most
// of the attention there.
//
// head (a model with a final norm): the region goes on through the output projection, each
// thread's columns of the logits [M, vocab] then its part of each greedy row's argmax, and
// writes each row's next token to token_ids [M]: the argmax of the head's logits, as the
// sampler's argmax_rows gives it from the same logits, or for a row sampling draws (its
// temperature > 0) the token the sampler's native passes draw from them at the row's uniform:
// the logits as fp32 over the temperature, then its top_k, top_p and min_p, then the draw
// (step_sampling.h), on the thread that owns the row (a row with a history: take_with_history),
// which then writes the row's logprobs where it reports them (write_logprobs).
template <typename T>
at::Tensor run_layers_in_regions(const Model& model, const at::Tensor& hidden, const at::Tensor& positions,
                                 at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
                                 const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                 const at::Tensor& seq_lens, const TokenHead* head = nullptr,
                                 int64_t* token_ids = nullptr, const StepSampling& sampling = {},
                                 lora::Step* lora_rows = nullptr) {
  const int64_t M = hidden.size(0), H = hidden.size(1);
  const int64_t num_heads = model.num_heads, num_kv_heads = model.num_kv_heads, head_dim = model.head_dim;
  const int64_t half = model.cos.size(1), attended_width = num_heads * head_dim;
  const Layer& first = model.layers[0];
  const int64_t qkv_width = first.qkv.out_features, I = first.down.in_features;
  const int64_t* pos = positions.data_ptr<int64_t>();
  at::Tensor x = hidden.clone();                          // [M, H] the residual stream
  at::Tensor normed = at::empty({M, H}, x.options());     // [M, H]
  at::Tensor qkv = at::empty({M, qkv_width}, x.options());  // [M, (num_heads + 2 num_kv_heads) head_dim]
  at::Tensor o = at::empty({M, H}, x.options());          // [M, H]
  at::Tensor gate_up = at::empty({M, 2 * I}, x.options());  // [M, 2 I]
  at::Tensor act = at::empty({M, I}, x.options());        // [M, I]
  at::Tensor down = at::empty({M, H}, x.options());       // [M, H]
  T *xp = x.data_ptr<T>(), *np = normed.data_ptr<T>(), *qkv_p = qkv.data_ptr<T>(), *op = o.data_ptr<T>();
  T *gate_up_p = gate_up.data_ptr<T>(), *act_p = act.data_ptr<T>(), *dp = down.data_ptr<T>();
  // Where any linear is fp32 panels, each thread's rows are whole tiles of x (row_share).
  const bool whole_tiles = model.layers_have_f32_panels || (head != nullptr && has_f32_panels(head->linear));
  // x made ready for the projections that read the hidden width, the attention's output and
  // the MLP's activations (prepare_rows)
  PreparedX x_hidden(M, H, whole_tiles), x_attended(M, attended_width, whole_tiles), x_act(M, I, whole_tiles);
  at::Tensor heads = qkv.view({M, num_heads + 2 * num_kv_heads, head_dim});
  const at::Tensor q = heads.narrow(1, 0, num_heads);                   // [M, num_heads, head_dim]
  const at::Tensor k = heads.narrow(1, num_heads, num_kv_heads);        // [M, num_kv_heads, head_dim]
  const at::Tensor v = heads.narrow(1, num_heads + num_kv_heads, num_kv_heads);
  const double eps = model.rms_norm_eps;
  const int num_threads = at::get_num_threads();
  // The head's logits [M, N] and each thread's part of each row's argmax [num_threads, M].
  const at::Tensor logits = head != nullptr && sampling.logits == nullptr
                                ? at::empty({M, head->linear.out_features}, x.options())
                                : at::Tensor();
  T* logits_p = head == nullptr ? nullptr
                : sampling.logits != nullptr ? static_cast<T*>(sampling.logits)
                                             : logits.data_ptr<T>();
  std::vector<pdserve_cpu::ArgmaxPart> argmax_parts(head != nullptr ? num_threads * M : 0);

  // Every layer's caches shaped as the first's, which the team's plan was checked against:
  // its layer calls run inside the region and must not fail.
  for (size_t l = 0; l < model.layers.size(); ++l)
    PDSERVE_CHECK_VALUE(k_caches[l].sizes() == k_caches[0].sizes() && v_caches[l].sizes() == k_caches[0].sizes() &&
                            k_caches[l].scalar_type() == k_caches[0].scalar_type() &&
                            v_caches[l].scalar_type() == k_caches[0].scalar_type() && k_caches[l].is_contiguous() &&
                            v_caches[l].is_contiguous(),
                        "decode_layers: every layer's K and V caches must be contiguous and shaped as the first's");
  pdserve_cpu::RegionBarrier barrier;  // the phases' barriers (the attention's own are libgomp's)
  const pdserve_cpu::TeamAttentionApi& team_api = team_attention_api();
  const std::unique_ptr<pdserve_cpu::TeamAttention, void (*)(pdserve_cpu::TeamAttention*)> team(
      team_api.begin(q, k, v, k_caches[0], v_caches[0], slot_mapping, block_tables, query_start_loc, seq_lens,
                     model.attention_scale, first.sliding_window, num_threads),
      team_api.end);
  const at::Tensor attended = team_api.out(team.get());  // [M, num_heads, head_dim], each layer's in turn
  PDSERVE_CHECK_VALUE(attended.is_contiguous(), "decode_layers: the attention's output is not contiguous");
  const T* attended_p = attended.data_ptr<T>();

  // Each phase below is one thread's part; the barriers keep the phases in order.
  // Thread t's part of projection j of layer l, once x [M, K] is whole: its GEMV columns,
  // and where rows name adapters their shrinks (its share, or for few rows all of them in its
  // own scratch), a barrier where shared, and their deltas in its own columns.
  auto project = [&](const Linear& lin, size_t l, int j, const T* x, const PreparedX& prepared, int64_t K, T* y, int t,
                     int n) {
    if (lora_rows != nullptr)
      lora::shrink_part(*lora_rows, l, j, x, K, lora_rows->redundant ? 0 : t, lora_rows->redundant ? 1 : n,
                        lora_rows->scratch(t));
    gemv_share(lin, x, prepared, M, y, t, n);
    if (lora_rows == nullptr) return;
    if (!lora_rows->redundant) barrier.wait();
    const auto [c0, c1] = columns_of(lin, t, n);
    lora::expand(*lora_rows, l, j, y, lin.out_features, c0, c1, 0, M, lora_rows->scratch(t));
  };
  // The input norm of layer l and its qkv projection and RoPE, up to its attention: the
  // thread's rows' K/V written to the layer's caches.
  auto up_to_attention = [&](size_t l, int t, int n, const RowShare& share) {
    const Layer& layer = model.layers[l];
    const int64_t row_begin = share.row_begin, row_end = share.row_end;
    rms_norm<T>(xp + row_begin * H, layer.input_norm.data_ptr<T>(), np + row_begin * H, row_end - row_begin, H, eps);
    prepare_rows(layer.qkv, np, M, share, x_hidden);
    barrier.wait();
    project(layer.qkv, l, 0, np, x_hidden, H, qkv_p, t, n);
    barrier.wait();
    for (int64_t m = row_begin; m < row_end; ++m)
      rope<T>(qkv_p + m * qkv_width, num_heads + num_kv_heads, head_dim, model.cos.data_ptr<float>() + pos[m] * half,
              model.sin.data_ptr<float>() + pos[m] * half, half);
    team_api.write(team.get(), k_caches[l], v_caches[l], t, row_begin, row_end);
  };
  // Layer l from its attention's output to its last residual, then the next layer up to
  // its attention (or the final norm).
  auto after_attention = [&](size_t l, int t, int n, const RowShare& share) {
    const Layer& layer = model.layers[l];
    const int64_t row_begin = share.row_begin, row_end = share.row_end;
    prepare_rows(layer.o, attended_p, M, share, x_attended);
    barrier.wait();
    project(layer.o, l, 1, attended_p, x_attended, attended_width, op, t, n);
    barrier.wait();
    add_into<T>(xp + row_begin * H, op + row_begin * H, (row_end - row_begin) * H);
    rms_norm<T>(xp + row_begin * H, layer.post_attention_norm.data_ptr<T>(), np + row_begin * H, row_end - row_begin,
                H, eps);
    prepare_rows(layer.gate_up, np, M, share, x_hidden);
    barrier.wait();
    project(layer.gate_up, l, 2, np, x_hidden, H, gate_up_p, t, n);
    barrier.wait();
    silu_and_mul<T>(gate_up_p + row_begin * 2 * I, act_p + row_begin * I, row_end - row_begin, I);
    prepare_rows(layer.down, act_p, M, share, x_act);
    barrier.wait();
    project(layer.down, l, 3, act_p, x_act, I, dp, t, n);
    barrier.wait();
    // A thread's rows stay its own from here to the next layer's qkv projection.
    add_into<T>(xp + row_begin * H, dp + row_begin * H, (row_end - row_begin) * H);
    if (l + 1 < model.layers.size())
      up_to_attention(l + 1, t, n, share);
    else if (model.final_norm.has_value())
      rms_norm<T>(xp + row_begin * H, model.final_norm->data_ptr<T>(), np + row_begin * H, row_end - row_begin, H,
                  eps);
  };

#pragma omp parallel num_threads(num_threads)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    DrawScratch draw_scratch;  // allocated at a thread's first draw
    // The thread's rows of pointwise work (row_share; the head's sampling splits the rows
    // evenly), at any row count: inside the region a share costs no fork (for_rows keeps few
    // rows on one thread to save one). A step of the bundled model, 8 rows, bf16 panels 6.64 ->
    // 6.31 ms; Q4_1 at 2 / 8 / 12 rows 2.24 -> 2.17, 7.11 -> 6.96, 10.22 -> 9.89 ms, 1 row
    // level (Zen 5, alternating).
    const RowShare share = row_share(M, whole_tiles, t, n);
    if (t == 0) barrier.set_num_threads(n, omp_get_num_procs());
#pragma omp barrier
    up_to_attention(0, t, n, share);
    for (size_t l = 0; l < model.layers.size(); ++l) {
      barrier.wait();
      // every row's q and k rotated and its K/V written: the layer's attention (ends at a barrier)
      team_api.attend(team.get(), t);
      after_attention(l, t, n, share);
    }
    if (head != nullptr) {
      const Linear& projection = head->linear;
      prepare_rows(projection, np, M, share, x_hidden);
      barrier.wait();
      gemv_share(projection, np, x_hidden, M, logits_p, t, n);
      // Each thread's part of the argmax over its own columns, while they are in its caches.
      const auto [begin, end] = columns_of(projection, t, n);
      const int64_t stop = std::min(end, head->vocab_size);
      for (int64_t m = 0; m < M; ++m) {
        if (draws(sampling, m) || has_history(sampling, m)) continue;
        pdserve_cpu::ArgmaxPart part = pdserve_cpu::argmax_part(logits_p + m * projection.out_features + begin,
                                                                stop - begin);
        if (part.index >= 0) part.index += begin;
        argmax_parts[t * M + m] = part;
      }
      barrier.wait();
      // Every row's logits are whole: the rows' tokens split evenly, whatever row_share gave
      // (whole tiles would leave a few rows' draws on one thread).
      const auto [sample_begin, sample_end] = share_of(M, t, n);
      for (int64_t m = sample_begin; m < sample_end; ++m) {
        const T* row_logits = logits_p + m * projection.out_features;
        if (has_history(sampling, m)) {
          token_ids[m] = take_with_history(row_logits, head->vocab_size, sampling, m, draw_scratch);
          continue;
        }
        if (draws(sampling, m)) {
          token_ids[m] = draw_token(row_logits, head->vocab_size, sampling, m, draw_scratch);
        } else {
          pdserve_cpu::ArgmaxPart row = argmax_parts[m];
          for (int other = 1; other < n; ++other) pdserve_cpu::merge_argmax(row, argmax_parts[other * M + m]);
          token_ids[m] = row.index;
        }
        if (reports_logprobs(sampling, m))
          write_logprobs(widen_row(row_logits, head->vocab_size, draw_scratch.row), head->vocab_size, token_ids[m],
                         sampling, m, draw_scratch);
      }
    }
  }
  return model.final_norm.has_value() ? normed : x;
}
#endif

Linear make_linear(int64_t kind, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                   int64_t weight_id, at::ScalarType dtype) {
  PDSERVE_CHECK_VALUE(kind == kDense || kind == kQ4_1 || kind == kQ8_0 || kind == kPanels,
                      "register_decode_model: linear kind ", kind,
                      " is not 0 (dense), 1 (Q4_1), 2 (Q8_0) or 3 (panels)");
  const bool f32_panels = kind == kPanels && pdserve_cpu::is_f32_panel_copy(weight);
  if (kind == kPanels) {
    PDSERVE_CHECK_VALUE(f32_panels ? dtype == at::kFloat : dtype == at::kBFloat16 && pdserve_cpu::is_panel_copy(weight),
                        "register_decode_model: panels must be a bf16 model's contiguous bf16 [N / 32, K / 2, 32, 2] "
                        "or an fp32 model's contiguous fp32 [N / 16, K, 16] (pack_panels), got ", weight.scalar_type(),
                        " ", weight.sizes(), " in a ", dtype, " model");
  } else {
    PDSERVE_CHECK_VALUE(weight.dim() == 2 && weight.is_contiguous(), "register_decode_model: weights must be 2-D and "
                        "contiguous, got ", weight.sizes());
    PDSERVE_CHECK_VALUE(kind == kDense ? weight.scalar_type() == dtype : weight.scalar_type() == at::kByte,
                        "register_decode_model: a linear of kind ", kind, " has a ", weight.scalar_type(), " weight");
  }
  const int64_t out_features = f32_panels         ? weight.size(0) * pdserve_cpu::kF32PanelCols
                               : kind == kPanels ? weight.size(0) * pdserve_cpu::kPanelCols
                                                 : weight.size(0);
  if (bias.has_value())
    PDSERVE_CHECK_VALUE(bias->scalar_type() == dtype && bias->numel() == out_features,
                        "register_decode_model: a bias must be ", dtype, " with one value per output");
  std::optional<at::Tensor> id;
  if (weight_id >= 0) id = at::scalar_tensor(weight_id, at::TensorOptions().dtype(at::kLong));
  Linear linear{static_cast<LinearKind>(kind), weight, out_features, bias, id};
  if (kind == kPanels) linear.in_features = f32_panels ? weight.size(1) : weight.size(1) * 2;
  if (takes_any_rows(linear.kind)) {
    const int64_t row_bytes = kind == kQ4_1 ? pdserve_cpu::kQ4RowBytes : pdserve_cpu::kQ8RowBytes;
    PDSERVE_CHECK_VALUE(weight.size(1) % row_bytes == 0, "register_decode_model: GGUF blocks of ", row_bytes,
                        " bytes per 32 columns, got rows of ", weight.size(1), " bytes");
    linear.in_features = weight.size(1) / row_bytes * pdserve_cpu::kBlockCols;
#ifdef PDSERVE_ROW_GROUPS
    const uint8_t* w = weight.data_ptr<uint8_t>();
    const int64_t num_blocks = weight.size(1) / row_bytes;
    using pdserve_cpu::BlockFormat;
    linear.padded_last = kind == kQ4_1 ? pdserve_cpu::pad_last_group<BlockFormat::kQ4_1>(w, out_features, num_blocks)
                                       : pdserve_cpu::pad_last_group<BlockFormat::kQ8_0>(w, out_features, num_blocks);
#endif
  }
  return linear;
}

// Whether bf16 panels may run in a parallel region here: panel_gemm on vector units.
bool panels_in_regions() {
#ifdef PDSERVE_PANEL_GEMM
#ifdef PDSERVE_HAS_AMX
  return !pdserve_cpu::amx_tiles_usable();
#else
  return true;
#endif
#else
  return false;
#endif
}

// Whether fp32 panels may run in a parallel region here: built with their tiles.
bool f32_panels_in_regions() {
#ifdef PDSERVE_F32_PANEL_GEMM
  return true;
#else
  return false;
#endif
}

// Whether a linear can run in a parallel region here: GGUF blocks, bf16 panels where
// panels_in_regions, fp32 panels where f32_panels_in_regions (row-major weights take their
// op).
bool runs_in_regions(const Linear& l) {
  if (l.kind != kPanels) return takes_any_rows(l.kind);
  return has_f32_panels(l) ? f32_panels_in_regions() : panels_in_regions();
}

// The prepacked op's limit on rows for a linear's panels (prepacked_rows_limit's name):
// past it the op takes oneDNN, whose sums differ.
const char* panel_rows_limit_op(const Linear& l) {
  return has_f32_panels(l) ? "pdserve_gemv::f32_panel_gemm_max_rows" : "pdserve_gemv::panel_gemm_max_rows";
}

// The most rows of x for which pdserve_gemv::prepacked_linear multiplies a linear as the
// region does, asked of the GEMV library's op `name` (registration only): "panel_gemm_max_rows"
// for bf16 panels and "f32_panel_gemm_max_rows" for fp32 ones (past them oneDNN),
// "q8_0_max_rows" for Q8_0 blocks (past them its panels or oneDNN). Up to there the region's GEMVs give the op's bits.
int64_t prepacked_rows_limit(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<int64_t()>().call();
}

// Whether run_layers_in_regions serves the model's steps of up to how many tokens (0: none,
// Model::max_region_tokens): every linear GGUF blocks or panels (bf16 ones where panel_gemm
// runs on vector units: its AMX form keeps the op; panels up to the rows the op takes them
// for), of the shapes a Llama layer has, the same in every layer, and one sliding window for
// all (one attention plan a step). Others (and mismatched shapes, which the GEMV ops then
// report) take run_layers.
int64_t region_tokens_limit(const Model& model, int64_t hidden_size) {
#ifdef PDSERVE_ROW_GROUPS
  const int64_t attended = model.num_heads * model.head_dim;
  const int64_t qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim;
  const int64_t I = model.layers[0].down.in_features;
  int64_t limit = std::numeric_limits<int64_t>::max();  // GGUF blocks: any rows
  for (const Layer& layer : model.layers) {
    if (layer.sliding_window != model.layers[0].sliding_window) return 0;  // one attention plan a step
    for (const Linear* l : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) {
      if (!runs_in_regions(*l)) return 0;
      if (l->kind == kPanels)
        limit = std::min(limit, std::max(kMaxGemvTokens, prepacked_rows_limit(panel_rows_limit_op(*l))));
    }
    if (layer.qkv.in_features != hidden_size || layer.qkv.out_features != qkv || layer.o.in_features != attended ||
        layer.o.out_features != hidden_size || layer.gate_up.in_features != hidden_size ||
        layer.gate_up.out_features != 2 * I || layer.down.in_features != I || layer.down.out_features != hidden_size)
      return 0;
  }
  return limit;
#else
  return 0;
#endif
}

// The most tokens decode_tokens may take for the model with this head, after a final norm,
// within the region form's limit: as far as the head's own op multiplies the rows as the
// region does, so the tokens are the ones it gives (past them it takes panels or oneDNN,
// whose logits differ): Q8_0 blocks and panels their prepacked_rows_limit, Q4_1 blocks
// (which no prepacked head holds) kMaxGemvTokens.
int64_t head_tokens_limit(const Model& model, const Linear& head) {
  if (model.max_region_tokens == 0 || !model.final_norm.has_value()) return 0;
  if (!runs_in_regions(head)) return 0;
  const int64_t head_rows = head.kind == kPanels  ? prepacked_rows_limit(panel_rows_limit_op(head))
                            : head.kind == kQ8_0 ? prepacked_rows_limit("pdserve_gemv::q8_0_max_rows")
                                                 : kMaxGemvTokens;
  return std::min(model.max_region_tokens, std::max(kMaxGemvTokens, head_rows));
}

// Keeps the model's tensors (they are shared with the model, not copied) until
// release_decode_model; returns the id decode_layers takes. in_regions: let a model of
// GGUF blocks or panels take run_layers_in_regions (false: run_layers, for comparison).
// embedding [num_embeddings, hidden_size] and head (of kind head_kind, [vocab_size +
// padding] outputs) with head_bias: what decode_tokens reads (none: it does not serve the model).
int64_t register_decode_model(at::TensorList norms, at::TensorList weights, at::IntArrayRef kinds,
                              const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef sliding_windows,
                              const std::optional<at::Tensor>& final_norm, const at::Tensor& cos,
                              const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              double rms_norm_eps, double attention_scale, at::OptionalIntArrayRef weight_ids,
                              bool in_regions, const std::optional<at::Tensor>& embedding,
                              const std::optional<at::Tensor>& head, int64_t head_kind,
                              const std::optional<at::Tensor>& head_bias, int64_t vocab_size) {
  const size_t num_layers = sliding_windows.size();
  PDSERVE_CHECK_VALUE(num_layers >= 1 && norms.size() == 2 * num_layers && weights.size() == 4 * num_layers &&
                          kinds.size() == weights.size() && biases.size() == weights.size(),
                      "register_decode_model: per layer 2 norms and 4 linears (weight, kind, bias) expected");
  PDSERVE_CHECK_VALUE(!weight_ids.has_value() || weight_ids->size() == weights.size(),
                      "register_decode_model: one weight id per weight (-1: none) expected");
  const at::ScalarType dtype = norms[0].scalar_type();
  PDSERVE_CHECK_VALUE(dtype == at::kBFloat16 || dtype == at::kFloat, "register_decode_model: bf16 or fp32 models, got ",
                      dtype);
  const int64_t hidden_size = norms[0].numel();
  for (const at::Tensor& norm : norms)
    PDSERVE_CHECK_VALUE(norm.scalar_type() == dtype && norm.numel() == hidden_size && norm.is_contiguous(),
                        "register_decode_model: norm weights must be contiguous ", dtype, " of ", hidden_size,
                        " values");
  if (final_norm.has_value())
    PDSERVE_CHECK_VALUE(final_norm->scalar_type() == dtype && final_norm->numel() == hidden_size &&
                            final_norm->is_contiguous(),
                        "register_decode_model: the final norm must be contiguous ", dtype);
  PDSERVE_CHECK_VALUE(cos.scalar_type() == at::kFloat && cos.dim() == 2 && cos.is_contiguous() &&
                          sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat && sin.is_contiguous() &&
                          2 * cos.size(1) <= head_dim,
                      "register_decode_model: cos and sin must be contiguous fp32 [max_position, rotary_dim / 2]");
  // Any step size where every linear takes any rows: its GGUF blocks' GEMV, or
  // pdserve_gemv::prepacked_linear past the dense GEMVs.
  bool any_size = true;
  for (size_t i = 0; i < weights.size(); ++i)
    any_size = any_size && (takes_any_rows(static_cast<LinearKind>(kinds[i])) ||
                            (weight_ids.has_value() && (*weight_ids)[i] >= 0));
  Model model{{}, final_norm, cos, sin, num_heads, num_kv_heads, head_dim, rms_norm_eps, attention_scale,
              any_size ? std::numeric_limits<int64_t>::max() : kMaxGemvTokens};
  for (size_t l = 0; l < num_layers; ++l) {
    auto lin = [&](size_t j) {
      const size_t i = 4 * l + j;
      return make_linear(kinds[i], weights[i], biases.get(i), weight_ids.has_value() ? (*weight_ids)[i] : -1, dtype);
    };
    Layer layer{norms[2 * l], norms[2 * l + 1], lin(0), lin(1), lin(2), lin(3), sliding_windows[l]};
    model.layers.push_back(std::move(layer));
  }
  model.max_region_tokens = in_regions ? region_tokens_limit(model, hidden_size) : 0;
  for (const Layer& layer : model.layers)
    for (const Linear* l : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
      model.layers_have_f32_panels = model.layers_have_f32_panels || has_f32_panels(*l);
  auto widths_of = [](const Linear& l) {
    return std::pair<int64_t, int64_t>{l.kind == kDense ? l.weight.size(1) : l.in_features, l.out_features};
  };
  for (const Layer& layer : model.layers)
    model.projection_widths.push_back(
        {widths_of(layer.qkv), widths_of(layer.o), widths_of(layer.gate_up), widths_of(layer.down)});
  PDSERVE_CHECK_VALUE(embedding.has_value() == head.has_value(),
                      "register_decode_model: an embedding and a head together, or neither");
  if (head.has_value()) {
    PDSERVE_CHECK_VALUE(embedding->dim() == 2 && embedding->scalar_type() == dtype && embedding->is_contiguous() &&
                            embedding->size(0) >= 1 && embedding->size(1) == hidden_size,
                        "register_decode_model: the embedding must be contiguous ", dtype,
                        " [num_embeddings, hidden_size ", hidden_size, "], got ", embedding->scalar_type(), " ",
                        embedding->sizes());
    Linear projection = make_linear(head_kind, *head, head_bias, -1, dtype);
    PDSERVE_CHECK_VALUE(projection.kind != kDense && projection.in_features == hidden_size,
                        "register_decode_model: the head must be GGUF blocks or panels over the hidden size");
    PDSERVE_CHECK_VALUE(vocab_size >= 1 && vocab_size <= projection.out_features, "register_decode_model: vocab_size ",
                        vocab_size, " must be 1 to the head's ", projection.out_features, " outputs");
    model.max_head_tokens = head_tokens_limit(model, projection);
    model.token_head = TokenHead{*embedding, std::move(projection), vocab_size};
  }
  std::lock_guard<std::mutex> lock(models_mutex);
  models.push_back(std::make_shared<const Model>(std::move(model)));
  return static_cast<int64_t>(models.size()) - 1;
}

// The model registered as model_id (a reference: a step keeps it while it runs).
std::shared_ptr<const Model> registered_model(int64_t model_id, const char* op) {
  std::shared_ptr<const Model> model;
  {
    std::lock_guard<std::mutex> lock(models_mutex);
    if (model_id >= 0 && model_id < static_cast<int64_t>(models.size())) model = models[model_id];
  }
  PDSERVE_CHECK_VALUE(model != nullptr, op, ": no model is registered as ", model_id);
  return model;
}

// The most tokens a step of this model may have: kMaxGemvTokens, or INT64_MAX where every
// linear has a weight id or GGUF blocks (the rule register_decode_model applied; callers
// route steps by it).
int64_t decode_model_max_tokens(int64_t model_id) {
  return registered_model(model_id, "decode_model_max_tokens")->max_tokens;
}

// The most tokens of the model's steps that run in one parallel region (run_layers_in_regions;
// 0: none do, others fork and join per projection).
int64_t decode_model_max_region_tokens(int64_t model_id) {
  return registered_model(model_id, "decode_model_max_region_tokens")->max_region_tokens;
}

void release_decode_model(int64_t model_id) {
  std::lock_guard<std::mutex> lock(models_mutex);
  // A step running now keeps its own reference until it returns.
  if (model_id >= 0 && model_id < static_cast<int64_t>(models.size())) models[model_id].reset();
}

// The checks every step of M tokens passes before it runs (op: the caller's name).
void check_step(const Model& model, int64_t M, const at::Tensor& positions, at::TensorList k_caches,
                at::TensorList v_caches, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                const char* op) {
  PDSERVE_CHECK_VALUE(M >= 1 && M <= model.max_tokens, op, ": 1 to ", model.max_tokens, " tokens for this model, got ",
                      M);
  PDSERVE_CHECK_VALUE(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == M,
                      op, ": positions must be [num_tokens] int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    PDSERVE_CHECK_VALUE(pos[m] >= 0 && pos[m] < model.cos.size(0), op, ": position ", pos[m],
                        " is outside the RoPE table's ", model.cos.size(0));
  const size_t num_layers = model.layers.size();
  PDSERVE_CHECK_VALUE(k_caches.size() == num_layers && v_caches.size() == num_layers, op,
                      ": one K and one V cache per layer (", num_layers, ") expected");
  PDSERVE_CHECK_VALUE(query_start_loc.numel() == M + 1 && seq_lens.numel() == M, op,
                      ": one query per sequence (query_start_loc of num_tokens + 1 values)");
}

// The step's LoRA adapters where lora_ids [M] int64 names any for its rows (-1: none),
// checked against the model's projections; none where no row names one.
std::optional<lora::Step> lora_step(const Model& model, const std::optional<at::Tensor>& lora_ids, int64_t M,
                                    const char* op) {
  if (!lora_ids.has_value()) return std::nullopt;
  lora::Step step = lora::make_step(*lora_ids, M, at::get_num_threads(), model.projection_widths,
                                    model.layers[0].input_norm.scalar_type(), op);
  if (step.groups.empty()) return std::nullopt;
  return step;
}

// hidden [num_tokens, hidden_size] (the embedded tokens, one per decode sequence) ->
// the last layer's output [num_tokens, hidden_size], through the final norm where the
// model was registered with one. Each layer writes its new K/V at slot_mapping and attends
// over the step's block tables (one query per sequence: query_start_loc is 0..num_tokens).
// lora_ids [num_tokens] int64: the LoRA adapter (register_decode_adapter) each row's
// projections add the deltas of, -1: none.
at::Tensor decode_layers(int64_t model_id, const at::Tensor& hidden, const at::Tensor& positions,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables,
                         const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         const std::optional<at::Tensor>& lora_ids) {
  const std::shared_ptr<const Model> model = registered_model(model_id, "decode_layers");
  const at::ScalarType dtype = model->layers[0].input_norm.scalar_type();
  PDSERVE_CHECK_VALUE(hidden.dim() == 2 && hidden.scalar_type() == dtype && hidden.is_contiguous() &&
                          hidden.size(1) == model->layers[0].input_norm.numel(),
                      "decode_layers: hidden must be contiguous ", dtype, " [num_tokens, hidden_size], got ",
                      hidden.scalar_type(), " ", hidden.sizes());
  const int64_t M = hidden.size(0);
  check_step(*model, M, positions, k_caches, v_caches, query_start_loc, seq_lens, "decode_layers");
  std::optional<lora::Step> lora_rows = lora_step(*model, lora_ids, M, "decode_layers");
  lora::Step* lora_p = lora_rows.has_value() ? &*lora_rows : nullptr;
#ifdef PDSERVE_ROW_GROUPS
  if (M <= model->max_region_tokens) {
    if (dtype == at::kFloat)
      return run_layers_in_regions<float>(*model, hidden, positions, k_caches, v_caches, slot_mapping, block_tables,
                                          query_start_loc, seq_lens, nullptr, nullptr, {}, lora_p);
    return run_layers_in_regions<at::BFloat16>(*model, hidden, positions, k_caches, v_caches, slot_mapping,
                                               block_tables, query_start_loc, seq_lens, nullptr, nullptr, {}, lora_p);
  }
#endif
  if (dtype == at::kFloat)
    return run_layers<float>(*model, hidden, positions, k_caches, v_caches, slot_mapping, block_tables,
                             query_start_loc, seq_lens, lora_p);
  return run_layers<at::BFloat16>(*model, hidden, positions, k_caches, v_caches, slot_mapping, block_tables,
                                  query_start_loc, seq_lens, lora_p);
}

// hidden [M, H] <- the embedding's rows of ids [M]. An id outside them (given, or taken in an
// earlier step by a head wider than the embedding) raises.
void embed_rows(const at::Tensor& embedding, const int64_t* ids, at::Tensor& hidden, int64_t step) {
  const int64_t M = hidden.size(0), num_embeddings = embedding.size(0);
  const int64_t row_bytes = hidden.size(1) * embedding.element_size();
  for (int64_t m = 0; m < M; ++m) {
    PDSERVE_CHECK_VALUE(ids[m] >= 0 && ids[m] < num_embeddings, "decode_tokens: token id ", ids[m], " of row ", m,
                        " (step ", step, ") is outside the embedding's ", num_embeddings, " rows");
    std::memcpy(static_cast<char*>(hidden.data_ptr()) + m * row_bytes,
                static_cast<const char*>(embedding.const_data_ptr()) + ids[m] * row_bytes, row_bytes);
  }
}

// Every row of a decode step one position on: positions [M] int64, seq_lens [M] int32, and
// slot_mapping [M] int64 from each row's block table [M, max_blocks] int32.
void advance_rows(at::Tensor& positions, at::Tensor& slot_mapping, at::Tensor& seq_lens,
                  const at::Tensor& block_tables, int64_t block_size) {
  int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* slots = slot_mapping.data_ptr<int64_t>();
  int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t m = 0; m < positions.numel(); ++m) {
    pos[m] += 1;
    lens[m] += 1;
    const int32_t* table = block_tables.data_ptr<int32_t>() + m * block_tables.stride(0);
    slots[m] = static_cast<int64_t>(table[pos[m] / block_size]) * block_size + pos[m] % block_size;
  }
}

// input_ids [num_tokens] int64 (one per decode sequence) -> each sequence's next num_steps
// tokens [num_tokens, num_steps] int64: the argmax of the head's logits after the layers, as
// decode_layers, the head and argmax_rows give it one after another, or where the row has a
// temperature > 0 the token the sampler's native passes draw from those logits at the row's
// uniform of the step (check_sampling says how they come), in one parallel region a step (a
// model registered with an embedding and a head, steps of up to
// decode_model_max_head_tokens). Past the first step each row goes on from the token it
// just took, one position further (its slot read from its block table): block_tables must
// hold every row's blocks through position + num_steps - 1 (the scheduler's lookahead).
// stop_token_ids [S] int64: the steps end early, [num_tokens, steps run], once every row has
// taken one of them (steps past a stop would be thrown away). logits [num_tokens, the head's
// outputs] of the model's dtype (one step only): the head's logits land there, for the caller
// to sample rows whose sampling the loop does not do (a grammar's) as compute_logits' logits
// would give them. num_logprobs, logprobs, logprob_token_ids (check_logprobs): step s writes
// the logprobs of each row that reports them to logprobs[s, m] (the taken token's, then its
// top ones') and the top tokens to logprob_token_ids[s, m], as the sampler reports them.
// penalties, history_token_ids, history_offsets, held_back_steps (check_history): each row's
// penalties over its prompt and output tokens, the tokens it takes in this call's steps
// counted too, and its stop tokens held back for its first steps (min_tokens), applied to its
// logits before its argmax, draw and logprobs, as the sampler applies them. lora_ids: as
// decode_layers'.
at::Tensor decode_tokens(int64_t model_id, const at::Tensor& input_ids, const at::Tensor& positions,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                         const at::Tensor& seq_lens, int64_t num_steps,
                         const std::optional<at::Tensor>& stop_token_ids,
                         const std::optional<at::Tensor>& temperatures, const std::optional<at::Tensor>& uniforms,
                         const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                         const std::optional<at::Tensor>& min_p, const std::optional<at::Tensor>& logits,
                         const std::optional<at::Tensor>& num_logprobs, const std::optional<at::Tensor>& logprobs,
                         const std::optional<at::Tensor>& logprob_token_ids,
                         const std::optional<at::Tensor>& penalties, const std::optional<at::Tensor>& history_token_ids,
                         const std::optional<at::Tensor>& history_offsets,
                         const std::optional<at::Tensor>& held_back_steps,
                         const std::optional<at::Tensor>& lora_ids) {
  const std::shared_ptr<const Model> model = registered_model(model_id, "decode_tokens");
  PDSERVE_CHECK_VALUE(model->max_head_tokens > 0, "decode_tokens: model ", model_id,
                      " has no head this loop can run (register it with an embedding and a head of GGUF blocks "
                      "or bf16 panels, in one region a step)");
  PDSERVE_CHECK_VALUE(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong && input_ids.is_contiguous(),
                      "decode_tokens: input_ids must be contiguous [num_tokens] int64, got ", input_ids.scalar_type(),
                      " ", input_ids.sizes());
  const int64_t M = input_ids.numel();
  PDSERVE_CHECK_VALUE(M >= 1 && M <= model->max_head_tokens, "decode_tokens: 1 to ", model->max_head_tokens,
                      " tokens for this model, got ", M);
  PDSERVE_CHECK_VALUE(num_steps >= 1, "decode_tokens: num_steps must be at least 1, got ", num_steps);
  check_step(*model, M, positions, k_caches, v_caches, query_start_loc, seq_lens, "decode_tokens");
  const std::vector<pdserve_cpu::sampling::Truncation> truncations =
      check_sampling(M, num_steps, temperatures, uniforms, top_k, top_p, min_p);
  const TokenHead& head = *model->token_head;
  const int64_t max_logprobs =
      check_logprobs(M, num_steps, head.vocab_size, num_logprobs, logprobs, logprob_token_ids);
  std::vector<pdserve_cpu::sampling::RowHistory> row_histories =
      check_history(M, head.vocab_size, penalties, history_token_ids, history_offsets, held_back_steps);
  std::optional<lora::Step> lora_rows = lora_step(*model, lora_ids, M, "decode_tokens");
  lora::Step* lora_p = lora_rows.has_value() ? &*lora_rows : nullptr;
  if (logits.has_value())
    PDSERVE_CHECK_VALUE(num_steps == 1 && logits->dim() == 2 && logits->size(0) == M &&
                            logits->size(1) == head.linear.out_features &&
                            logits->scalar_type() == head.embedding.scalar_type() && logits->is_contiguous(),
                        "decode_tokens: logits must be contiguous ", head.embedding.scalar_type(), " [num_tokens ", M,
                        ", the head's ", head.linear.out_features, " outputs], of one step, got ",
                        logits->scalar_type(), " ", logits->sizes(), " for ", num_steps, " steps");
  at::Tensor token_ids = at::empty({M, num_steps}, input_ids.options());  // [M, num_steps]
  at::Tensor step_ids = at::empty({M}, input_ids.options());             // [M] one step's tokens
  at::Tensor hidden = at::empty({M, head.embedding.size(1)}, head.embedding.options());  // [M, H] embedded
  at::Tensor step_positions = positions, step_slots = slot_mapping, step_seq_lens = seq_lens;
  const int64_t block_size = k_caches[0].size(1);
  if (num_steps > 1) {
    PDSERVE_CHECK_VALUE(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt &&
                            seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
                        "decode_tokens: block_tables [num_tokens, max_blocks] and seq_lens [num_tokens] int32");
    for (int64_t m = 0; m < M; ++m) {
      const int64_t final_pos = positions.data_ptr<int64_t>()[m] + num_steps - 1;
      PDSERVE_CHECK_VALUE(final_pos < model->cos.size(0), "decode_tokens: step ", num_steps, " of row ", m,
                          " reaches position ", final_pos, ", outside the RoPE table's ", model->cos.size(0));
      PDSERVE_CHECK_VALUE(final_pos / block_size < block_tables.size(1), "decode_tokens: row ", m,
                          "'s block table ends before position ", final_pos, " (", num_steps, " steps)");
    }
    // This call's own copies: each step moves them on by one position.
    step_positions = positions.clone();
    step_slots = slot_mapping.clone();
    step_seq_lens = seq_lens.clone();
  }
  std::vector<int64_t> stops;
  if (stop_token_ids.has_value()) {
    PDSERVE_CHECK_VALUE(stop_token_ids->dim() == 1 && stop_token_ids->scalar_type() == at::kLong &&
                            stop_token_ids->is_contiguous(),
                        "decode_tokens: stop_token_ids must be contiguous [S] int64");
    const int64_t* begin = stop_token_ids->data_ptr<int64_t>();
    stops.assign(begin, begin + stop_token_ids->numel());
  }
  std::vector<bool> stopped(M, false);
  int64_t num_stopped = 0, num_run = num_steps;
  const int64_t* next_ids = input_ids.data_ptr<int64_t>();
  for (int64_t step = 0; step < num_steps; ++step) {
    if (step > 0) advance_rows(step_positions, step_slots, step_seq_lens, block_tables, block_size);
    embed_rows(head.embedding, next_ids, hidden, step);
    StepSampling sampling;
    if (temperatures.has_value())
      sampling = {temperatures->const_data_ptr<float>(), truncations.data(),
                  uniforms->const_data_ptr<double>() + step * M};
    if (logits.has_value()) sampling.logits = logits->data_ptr();
    if (!row_histories.empty()) sampling.histories = row_histories.data();
    if (max_logprobs >= 0) {
      sampling.num_logprobs = num_logprobs->const_data_ptr<int64_t>();
      sampling.max_logprobs = max_logprobs;
      sampling.logprobs = logprobs->data_ptr<float>() + step * M * (1 + max_logprobs);
      sampling.logprob_token_ids = logprob_token_ids->data_ptr<int64_t>() + step * M * max_logprobs;
    }
#ifdef PDSERVE_ROW_GROUPS
    if (hidden.scalar_type() == at::kFloat)
      run_layers_in_regions<float>(*model, hidden, step_positions, k_caches, v_caches, step_slots, block_tables,
                                   query_start_loc, step_seq_lens, &head, step_ids.data_ptr<int64_t>(), sampling,
                                   lora_p);
    else
      run_layers_in_regions<at::BFloat16>(*model, hidden, step_positions, k_caches, v_caches, step_slots,
                                          block_tables, query_start_loc, step_seq_lens, &head,
                                          step_ids.data_ptr<int64_t>(), sampling, lora_p);
#endif
    const int64_t* taken = step_ids.data_ptr<int64_t>();
    int64_t* out = token_ids.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m) {
      out[m * num_steps + step] = taken[m];
      if (!stopped[m] && std::find(stops.begin(), stops.end(), taken[m]) != stops.end()) {
        stopped[m] = true;
        ++num_stopped;
      }
    }
    next_ids = taken;
    if (num_stopped == M && step + 1 < num_steps) {
      num_run = step + 1;
      break;
    }
  }
  return num_run == num_steps ? token_ids : token_ids.narrow(1, 0, num_run).contiguous();
}

// The most tokens a decode_tokens step of this model may have (0: it serves none).
int64_t decode_model_max_head_tokens(int64_t model_id) {
  return registered_model(model_id, "decode_model_max_head_tokens")->max_head_tokens;
}

// The columns of decode_tokens' logits: the head's outputs (0: registered without a head).
int64_t decode_model_head_outputs(int64_t model_id) {
  const std::shared_ptr<const Model> model = registered_model(model_id, "decode_model_head_outputs");
  return model->token_head.has_value() ? model->token_head->linear.out_features : 0;
}

// Keeps an adapter's stacked matrices for the steps that name it (lora_ids) until
// release_decode_adapter: per layer, for qkv, o, gate_up and down, A [R, K] and B [N, R] of
// the model's dtype, or None where it leaves the projection alone; scaling its factor.
int64_t register_decode_adapter(const c10::List<std::optional<at::Tensor>>& a,
                                const c10::List<std::optional<at::Tensor>>& b, double scaling) {
  return lora::register_adapter(a, b, scaling);
}

void release_decode_adapter(int64_t adapter_id) { lora::release_adapter(adapter_id); }

}  // namespace

TORCH_LIBRARY(pdserve_decode, m) {
  m.def("register_decode_model(Tensor[] norms, Tensor[] weights, int[] kinds, Tensor?[] biases, "
        "int[] sliding_windows, Tensor? final_norm, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, "
        "int head_dim, float rms_norm_eps, float attention_scale, int[]? weight_ids=None, bool in_regions=True, "
        "Tensor? embedding=None, Tensor? head=None, int head_kind=0, Tensor? head_bias=None, int vocab_size=0) -> int",
        &register_decode_model);
  m.def("decode_model_max_tokens(int model_id) -> int", &decode_model_max_tokens);
  m.def("decode_model_max_region_tokens(int model_id) -> int", &decode_model_max_region_tokens);
  m.def("decode_model_max_head_tokens(int model_id) -> int", &decode_model_max_head_tokens);
  m.def("decode_model_head_outputs(int model_id) -> int", &decode_model_head_outputs);
  m.def("release_decode_model(int model_id) -> ()", &release_decode_model);
  m.def("register_decode_adapter(Tensor?[] a, Tensor?[] b, float scaling) -> int", &register_decode_adapter);
  m.def("release_decode_adapter(int adapter_id) -> ()", &release_decode_adapter);
  m.def("decode_layers(int model_id, Tensor hidden, Tensor positions, Tensor[] k_caches, Tensor[] v_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor? lora_ids=None) -> Tensor");
  m.def("decode_tokens(int model_id, Tensor input_ids, Tensor positions, Tensor[] k_caches, Tensor[] v_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, int num_steps=1, "
        "Tensor? stop_token_ids=None, Tensor? temperatures=None, Tensor? uniforms=None, Tensor? top_k=None, "
        "Tensor? top_p=None, Tensor? min_p=None, Tensor(a!)? logits=None, Tensor? num_logprobs=None, "
        "Tensor(b!)? logprobs=None, Tensor(c!)? logprob_token_ids=None, Tensor? penalties=None, "
        "Tensor? history_token_ids=None, Tensor? history_offsets=None, Tensor? held_back_steps=None, "
        "Tensor? lora_ids=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_decode, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_tokens", &decode_tokens);
}

// A decode step's attention run by the threads of another library's OpenMP region
// (decode_layers.cpp's layer loop), layer after layer, with no fork and join of its own.
// paged_attention.cpp implements it; the op pdserve_cpu::team_attention_api hands out the
// address of its TeamAttentionApi (the two libraries are built by the same compiler and
// flags, and load one libgomp, whose barriers the calls use).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pdserve_cpu {

struct TeamAttention;  // one step's plan: its work items, splits, output and the new K/V to write

struct TeamAttentionApi {
  // Checks everything each layer's paged_attention_with_kv_write would, for caches shaped
  // as k_cache and v_cache (ValueError), and plans the step's work for num_threads threads:
  // then `write` and `attend` cannot fail. q, k, v: views whose data the caller rewrites before each layer.
  TeamAttention* (*begin)(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                          int64_t sliding_window, int64_t num_threads);
  // Inside a parallel region of the num_threads threads, called by each (thread t) once its
  // tokens [token_begin, token_end) of k and v are final: writes their K/V at their slots in
  // this layer's caches (shaped as begin's); thread 0 also points the step at them. The
  // caller's barrier then separates every thread's write from `attend`.
  void (*write)(TeamAttention* team, const at::Tensor& k_cache, const at::Tensor& v_cache, int t, int64_t token_begin,
                int64_t token_end);
  // Then, called by each thread: the layer's attention into out; returns after a barrier,
  // out complete.
  void (*attend)(TeamAttention* team, int t);
  // [num_tokens, num_q_heads, head_dim]: every layer's output, rewritten by each.
  at::Tensor (*out)(TeamAttention* team);
  void (*end)(TeamAttention* team);
};

}  // namespace pdserve_cpu

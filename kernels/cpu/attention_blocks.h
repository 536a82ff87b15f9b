// Per-cache-block steps of the CPU attention kernel: scores, softmax numerators and the
// P.V accumulation for a work item's query rows against one block's keys.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec_math.h"

namespace pdserve_cpu {

// Softmax numerators of one row: p[j] = exp(s[j] - max) for j in [begin, end), 0 for the
// rest of [first, last); whole Vecs from first rounded down (the row is padded). Returns
// the sum of the p.
inline float row_probabilities(float* s, int64_t first, int64_t last, int64_t begin, int64_t end, float max) {
  VecI32 lane;
  for (int64_t i = 0; i < kLanes; ++i) lane[i] = static_cast<int32_t>(i);
  Vec sum{};
  for (int64_t j = first / kLanes * kLanes; j < last; j += kLanes) {
    const VecI32 index = lane + static_cast<int32_t>(j);
    const VecI32 visible = (index >= static_cast<int32_t>(begin)) & (index < static_cast<int32_t>(end));
    const Vec p = visible ? exp_nonpositive(load_vec(s + j) - max) : Vec{};
    std::memcpy(s + j, &p, sizeof p);
    sum += p;
  }
  return hsum(sum);
}

// scores[j] = q . k_j for j in [begin, end), q ([kNumVec] Vecs) held in registers.
// Four keys at a time: one key's dot product is a chain of kNumVec dependent FMAs (8 with
// head_dim 64 on AVX2), so a key at a time waits on FMA latency where the keys are in
// cache (one sequence, 1,024 positions: 0.155 -> 0.131 ms a layer on Zen 3; a batch of 64
// waits on memory instead and did not move). Each key's sum is formed in the same order
// either way, so the scores are the same bits.
template <int64_t kNumVec, typename T>
inline void row_scores(const float* q_row, const T* k_block, int64_t k_pos_stride, int64_t begin, int64_t end,
                       float* scores) {
  Vec q[kNumVec];
  for (int64_t v = 0; v < kNumVec; ++v) q[v] = load_vec(q_row + v * kLanes);
  int64_t j = begin;
  for (; j + 4 <= end; j += 4) {
    const T* k0 = k_block + j * k_pos_stride;
    const T* k1 = k0 + k_pos_stride;
    const T* k2 = k1 + k_pos_stride;
    const T* k3 = k2 + k_pos_stride;
    Vec a0 = q[0] * load_vec(k0), a1 = q[0] * load_vec(k1), a2 = q[0] * load_vec(k2), a3 = q[0] * load_vec(k3);
    for (int64_t v = 1; v < kNumVec; ++v) {
      a0 += q[v] * load_vec(k0 + v * kLanes);
      a1 += q[v] * load_vec(k1 + v * kLanes);
      a2 += q[v] * load_vec(k2 + v * kLanes);
      a3 += q[v] * load_vec(k3 + v * kLanes);
    }
    scores[j] = hsum(a0);
    scores[j + 1] = hsum(a1);
    scores[j + 2] = hsum(a2);
    scores[j + 3] = hsum(a3);
  }
  for (; j < end; ++j) {
    const T* k = k_block + j * k_pos_stride;
    Vec a = q[0] * load_vec(k);
    for (int64_t v = 1; v < kNumVec; ++v) a += q[v] * load_vec(k + v * kLanes);
    scores[j] = hsum(a);
  }
}

// kRows rows at once: acc_r += sum_j p_r[j] v_j for j in [begin, end), where p_r is 0
// outside row r's own keys; every V load serves all kRows rows, whose accumulators stay
// in registers (kRows x kNumVec Vecs).
template <int64_t kNumVec, int64_t kRows, typename T>
inline void rows_accumulate(float* acc_rows, int64_t acc_stride, const float* p_rows, int64_t p_stride,
                            const T* v_block, int64_t v_pos_stride, int64_t begin, int64_t end) {
  Vec acc[kRows][kNumVec];
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t v = 0; v < kNumVec; ++v) acc[r][v] = load_vec(acc_rows + r * acc_stride + v * kLanes);
  for (int64_t j = begin; j < end; ++j) {
    const T* v_row = v_block + j * v_pos_stride;
    for (int64_t v = 0; v < kNumVec; ++v) {
      const Vec x = load_vec(v_row + v * kLanes);
      for (int64_t r = 0; r < kRows; ++r) acc[r][v] += p_rows[r * p_stride + j] * x;
    }
  }
  for (int64_t r = 0; r < kRows; ++r) std::memcpy(acc_rows + r * acc_stride, acc[r], sizeof acc[r]);
}

// Many rows (prefill tiles): transpose the block's K once, then each row's scores for
// kLanes keys are one vector of FMAs with q broadcast, no horizontal sums; rows go in
// fours so each K^T vector load serves four rows.
template <int64_t kHeadDim, typename T>
inline void transposed_scores(const float* q_rows, int64_t num_rows, const T* k_block, int64_t k_pos_stride,
                              int64_t keys_begin, int64_t keys_end, int64_t score_stride, float* k_t,
                              float* scores) {
  if (keys_begin % kLanes != 0 || keys_end % kLanes != 0)  // lanes past the keys: zeros, not stale bits
    std::fill(k_t, k_t + kHeadDim * score_stride, 0.f);
  for (int64_t j = keys_begin; j < keys_end; ++j) {
    const T* k = k_block + j * k_pos_stride;
    for (int64_t d = 0; d < kHeadDim; ++d) k_t[d * score_stride + j] = to_float(k[d]);
  }
  for (int64_t kv = keys_begin / kLanes * kLanes; kv < keys_end; kv += kLanes) {
    int64_t r = 0;
    for (; r + 4 <= num_rows; r += 4) {
      const float* q = q_rows + r * kHeadDim;
      Vec a0{}, a1{}, a2{}, a3{}, b0{}, b1{}, b2{}, b3{};  // even and odd d: eight FMA chains
      for (int64_t d = 0; d < kHeadDim; d += 2) {
        const Vec k = load_vec(k_t + d * score_stride + kv);
        const Vec k_odd = load_vec(k_t + (d + 1) * score_stride + kv);
        a0 += q[d] * k;
        a1 += q[kHeadDim + d] * k;
        a2 += q[2 * kHeadDim + d] * k;
        a3 += q[3 * kHeadDim + d] * k;
        b0 += q[d + 1] * k_odd;
        b1 += q[kHeadDim + d + 1] * k_odd;
        b2 += q[2 * kHeadDim + d + 1] * k_odd;
        b3 += q[3 * kHeadDim + d + 1] * k_odd;
      }
      a0 += b0;
      a1 += b1;
      a2 += b2;
      a3 += b3;
      std::memcpy(scores + r * score_stride + kv, &a0, sizeof a0);
      std::memcpy(scores + (r + 1) * score_stride + kv, &a1, sizeof a1);
      std::memcpy(scores + (r + 2) * score_stride + kv, &a2, sizeof a2);
      std::memcpy(scores + (r + 3) * score_stride + kv, &a3, sizeof a3);
    }
    for (; r < num_rows; ++r) {
      Vec a{};
      for (int64_t d = 0; d < kHeadDim; ++d) a += q_rows[r * kHeadDim + d] * load_vec(k_t + d * score_stride + kv);
      std::memcpy(scores + r * score_stride + kv, &a, sizeof a);
    }
  }
}

// Into L2 (prefetcht1), not L1: see kPrefetchBlocks.
template <typename T>
inline void prefetch_rows(const T* first, int64_t row_stride, int64_t num_rows, int64_t head_dim) {
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  for (int64_t j = 0; j < num_rows; ++j)
    for (int64_t d = 0; d < head_dim; d += kLine) __builtin_prefetch(first + j * row_stride + d, 0, 2);
}

}  // namespace pdserve_cpu

// Per-cache-block steps of the CPU attention kernel: scores, softmax numerators and the
// P.V accumulation for a work item's query rows against one block's keys.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "transpose16.h"
#include "transpose8.h"
#include "vec_math.h"

namespace pdserve_cpu {

// 0, 1, ..., kLanes - 1: a key's lane in a Vec of scores.
inline VecI32 lane_index() {
  VecI32 lane;
  for (int64_t i = 0; i < kLanes; ++i) lane[i] = static_cast<int32_t>(i);
  return lane;
}

// Lanes of the Vec of scores from key j (lane: lane_index()) whose keys are in [begin, end).
inline VecI32 visible_lanes(VecI32 lane, int64_t j, int64_t begin, int64_t end) {
  const VecI32 index = lane + static_cast<int32_t>(j);
  return (index >= static_cast<int32_t>(begin)) & (index < static_cast<int32_t>(end));
}

// max of s[j] for j in [begin, end) within [first, last), on whole Vecs (the row is padded).
// Four running maxima over a long row (the whole-rows form's: up to 2,048 keys), so each
// compare-and-select waits on the one four Vecs back, not the one before (a 1,024-token
// prompt's attention on Zen 5 ~5% faster than with one chain).
inline float row_block_max(const float* s, int64_t first, int64_t last, int64_t begin, int64_t end) {
  constexpr int64_t kChains = 4;
  const VecI32 lane = lane_index();
  Vec max[kChains];
  for (Vec& m : max) m = Vec{} - __builtin_inff();
  auto take = [&](Vec& m, int64_t j) {
    const VecI32 visible = visible_lanes(lane, j, begin, end);
    const Vec v = load_vec(s + j);
    m = visible && v > m ? v : m;
  };
  int64_t j = first / kLanes * kLanes;
  for (; j + kChains * kLanes <= last; j += kChains * kLanes)
    for (int64_t c = 0; c < kChains; ++c) take(max[c], j + c * kLanes);
  for (; j < last; j += kLanes) take(max[0], j);
  for (int64_t c = 1; c < kChains; ++c) max[0] = max[c] > max[0] ? max[c] : max[0];
  return hmax(max[0]);
}

// The exps a softmax takes: to fp32's precision, or to bf16's where the probabilities are
// rounded to bf16 for P.V.
struct ExpFp32 {
  Vec operator()(Vec x) const { return exp_nonpositive(x); }
};
struct ExpForBf16 {
  Vec operator()(Vec x) const { return exp_nonpositive_bf16(x); }
};

// Softmax numerators of one row: p[j] = exp(s[j] * scale - max) for j in [begin, end), 0 for the
// rest of [first, last); whole Vecs from first rounded down (the row is padded), each handed
// to store(j, p). Returns their sums per lane: the row's running sum stays a Vec, summed
// across once at the end.
template <typename Exp = ExpFp32, typename Store>
inline Vec row_probabilities(const float* s, int64_t first, int64_t last, int64_t begin, int64_t end, float max,
                             float scale, Store&& store) {
  const VecI32 lane = lane_index();
  Vec sum{};
  for (int64_t j = first / kLanes * kLanes; j < last; j += kLanes) {
    const VecI32 visible = visible_lanes(lane, j, begin, end);
    const Vec p = visible ? Exp{}(load_vec(s + j) * scale - max) : Vec{};
    store(j, p);
    sum += p;
  }
  return sum;
}

// The same, the numerators written back over the scores.
template <typename Exp = ExpFp32>
inline Vec row_probabilities(float* s, int64_t first, int64_t last, int64_t begin, int64_t end, float max) {
  return row_probabilities<Exp>(s, first, last, begin, end, max, 1.f,
                                [s](int64_t j, Vec p) { std::memcpy(s + j, &p, sizeof p); });
}

// {hsum(a0), hsum(a1), hsum(a2), hsum(a3)} by one transposing add tree: three
// pairwise steps serve all four sums, where four hsums take three each.
typedef float Vec4 __attribute__((vector_size(4 * sizeof(float))));
inline Vec4 hsum4(Vec a0, Vec a1, Vec a2, Vec a3) {
  typedef float Vec8 __attribute__((vector_size(8 * sizeof(float))));
#if defined(__AVX512F__)
  auto fold = [](Vec v) -> Vec8 {
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  };
#else
  auto fold = [](Vec v) -> Vec8 { return v; };
#endif
  // pair(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7] (vhaddps)
  auto pair = [](Vec8 a, Vec8 b) -> Vec8 {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  const Vec8 u = pair(pair(fold(a0), fold(a1)), pair(fold(a2), fold(a3)));  // [lower halves' sums | upper]
  return __builtin_shufflevector(u, u, 0, 1, 2, 3) + __builtin_shufflevector(u, u, 4, 5, 6, 7);
}

// Query rows a work item scores together where it does not transpose K (a decode token's
// group of query heads): every K load serves them all. With AVX2's 16 registers, 3 rows x 4
// keys of accumulators plus the loads just fit.
constexpr int64_t kScoreRows = kLanes == 16 ? 4 : 3;

// scores[r * score_stride + j] = q_r . k_j for R rows and j in [begin, end), four keys at a
// time: R x 4 independent FMA chains (one key's dot product alone is a chain of kNumVec
// dependent FMAs that waits on FMA latency), one add tree for four keys' sums.
template <int64_t kNumVec, int64_t R, typename T>
inline void rows_scores(const float* q_rows, int64_t q_stride, const T* k_block, int64_t k_pos_stride, int64_t begin,
                        int64_t end, float* scores, int64_t score_stride) {
  int64_t j = begin;
  for (; j + 4 <= end; j += 4) {
    const T* k0 = k_block + j * k_pos_stride;
    Vec acc[R][4];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < 4; ++i) acc[r][i] = Vec{};
    for (int64_t v = 0; v < kNumVec; ++v) {
      Vec k[4];
      for (int64_t i = 0; i < 4; ++i) k[i] = load_vec(k0 + i * k_pos_stride + v * kLanes);
      for (int64_t r = 0; r < R; ++r) {
        const Vec q = load_vec(q_rows + r * q_stride + v * kLanes);
        for (int64_t i = 0; i < 4; ++i) acc[r][i] += q * k[i];
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const Vec4 sums = hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      std::memcpy(scores + r * score_stride + j, &sums, sizeof sums);
    }
  }
  for (; j < end; ++j) {
    const T* k = k_block + j * k_pos_stride;
    for (int64_t r = 0; r < R; ++r) {
      Vec a{};
      for (int64_t v = 0; v < kNumVec; ++v) a += load_vec(q_rows + r * q_stride + v * kLanes) * load_vec(k + v * kLanes);
      scores[r * score_stride + j] = hsum(a);
    }
  }
}

// Rows a P.V pass accumulates together, and the Vecs of head_dim each pass covers: the
// kAccumRows x kAccumVecs accumulators, one V load and one broadcast p fit the registers
// (12 + 2 of AVX2's 16; 24 + 2 of AVX-512's 32).
constexpr int64_t kAccumRows = kLanes == 16 ? 6 : 3;
constexpr int64_t kAccumVecs = 4;

// R rows at once: acc_r += sum_j p_r[j] v_j for j in [begin, end), where p_r is 0 outside
// row r's own keys; every V load serves all R rows. head_dim goes in passes of
// kAccumVecs Vecs, each over its own part of the V rows, so nothing is loaded twice.
// per_key(j) runs once per key, between the first pass's keys (the caller's prefetches).
template <int64_t kNumVec, int64_t R, typename T, typename PerKey>
inline void rows_accumulate(float* acc_rows, int64_t acc_stride, const float* p_rows, int64_t p_stride,
                            const T* v_block, int64_t v_pos_stride, int64_t begin, int64_t end, PerKey&& per_key) {
  constexpr int64_t kChunk = kNumVec < kAccumVecs ? kNumVec : kAccumVecs;
  static_assert(kNumVec % kChunk == 0);
  for (int64_t c = 0; c < kNumVec; c += kChunk) {
    Vec acc[R][kChunk];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t v = 0; v < kChunk; ++v) acc[r][v] = load_vec(acc_rows + r * acc_stride + (c + v) * kLanes);
    for (int64_t j = begin; j < end; ++j) {
      if (c == 0) per_key(j);
      const T* v_row = v_block + j * v_pos_stride + c * kLanes;
      for (int64_t v = 0; v < kChunk; ++v) {
        const Vec x = load_vec(v_row + v * kLanes);
        for (int64_t r = 0; r < R; ++r) acc[r][v] += p_rows[r * p_stride + j] * x;
      }
    }
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(acc_rows + r * acc_stride + c * kLanes, acc[r], sizeof acc[r]);
  }
}

// Many rows (prefill tiles): transpose the block's K once, then each row's scores for
// kLanes keys are one vector of FMAs with q broadcast, no horizontal sums; rows go in
// fours so each K^T vector load serves four rows. k_t [kHeadDim, k_t_stride]: the block's
// keys' K^T (k_t_stride at least keys_end rounded up to kLanes).
template <int64_t kHeadDim, typename T>
inline void transposed_scores(const float* q_rows, int64_t num_rows, const T* k_block, int64_t k_pos_stride,
                              int64_t keys_begin, int64_t keys_end, int64_t score_stride, float* k_t,
                              int64_t k_t_stride, float* scores) {
#if defined(PDSERVE_TRANSPOSE16) || defined(PDSERVE_TRANSPOSE8)
  if constexpr (std::is_same_v<T, float> && kHeadDim % kLanes == 0) {
    // kLanes keys x kLanes d at a time in registers (transpose16.h on AVX-512, transpose8.h
    // on AVX2): scattered single-float stores would stall the vector loads of k_t after them
    // (AVX2, one SmolLM2 layer's 1,024-token prompt on the Zen 4 running that build: 11.7 ->
    // 10.5 ms). Keys outside the range: zeros, not stale bits.
    for (int64_t first = keys_begin / kLanes * kLanes; first < keys_end; first += kLanes)
      for (int64_t d0 = 0; d0 < kHeadDim; d0 += kLanes)
        transpose_key_floats(k_block + d0, k_pos_stride, first, keys_begin, keys_end,
                             k_t + d0 * k_t_stride + first, k_t_stride);
  } else
#endif
  {
    if (keys_begin % kLanes != 0 || keys_end % kLanes != 0)  // lanes past the keys: zeros, not stale bits
      std::fill(k_t, k_t + kHeadDim * k_t_stride, 0.f);
    for (int64_t j = keys_begin; j < keys_end; ++j) {
      const T* k = k_block + j * k_pos_stride;
      for (int64_t d = 0; d < kHeadDim; ++d) k_t[d * k_t_stride + j] = to_float(k[d]);
    }
  }
  for (int64_t kv = keys_begin / kLanes * kLanes; kv < keys_end; kv += kLanes) {
    int64_t r = 0;
    for (; r + 4 <= num_rows; r += 4) {
      const float* q = q_rows + r * kHeadDim;
      Vec a0{}, a1{}, a2{}, a3{}, b0{}, b1{}, b2{}, b3{};  // even and odd d: eight FMA chains
      for (int64_t d = 0; d < kHeadDim; d += 2) {
        const Vec k = load_vec(k_t + d * k_t_stride + kv);
        const Vec k_odd = load_vec(k_t + (d + 1) * k_t_stride + kv);
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
      for (int64_t d = 0; d < kHeadDim; ++d) a += q_rows[r * kHeadDim + d] * load_vec(k_t + d * k_t_stride + kv);
      std::memcpy(scores + r * score_stride + kv, &a, sizeof a);
    }
  }
}

// The whole-rows fp32 form's scores go a span of keys at a time: kSpanRows rows by kSpanVecs
// Vecs of keys of accumulators, with the span's K^T loads and a broadcast q, fit the registers
// (24 + 4 + 1 of AVX-512's 32; 12 + 2 + 1 of AVX2's 16). Each q broadcast then serves
// kSpanVecs FMAs and each K^T load kSpanRows of them (AVX-512: 10 loads to 24 FMAs, AVX2: 8 to
// 12, where transposed_scores' 4 rows by one Vec take 10 loads to 8).
constexpr int64_t kSpanVecs = kLanes == 16 ? 4 : 2;
constexpr int64_t kSpanRows = 6;
constexpr int64_t kSpanKeys = kSpanVecs * kLanes;  // 64 keys on AVX-512, 16 on AVX2

// K^T of the span's keys [key0, key0 + kSpanKeys) into k_t [kHeadDim, kSpanKeys]: key j's row
// from block_rows(b) (block b's first row, the key's block; null past the last block), zeros
// for keys outside [lo, hi) or past the last block, so every lane of the span scores finite.
template <int64_t kHeadDim, typename BlockRows>
inline void span_keys_transposed(BlockRows&& block_rows, int64_t k_pos_stride, int64_t block_size, int64_t key0,
                                 int64_t lo, int64_t hi, float* k_t) {
  static_assert(kHeadDim % kLanes == 0);
  for (int64_t c = 0; c < kSpanKeys; c += kLanes) {  // blocks hold whole Vecs of keys (block_size % 16 == 0)
    const int64_t key = key0 + c, b = key / block_size, block_start = b * block_size;
    const float* rows = block_rows(b);
    // Block-relative; an empty range where the block is past the last or outside [lo, hi).
    const int64_t keys_begin = rows == nullptr ? 0 : std::max(lo, block_start) - block_start;
    const int64_t keys_end =
        rows == nullptr ? 0 : std::max(keys_begin, std::min(hi, block_start + block_size) - block_start);
#if defined(PDSERVE_TRANSPOSE16) || defined(PDSERVE_TRANSPOSE8)
    for (int64_t d0 = 0; d0 < kHeadDim; d0 += kLanes)
      transpose_key_floats(rows == nullptr ? nullptr : rows + d0, k_pos_stride, key - block_start, keys_begin, keys_end,
                           k_t + d0 * kSpanKeys + c, kSpanKeys);
#else
    for (int64_t i = 0; i < kLanes; ++i) {
      const int64_t j = key - block_start + i;
      const bool visible = j >= keys_begin && j < keys_end;
      for (int64_t d = 0; d < kHeadDim; ++d) k_t[d * kSpanKeys + c + i] = visible ? rows[j * k_pos_stride + d] : 0.f;
    }
#endif
  }
}

// scores[r * score_stride + c] = q_r . k_t[:, c] for R rows and the span's kSpanKeys columns
// (k_t [kHeadDim, kSpanKeys], span_keys_transposed's); q_rows [R, kHeadDim].
template <int64_t kHeadDim, int64_t R>
inline void span_scores(const float* q_rows, const float* k_t, float* scores, int64_t score_stride) {
  Vec acc[R][kSpanVecs];
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int64_t n = 0; n < kSpanVecs; ++n) acc[r][n] = Vec{};
  for (int64_t d = 0; d < kHeadDim; ++d) {
    Vec k[kSpanVecs];
#pragma GCC unroll 16
    for (int64_t n = 0; n < kSpanVecs; ++n) k[n] = load_vec(k_t + d * kSpanKeys + n * kLanes);
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) {
      const float q = q_rows[r * kHeadDim + d];
#pragma GCC unroll 16
      for (int64_t n = 0; n < kSpanVecs; ++n) acc[r][n] += q * k[n];
    }
  }
  // Each Vec stored by value: a memcpy from acc[r] takes the array's address, and GCC 12 then
  // keeps every accumulator on the stack (AVX2), loaded and stored at each step of d.
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int64_t n = 0; n < kSpanVecs; ++n) store_vec(scores + r * score_stride + n * kLanes, acc[r][n]);
}

// R rows' acc_r += sum_j p_r[j] v_j over keys [begin, end) (relative to key `base`, p_r[j]
// at p_rows + r * p_stride + j), each key's V row found in its cache block (v_blocks[b]:
// block b's first row, b counted from base's block), the accumulators held in registers
// across every block (the whole-rows form: no load and store of them per block, as
// rows_accumulate does). p_r is 0 outside row r's own keys; every key in [begin, end) is
// a written cache row. per_key(j) runs once per key, in the first pass over head_dim (the
// caller's prefetches). A row's keys taken in consecutive ranges, call after call, sum in
// the same order as in one call: the same bits.
template <int64_t kNumVec, int64_t R, typename T, typename PerKey>
inline void whole_rows_accumulate(float* acc_rows, int64_t acc_stride, const float* p_rows, int64_t p_stride,
                                  const T* const* v_blocks, int64_t v_pos_stride, int64_t block_size, int64_t begin,
                                  int64_t end, PerKey&& per_key) {
  constexpr int64_t kChunk = kNumVec < kAccumVecs ? kNumVec : kAccumVecs;
  static_assert(kNumVec % kChunk == 0);
  for (int64_t c = 0; c < kNumVec; c += kChunk) {
    Vec acc[R][kChunk];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t v = 0; v < kChunk; ++v) acc[r][v] = load_vec(acc_rows + r * acc_stride + (c + v) * kLanes);
    for (int64_t b = begin / block_size; b * block_size < end; ++b) {
      const T* v_block = v_blocks[b] + c * kLanes;
      const int64_t first = std::max(begin, b * block_size), last = std::min(end, (b + 1) * block_size);
      for (int64_t j = first; j < last; ++j) {
        if (c == 0) per_key(j);
        const T* v_row = v_block + (j - b * block_size) * v_pos_stride;
        for (int64_t v = 0; v < kChunk; ++v) {
          const Vec x = load_vec(v_row + v * kLanes);
          for (int64_t r = 0; r < R; ++r) acc[r][v] += p_rows[r * p_stride + j] * x;
        }
      }
    }
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(acc_rows + r * acc_stride + c * kLanes, acc[r], sizeof acc[r]);
  }
}

// Into L2 (prefetcht1), not L1: see kPrefetchBlocks.
template <typename T>
inline void prefetch_rows(const T* first, int64_t row_stride, int64_t num_rows, int64_t head_dim) {
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  for (int64_t j = 0; j < num_rows; ++j)
    for (int64_t d = 0; d < head_dim; d += kLine) __builtin_prefetch(first + j * row_stride + d, 0, 2);
}

// One head's rows of a block ahead (K or V), asked for in parts: a whole block's lines at
// once fill the L1's miss buffers, and the work behind the burst stalls until they drain.
// Asked between the work on the current block instead (decode at batch 64, context 200, KV
// from DRAM: ~20% faster), the loads overlap that work.
// kHeadDim > 0 fixes head_dim at compile time (the lines of a row then unroll).
template <typename T, int64_t kHeadDim>
class RowsAhead {
 public:
  RowsAhead(const T* rows, int64_t row_stride, int64_t num_rows, int64_t head_dim)
      : rows_(rows), row_stride_(row_stride), num_rows_(rows == nullptr ? 0 : num_rows), head_dim_(head_dim) {}
  // Ask for the rows before `upto` not asked for yet.
  void ask_until(int64_t upto) {
    for (; num_asked_ < upto && num_asked_ < num_rows_; ++num_asked_)
      prefetch_rows(rows_ + num_asked_ * row_stride_, row_stride_, 1, kHeadDim > 0 ? kHeadDim : head_dim_);
  }
  void ask_next() { ask_until(num_asked_ + 1); }
  void ask_rest() { ask_until(num_rows_); }

 private:
  const T* rows_;
  int64_t row_stride_, num_rows_, head_dim_, num_asked_ = 0;
};

}  // namespace pdserve_cpu

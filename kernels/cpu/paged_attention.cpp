// Paged attention on CPU that reads K/V in place from the block-table cache.
//
// One op serves decode and ragged prefill (decode is prefill with one query per
// sequence): query row j of sequence i sits at position context_len + j and sees the
// keys (position - sliding_window, position] clipped to [0, position]. Each work item
// is (sequence, kv head, tile of query tokens): its query heads share every K/V row
// it loads, and an online softmax (flash style) runs over the cache blocks, so
// nothing is gathered and the scores never exceed one block per query row.
// Math is fp32 whatever the cache dtype. Bad arguments raise ValueError, as the torch path does.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kQueryTile = 16;  // query tokens per work item in prefill chunks
constexpr int64_t kTransposeMinRows = 8;  // rows from which transposing a K block pays

struct WorkItem {
  int64_t seq;
  int64_t first_token;     // index into q
  int64_t num_tokens;
  int64_t first_position;  // position of first_token in its sequence
};

// Everything one call's work items share; strides in elements.
struct Problem {
  const void* q;
  int64_t q_token_stride, q_head_stride;
  const void* k;
  const void* v;
  int64_t k_block_stride, k_pos_stride, k_head_stride;
  int64_t v_block_stride, v_pos_stride, v_head_stride;
  void* out;
  int64_t out_token_stride, out_head_stride;
  const int32_t* block_tables;
  int64_t block_table_stride, num_blocks, block_size, group, head_dim, sliding_window;
  float scale, logit_softcap;
};

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.x) << 16); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// exp(x) for the softmax's x <= 0, in a form the compiler vectorises (glibc's expf has
// no vector variant without -ffast-math): Cephes' range reduction and polynomial,
// relative error ~1e-7.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  return y * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

template <int64_t kHeadDim, typename T>
inline float dot(const float* __restrict q, const T* __restrict k, int64_t head_dim) {
  const int64_t dim = kHeadDim > 0 ? kHeadDim : head_dim;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < dim; ++d) acc += q[d] * to_float(k[d]);
  return acc;
}

template <int64_t kHeadDim, typename T>
inline void axpy(float* __restrict acc, float p, const T* __restrict v, int64_t head_dim) {
  const int64_t dim = kHeadDim > 0 ? kHeadDim : head_dim;
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) acc[d] += p * to_float(v[d]);
}

// Explicit vectors for the head_dims the kernel is specialised for (GCC/Clang vector
// extensions: zmm with AVX-512, else ymm/xmm pairs). One Vec holds kLanes floats.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t Vec16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t VecU32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline Vec load_vec(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline Vec load_vec(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  Vec16 h;
  std::memcpy(&h, p, sizeof h);
  return (Vec)(__builtin_convertvector(h, VecU32) << 16);
}
inline Vec load_vec(const c10::Half* p) {
  Vec v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
// Horizontal sum by halving (log2(kLanes) shuffle + add steps, not kLanes extracts).
inline float hsum(Vec v) {
  typedef float Half8 __attribute__((vector_size(8 * sizeof(float))));
  typedef float Half4 __attribute__((vector_size(4 * sizeof(float))));
#if defined(__AVX512F__)
  const Half8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const Half8 h8 = v;
#endif
  const Half4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

typedef int32_t VecI32 __attribute__((vector_size(kLanes * sizeof(int32_t))));

// exp_nonpositive on a whole Vec (the scalar one does not vectorise inside GCC's loops).
inline Vec exp_nonpositive(Vec x) {
  x = x < -87.f ? Vec{} - 87.f : x;
  const Vec t = x * 1.44269504f + 0.5f;
  VecI32 n = __builtin_convertvector(t, VecI32);  // truncates; floor for negative t below
  Vec nf = __builtin_convertvector(n, Vec);
  const VecI32 too_big = nf > t;  // -1 where trunc rounded up
  n += too_big;
  nf = __builtin_convertvector(n, Vec);
  const Vec r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  Vec y = Vec{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  return y * (Vec)((n + 127) << 23);
}

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
template <int64_t kNumVec, typename T>
inline void row_scores(const float* q_row, const T* k_block, int64_t k_pos_stride, int64_t begin, int64_t end,
                       float* scores) {
  Vec q[kNumVec];
  for (int64_t v = 0; v < kNumVec; ++v) q[v] = load_vec(q_row + v * kLanes);
  for (int64_t j = begin; j < end; ++j) {
    const T* k = k_block + j * k_pos_stride;
    Vec a = q[0] * load_vec(k);
    for (int64_t v = 1; v < kNumVec; ++v) a += q[v] * load_vec(k + v * kLanes);
    scores[j] = hsum(a);
  }
}

// Two rows at once: acc_a += sum_j p_a[j] v_j, acc_b likewise, for j in [begin, end) where
// p is 0 outside each row's own keys; every V load serves both rows.
template <int64_t kNumVec, typename T>
inline void row_pair_accumulate(float* acc_a, float* acc_b, const float* p_a, const float* p_b, const T* v_block,
                                int64_t v_pos_stride, int64_t begin, int64_t end) {
  Vec a[kNumVec], b[kNumVec];
  for (int64_t v = 0; v < kNumVec; ++v) {
    a[v] = load_vec(acc_a + v * kLanes);
    b[v] = load_vec(acc_b + v * kLanes);
  }
  for (int64_t j = begin; j < end; ++j) {
    const T* v_row = v_block + j * v_pos_stride;
    for (int64_t v = 0; v < kNumVec; ++v) {
      const Vec x = load_vec(v_row + v * kLanes);
      a[v] += p_a[j] * x;
      b[v] += p_b[j] * x;
    }
  }
  std::memcpy(acc_a, a, sizeof a);
  std::memcpy(acc_b, b, sizeof b);
}

// acc += sum_j p[j] v_j for j in [begin, end), acc held in registers.
template <int64_t kNumVec, typename T>
inline void row_accumulate(float* acc_row, const float* p, const T* v_block, int64_t v_pos_stride, int64_t begin,
                           int64_t end) {
  Vec acc[kNumVec];
  for (int64_t v = 0; v < kNumVec; ++v) acc[v] = load_vec(acc_row + v * kLanes);
  for (int64_t j = begin; j < end; ++j) {
    const T* v_row = v_block + j * v_pos_stride;
    for (int64_t v = 0; v < kNumVec; ++v) acc[v] += p[j] * load_vec(v_row + v * kLanes);
  }
  std::memcpy(acc_row, acc, sizeof acc);
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

template <typename T>
inline void prefetch_rows(const T* first, int64_t row_stride, int64_t num_rows, int64_t head_dim) {
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  for (int64_t j = 0; j < num_rows; ++j)
    for (int64_t d = 0; d < head_dim; d += kLine) __builtin_prefetch(first + j * row_stride + d);
}

// One work item: the item's query tokens x the kv head's group of query heads ("rows",
// row r = token r / group, head r % group) against the keys they see, one cache block
// at a time. kHeadDim > 0 fixes head_dim at compile time: the rows' dot products and
// accumulators then live in vector registers.
template <typename T, int64_t kHeadDim>
void attend_item(const Problem& pr, const WorkItem& item, int64_t kv_head, std::vector<float>& scratch,
                 std::vector<int64_t>& bounds) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : pr.head_dim;
  constexpr int64_t kNumVec = kHeadDim > 0 && kHeadDim % kLanes == 0 ? kHeadDim / kLanes : 0;
  const int64_t block_size = pr.block_size, group = pr.group;
  const int64_t num_rows = item.num_tokens * group;
  // Score rows padded to whole Vecs, so the transposed path stores full vectors.
  const int64_t score_stride = (block_size + kLanes - 1) / kLanes * kLanes;
  const bool transposed = kNumVec > 0 && num_rows >= kTransposeMinRows;
  scratch.resize(2 * num_rows * head_dim + 2 * num_rows + num_rows * score_stride +
                 (transposed ? head_dim * score_stride : 0));
  bounds.resize(2 * num_rows);
  float* q_rows = scratch.data();                  // [num_rows, head_dim], pre-scaled
  float* acc = q_rows + num_rows * head_dim;       // [num_rows, head_dim]
  float* row_max = acc + num_rows * head_dim;      // [num_rows]
  float* row_sum = row_max + num_rows;             // [num_rows]
  float* scores = row_sum + num_rows;              // [num_rows, score_stride], then probabilities
  float* k_t = scores + num_rows * score_stride;   // [head_dim, score_stride]: the block's K, transposed
  int64_t* row_begin = bounds.data();              // [num_rows] visible keys of this block, relative
  int64_t* row_end = row_begin + num_rows;         // [num_rows]
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::fill(acc, acc + num_rows * head_dim, 0.f);
  std::fill(row_max, row_max + num_rows, kNegInf);
  std::fill(row_sum, row_sum + num_rows, 0.f);

  const T* q = static_cast<const T*>(pr.q);
  for (int64_t r = 0; r < num_rows; ++r) {
    const T* src =
        q + (item.first_token + r / group) * pr.q_token_stride + (kv_head * group + r % group) * pr.q_head_stride;
    for (int64_t d = 0; d < head_dim; ++d) q_rows[r * head_dim + d] = to_float(src[d]) * pr.scale;
  }
  // The token at position p sees keys [first_key(p), p].
  auto first_key = [&](int64_t p) {
    return pr.sliding_window > 0 ? std::max<int64_t>(0, p - pr.sliding_window + 1) : 0;
  };
  const int64_t lo = first_key(item.first_position);                 // the item's keys: [lo, hi)
  const int64_t hi = item.first_position + item.num_tokens;
  const T* k_head = static_cast<const T*>(pr.k) + kv_head * pr.k_head_stride;
  const T* v_head = static_cast<const T*>(pr.v) + kv_head * pr.v_head_stride;
  const int32_t* block_table = pr.block_tables + item.seq * pr.block_table_stride;

  for (int64_t b = lo / block_size; b * block_size < hi; ++b) {
    const int64_t block_id = block_table[b];
    TORCH_CHECK_VALUE(block_id >= 0 && block_id < pr.num_blocks, "block table entry ", block_id, " of sequence ",
                      item.seq, " is outside the cache's ", pr.num_blocks, " blocks");
    const int64_t block_start = b * block_size;
    const T* k_block = k_head + block_id * pr.k_block_stride;
    const T* v_block = v_head + block_id * pr.v_block_stride;
    if ((b + 1) * block_size < hi) {  // blocks lie anywhere: fetch the next one's rows of this head early
      const int64_t next_id = std::clamp<int64_t>(block_table[b + 1], 0, pr.num_blocks - 1);
      prefetch_rows(k_head + next_id * pr.k_block_stride, pr.k_pos_stride, block_size, head_dim);
      prefetch_rows(v_head + next_id * pr.v_block_stride, pr.v_pos_stride, block_size, head_dim);
    }
    const int64_t keys_begin = std::max(lo, block_start) - block_start;       // any row's keys here
    const int64_t keys_end = std::min(hi, block_start + block_size) - block_start;
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t position = item.first_position + r / group;
      row_begin[r] = std::max(first_key(position), block_start) - block_start;
      row_end[r] = std::min(position + 1, block_start + block_size) - block_start;
    }
    // Scores over [keys_begin, keys_end); a row's masked keys hold anything (the softmax skips them).
    if constexpr (kNumVec > 0) {
      if (transposed) {
        transposed_scores<kHeadDim>(q_rows, num_rows, k_block, pr.k_pos_stride, keys_begin, keys_end, score_stride,
                                    k_t, scores);
      } else {
        for (int64_t r = 0; r < num_rows; ++r) {
          float* s = scores + r * score_stride;
          row_scores<kNumVec>(q_rows + r * head_dim, k_block, pr.k_pos_stride, row_begin[r], row_end[r], s);
        }
      }
    } else {  // each K row loaded once for all rows
      for (int64_t j = keys_begin; j < keys_end; ++j) {
        const T* k_row = k_block + j * pr.k_pos_stride;
        for (int64_t r = 0; r < num_rows; ++r)
          if (j >= row_begin[r] && j < row_end[r])
            scores[r * score_stride + j] = dot<kHeadDim>(q_rows + r * head_dim, k_row, head_dim);
      }
    }
    // Online softmax: scores become probabilities against each row's running max.
    for (int64_t r = 0; r < num_rows; ++r) {
      float* s = scores + r * score_stride;
      const int64_t begin = row_begin[r], end = row_end[r];
      if (begin >= end) {
        std::fill(s + keys_begin, s + keys_end, 0.f);
        continue;
      }
      if (pr.logit_softcap > 0.f)
        for (int64_t j = begin; j < end; ++j) s[j] = std::tanh(s[j] / pr.logit_softcap) * pr.logit_softcap;
      float block_max = kNegInf;
#pragma omp simd reduction(max : block_max)
      for (int64_t j = begin; j < end; ++j) block_max = std::max(block_max, s[j]);
      const float new_max = std::max(row_max[r], block_max);
      if (new_max > row_max[r] && row_sum[r] > 0.f) {  // rescale what earlier blocks accumulated
        const float correction = exp_nonpositive(row_max[r] - new_max);
        row_sum[r] *= correction;
        float* acc_row = acc + r * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) acc_row[d] *= correction;
      }
      row_max[r] = new_max;
      row_sum[r] += row_probabilities(s, keys_begin, keys_end, begin, end, new_max);
    }
    // acc += P V over each row's visible keys (masked ones are skipped, not added as 0 x V).
    if constexpr (kNumVec > 0) {
      // Softmax left p = 0 on [keys_begin, keys_end) outside a row's keys, and those V rows
      // are real cached positions, so a pair runs over the union of its two ranges.
      int64_t r = 0;
      for (; r + 2 <= num_rows; r += 2) {
        const int64_t begin = std::min(row_begin[r], row_begin[r + 1]);
        const int64_t end = std::max(row_end[r], row_end[r + 1]);
        if (begin < end)
          row_pair_accumulate<kNumVec>(acc + r * head_dim, acc + (r + 1) * head_dim, scores + r * score_stride,
                                       scores + (r + 1) * score_stride, v_block, pr.v_pos_stride, begin, end);
      }
      for (; r < num_rows; ++r)
        if (row_begin[r] < row_end[r])
          row_accumulate<kNumVec>(acc + r * head_dim, scores + r * score_stride, v_block, pr.v_pos_stride,
                                  row_begin[r], row_end[r]);
    } else {  // each V row loaded once for all rows
      for (int64_t j = keys_begin; j < keys_end; ++j) {
        const T* v_row = v_block + j * pr.v_pos_stride;
        for (int64_t r = 0; r < num_rows; ++r)
          if (j >= row_begin[r] && j < row_end[r])
            axpy<kHeadDim>(acc + r * head_dim, scores[r * score_stride + j], v_row, head_dim);
      }
    }
  }
  T* out = static_cast<T*>(pr.out);
  for (int64_t r = 0; r < num_rows; ++r) {
    T* dst = out + (item.first_token + r / group) * pr.out_token_stride +
             (kv_head * group + r % group) * pr.out_head_stride;
    const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc[r * head_dim + d] * inv);
  }
}

template <typename T>
void attend_item_any_dim(const Problem& pr, const WorkItem& item, int64_t kv_head, std::vector<float>& scratch,
                         std::vector<int64_t>& bounds) {
  switch (pr.head_dim) {
    case 64: return attend_item<T, 64>(pr, item, kv_head, scratch, bounds);
    case 128: return attend_item<T, 128>(pr, item, kv_head, scratch, bounds);
    case 256: return attend_item<T, 256>(pr, item, kv_head, scratch, bounds);
    default: return attend_item<T, 0>(pr, item, kv_head, scratch, bounds);
  }
}

at::Tensor paged_attention(const at::Tensor& q,            // [num_tokens, num_q_heads, head_dim]
                           const at::Tensor& k_cache,      // [num_blocks, block_size, num_kv_heads, head_dim]
                           const at::Tensor& v_cache,      // [num_blocks, block_size, num_kv_heads, head_dim]
                           const at::Tensor& block_tables,     // [num_seqs, max_blocks] int32
                           const at::Tensor& query_start_loc,  // [num_seqs + 1] int32
                           const at::Tensor& seq_lens,         // [num_seqs] int32
                           double scale, int64_t sliding_window, double logit_softcap) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
                    "bad q/cache shapes");
  TORCH_CHECK_VALUE(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
                    "q and the caches must be contiguous in head_dim");
  TORCH_CHECK_VALUE(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
                    "dtype mismatch");
  TORCH_CHECK_VALUE(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0, "head mismatch");
  TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                        seq_lens.scalar_type() == at::kInt,
                    "metadata must be int32");
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.stride(1) == 1,
                    "block_tables must be [num_seqs, max_blocks]");
  const int64_t num_seqs = block_tables.size(0), max_blocks = block_tables.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK_VALUE(query_start_loc.is_contiguous() && query_start_loc.numel() == num_seqs + 1, "bad query_start_loc");
  TORCH_CHECK_VALUE(seq_lens.is_contiguous() && seq_lens.numel() == num_seqs, "bad seq_lens");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(starts[num_seqs] <= q.size(0), "query_start_loc ends past num_tokens");

  std::vector<WorkItem> items;
  items.reserve(num_seqs);
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t query_len = starts[i + 1] - starts[i], seq_len = lens[i];
    TORCH_CHECK_VALUE(query_len >= 0, "query_start_loc must be non-decreasing");
    if (query_len == 0 || seq_len == 0) continue;  // seq_len 0 is batch padding: zeros
    TORCH_CHECK_VALUE(seq_len >= query_len, "sequence ", i, ": seq_len ", seq_len, " < query_len ", query_len);
    TORCH_CHECK_VALUE((seq_len + block_size - 1) / block_size <= max_blocks, "sequence ", i, ": seq_len ", seq_len,
                " needs more blocks than block_tables has columns");
    for (int64_t t = 0; t < query_len; t += kQueryTile)
      items.push_back({i, starts[i] + t, std::min(kQueryTile, query_len - t), seq_len - query_len + t});
  }
  at::Tensor out = at::zeros(q.sizes(), q.options());
  const int64_t num_work = static_cast<int64_t>(items.size()) * num_kv_heads;
  const Problem problem{q.data_ptr(), q.stride(0), q.stride(1),
                        k_cache.data_ptr(), v_cache.data_ptr(),
                        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                        out.data_ptr(), out.stride(0), out.stride(1),
                        block_tables.data_ptr<int32_t>(), block_tables.stride(0), k_cache.size(0),
                        block_size, q.size(1) / num_kv_heads, q.size(2), sliding_window,
                        static_cast<float>(scale), static_cast<float>(logit_softcap)};
  // Longest items first, handed out one at a time: a static split of a batch with mixed
  // lengths leaves threads idle while one finishes the long sequences.
  std::vector<int64_t> order(num_work);
  for (int64_t w = 0; w < num_work; ++w) order[w] = w;
  auto cost = [&](int64_t w) {
    const WorkItem& item = items[w / num_kv_heads];
    return item.num_tokens * (item.first_position + item.num_tokens);
  };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  std::atomic<int64_t> next{0};
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), num_work);
  auto run = [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
      std::vector<float> scratch;
      std::vector<int64_t> bounds;
      for (int64_t i = next++; i < num_work; i = next++) {
        const int64_t w = order[i];
        attend_item_any_dim<T>(problem, items[w / num_kv_heads], w % num_kv_heads, scratch, bounds);
      }
    });
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK_VALUE(false, "paged_attention takes float32, bfloat16 or float16, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, float scale, int sliding_window, float logit_softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }

// One row of logits through random sampling: the softmax CDF inverted at a uniform number
// (draw_row), and the truncations before it (top_k_row, top_p_row, min_p_row), each in a few
// vector passes over the row. sampling.cpp's ops run them over the rows of a logits tensor;
// decode_layers.cpp's loop runs them on the rows its head just computed (sample_row).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "argmax.h"

namespace pdserve_cpu::sampling {

// Columns whose weights are summed as one float before the float64 running total: short
// enough that a float sum of at most kChunk weights <= 1 loses nothing a draw can see.
constexpr int64_t kChunk = 32 * pdserve_cpu::kLanes;

// exp(x - maximum) for each lane of x, 0 where x is -inf (a token truncation removed: it must
// not be drawn, where exp_nonpositive's clamp at -87 would give it 1.6e-38).
inline pdserve_cpu::Vec weights_of(pdserve_cpu::Vec x, float maximum) {
  using pdserve_cpu::Vec;
  using pdserve_cpu::VecI32;
  const Vec w = pdserve_cpu::exp_nonpositive(x - maximum);
  const VecI32 finite = x != -std::numeric_limits<float>::infinity();
  return (Vec)((VecI32)w & finite);
}

inline float weight_of(float x, float maximum) {
  if (x == -std::numeric_limits<float>::infinity()) return 0.f;
  return weights_of(pdserve_cpu::Vec{} + x, maximum)[0];  // the same polynomial as the vectors
}

// Whether a row whose argmax is `top` has a distribution to draw from or truncate: a finite
// maximum (no NaN; not every value -inf; no +inf, which would take all the mass).
inline bool has_distribution(const pdserve_cpu::ArgmaxPart& top) { return !top.is_nan && std::isfinite(top.value); }

// The sum of exp(x - maximum) over row x [n], maximum its largest value (finite): each chunk
// of kChunk columns summed as one float (into chunk_sums [number of chunks], where given), the
// chunks in float64.
inline double sum_weights(const float* x, int64_t n, float maximum, double* chunk_sums = nullptr) {
  using pdserve_cpu::kLanes;
  using pdserve_cpu::Vec;
  double total = 0.0;
  for (int64_t begin = 0; begin < n; begin += kChunk) {
    const int64_t end = std::min(n, begin + kChunk);
    Vec acc{};
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes) acc += weights_of(pdserve_cpu::load_vec(x + i), maximum);
    float sum = pdserve_cpu::hsum(acc);
    for (; i < end; ++i) sum += weight_of(x[i], maximum);
    if (chunk_sums != nullptr) chunk_sums[begin / kChunk] = sum;
    total += sum;
  }
  return total;
}

// The token of row x [n] whose interval of the softmax CDF holds u in [0, 1).
inline int64_t draw_row(const float* x, int64_t n, double u) {
  const pdserve_cpu::ArgmaxPart top = pdserve_cpu::argmax_part(x, n);
  if (!has_distribution(top))
    return top.index;  // no distribution to draw from: the first NaN, largest or +inf value
  const float maximum = top.value;
  const int64_t num_chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> chunk_sums(num_chunks);
  const double total = sum_weights(x, n, maximum, chunk_sums.data());
  const double target = u * total;
  double below = 0.0;  // the weight of the columns before chunk c
  for (int64_t c = 0; c < num_chunks; ++c) {
    if (below + chunk_sums[c] <= target) {
      below += chunk_sums[c];
      continue;
    }
    // Column by column in float64: the first whose running total passes the target has a
    // weight > 0. The chunk's float sum may differ from this in its last bits; when the
    // columns fall short, the search goes on in the next chunk.
    const int64_t begin = c * kChunk, end = std::min(n, begin + kChunk);
    for (int64_t i = begin; i < end; ++i) {
      below += weight_of(x[i], maximum);
      if (below > target) return i;
    }
  }
  // u * total rounded up to total: the last column with a weight (as torch's clamp to the
  // first index where the CDF reaches its end).
  for (int64_t i = n - 1; i >= 0; --i)
    if (weight_of(x[i], maximum) > 0.f) return i;
  return top.index;
}

// Buckets of the top_p histogram: kBucketsPerNat per nat of distance below the maximum, up
// to kNearNats; every token further below (weight < e^-16, 1.1e-7 of the top one) shares
// the last bucket.
constexpr float kBucketsPerNat = 16.f;
constexpr float kNearNats = 16.f;
constexpr int32_t kFarBucket = static_cast<int32_t>(kBucketsPerNat * kNearNats);
// top_k ranks in the far bucket up to this many by a heap; beyond, by selection over the bucket.
constexpr int64_t kMaxFarRank = 4096;
// Where top_p's mass crosses p in the far bucket (p within the far tokens' share of the mass
// of 1: ~1e-3 on a peaked row, so top_p >= 0.999), the far bucket again in kFarBucketsPerNat
// buckets a nat from kNearNats on, up to kFarNats where exp's clamp makes every weight alike;
// the rest (and -inf) share the last one.
constexpr float kFarBucketsPerNat = 16.f;
constexpr float kFarNats = 88.f;
constexpr int32_t kNumFarBuckets = static_cast<int32_t>(kFarBucketsPerNat * (kFarNats - kNearNats)) + 1;

// Each lane's bucket: its distance below the maximum in 1/kBucketsPerNat nats, kFarBucket from
// kNearNats on (and for -inf).
inline pdserve_cpu::VecI32 buckets_of(pdserve_cpu::Vec v, float maximum) {
  using pdserve_cpu::Vec;
  using pdserve_cpu::VecI32;
  const Vec distance = maximum - v;  // >= 0; +inf for -inf logits
  const VecI32 near = distance < kNearNats;
  const Vec scaled = near ? distance * kBucketsPerNat : Vec{};  // no conversion of inf
  const VecI32 bucket = __builtin_convertvector(scaled, VecI32);
  // distance * 16 may round up to 256 just below 16 nats: the far bucket too
  return near ? (bucket < kFarBucket ? bucket : VecI32{} + kFarBucket) : VecI32{} + kFarBucket;
}

inline int32_t bucket_of(float x, float maximum) { return buckets_of(pdserve_cpu::Vec{} + x, maximum)[0]; }

// Each lane's far bucket (0 to kNumFarBuckets - 1), for lanes of the far bucket.
inline pdserve_cpu::VecI32 far_buckets_of(pdserve_cpu::Vec v, float maximum) {
  using pdserve_cpu::Vec;
  using pdserve_cpu::VecI32;
  const Vec distance = maximum - v;  // >= ~kNearNats; +inf for -inf logits
  const VecI32 within = distance < kFarNats;
  const Vec scaled = within ? (distance - kNearNats) * kFarBucketsPerNat : Vec{};  // no conversion of inf
  const VecI32 bucket = __builtin_convertvector(scaled, VecI32);  // toward 0: just below kNearNats is 0
  return within ? (bucket < kNumFarBuckets - 1 ? bucket : VecI32{} + (kNumFarBuckets - 1))
                : VecI32{} + (kNumFarBuckets - 1);
}

// top_p's mass crosses p in the far bucket: buckets [n] (kFarBucket for x's far tokens) become
// kFarBucket + 1 + each far token's far bucket, `above` grows by the mass of the far buckets
// before the one where the mass crosses `target`, and that one is returned (as buckets holds
// it), so only its tokens are ranked rather than the whole far bucket (most of a vocabulary:
// ~3.6 ms a row of 49k to sort on the Zen 5 EPYC).
inline int32_t refine_far_bucket(const float* x, int64_t n, float maximum, std::vector<int32_t>& buckets,
                                 double target, double& above) {
  using pdserve_cpu::kLanes;
  using pdserve_cpu::Vec;
  using pdserve_cpu::VecI32;
  std::vector<double> mass(kNumFarBuckets);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    VecI32 bucket;
    std::memcpy(&bucket, buckets.data() + i, sizeof bucket);
    const VecI32 far = bucket == kFarBucket;
    const uint32_t far_bits = pdserve_cpu::lane_bits(far);
    if (far_bits == 0) continue;
    const Vec v = pdserve_cpu::load_vec(x + i);
    const VecI32 sub = far_buckets_of(v, maximum);
    const Vec w = weights_of(v, maximum);
    bucket = far ? sub + (kFarBucket + 1) : bucket;
    std::memcpy(buckets.data() + i, &bucket, sizeof bucket);
    for (uint32_t bits = far_bits; bits != 0; bits &= bits - 1) {
      const int lane = std::countr_zero(bits);
      mass[sub[lane]] += w[lane];
    }
  }
  for (; i < n; ++i) {
    if (buckets[i] != kFarBucket) continue;
    const int32_t sub = far_buckets_of(pdserve_cpu::Vec{} + x[i], maximum)[0];
    buckets[i] = kFarBucket + 1 + sub;
    mass[sub] += weight_of(x[i], maximum);
  }
  int32_t crossing = 0;
  while (crossing < kNumFarBuckets - 1 && above + mass[crossing] < target) above += mass[crossing++];
  return kFarBucket + 1 + crossing;
}

// Keep the most likely tokens of row x [n] until their mass reaches p: a token stays while
// the mass ranked above it is < p (so the one that crosses p stays, and the top one); the
// others become -inf. Equal logits within the bucket where the mass crosses p rank by column.
// p >= 1 leaves the row whole.
inline void top_p_row(float* x, int64_t n, float p, std::vector<int32_t>& buckets) {
  using pdserve_cpu::kLanes;
  using pdserve_cpu::Vec;
  using pdserve_cpu::VecI32;
  if (!(p < 1.f)) return;
  const pdserve_cpu::ArgmaxPart top = pdserve_cpu::argmax_part(x, n);
  if (!has_distribution(top))
    return;  // no distribution to truncate
  const float maximum = top.value;
  buckets.resize(n);
  double mass[kFarBucket + 1] = {};
  Vec far_acc{};  // the far bucket's weights, summed as vectors: most of a vocabulary lies there
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = pdserve_cpu::load_vec(x + i);
    const VecI32 bucket = buckets_of(v, maximum);
    std::memcpy(buckets.data() + i, &bucket, sizeof bucket);
    const VecI32 near = bucket < kFarBucket;
    const Vec w = weights_of(v, maximum);
    far_acc += (Vec)((VecI32)w & ~near);
    // most vectors of a peaked row have no lane near the top
    for (uint32_t bits = pdserve_cpu::lane_bits(near); bits != 0; bits &= bits - 1) {
      const int lane = std::countr_zero(bits);
      mass[bucket[lane]] += w[lane];
    }
  }
  for (; i < n; ++i) {
    buckets[i] = bucket_of(x[i], maximum);
    mass[buckets[i]] += weight_of(x[i], maximum);
  }
  mass[kFarBucket] += pdserve_cpu::hsum(far_acc);
  double total = 0.0;
  for (double m : mass) total += m;
  const double target = static_cast<double>(p) * total;
  double above = 0.0;  // the mass of the buckets before `crossing`
  int32_t crossing = 0;
  while (crossing < kFarBucket && above + mass[crossing] < target) above += mass[crossing++];
  if (crossing == kFarBucket) crossing = refine_far_bucket(x, n, maximum, buckets, target, above);
  // Tokens of buckets past `crossing` have at least `target` above them; those of `crossing`
  // are ranked one by one.
  // Ranked by logit, not weight: logits apart by less than exp's resolution share a weight.
  std::vector<std::pair<float, int64_t>> ranked;  // (-logit, column): most likely first
  const Vec minus_inf = Vec{} - std::numeric_limits<float>::infinity();
  for (i = 0; i + kLanes <= n; i += kLanes) {
    VecI32 bucket;
    std::memcpy(&bucket, buckets.data() + i, sizeof bucket);
    Vec v = pdserve_cpu::load_vec(x + i);
    const VecI32 in_crossing = (bucket == crossing) & (v != minus_inf);
    for (uint32_t bits = pdserve_cpu::lane_bits(in_crossing); bits != 0; bits &= bits - 1) {
      const int lane = std::countr_zero(bits);
      ranked.emplace_back(-v[lane], i + lane);
    }
    v = bucket > crossing ? minus_inf : v;
    std::memcpy(x + i, &v, sizeof v);
  }
  for (; i < n; ++i) {
    if (buckets[i] > crossing)
      x[i] = -std::numeric_limits<float>::infinity();
    else if (buckets[i] == crossing && x[i] != -std::numeric_limits<float>::infinity())
      ranked.emplace_back(-x[i], i);
  }
  std::sort(ranked.begin(), ranked.end());
  for (const auto& [negative_logit, column] : ranked) {
    if (above >= target) x[column] = -std::numeric_limits<float>::infinity();
    above += weight_of(-negative_logit, maximum);
  }
}

// Every logit of x [n] below kth_value becomes -inf.
inline void apply_threshold(float* x, int64_t n, float kth_value) {
  using pdserve_cpu::kLanes;
  using pdserve_cpu::Vec;
  const Vec threshold = Vec{} + kth_value;
  const Vec minus_inf = Vec{} - std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Vec v = pdserve_cpu::load_vec(x + i);
    v = v < threshold ? minus_inf : v;
    std::memcpy(x + i, &v, sizeof v);
  }
  for (; i < n; ++i)
    if (x[i] < kth_value) x[i] = -std::numeric_limits<float>::infinity();
}

// The rank-th largest logit of the far bucket (-inf when it holds fewer finite ones): a peaked
// row has fewer than k tokens within kNearNats of its top, and the rest of the vocabulary
// there. A min-heap of the rank largest seen so far; a vector with no lane above its smallest
// is passed over whole, so after the first few vectors a row costs one compare a vector.
inline float largest_far_value(const float* x, int64_t n, float maximum, int64_t rank, std::vector<float>& heap) {
  using pdserve_cpu::kLanes;
  using pdserve_cpu::Vec;
  using pdserve_cpu::VecI32;
  heap.clear();
  const auto consider = [&](float value) {
    if (static_cast<int64_t>(heap.size()) < rank) {
      heap.push_back(value);
      std::push_heap(heap.begin(), heap.end(), std::greater<float>());
    } else if (value > heap.front()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
      heap.back() = value;
      std::push_heap(heap.begin(), heap.end(), std::greater<float>());
    }
  };
  float smallest = -std::numeric_limits<float>::infinity();  // what a value must beat to enter
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = pdserve_cpu::load_vec(x + i);
    const VecI32 take = (buckets_of(v, maximum) == kFarBucket) & (v > smallest);
    const uint32_t take_bits = pdserve_cpu::lane_bits(take);
    if (take_bits == 0) continue;
    for (uint32_t bits = take_bits; bits != 0; bits &= bits - 1) consider(v[std::countr_zero(bits)]);
    if (static_cast<int64_t>(heap.size()) == rank) smallest = heap.front();
  }
  for (; i < n; ++i)
    if (bucket_of(x[i], maximum) == kFarBucket && x[i] > smallest) {
      consider(x[i]);
      if (static_cast<int64_t>(heap.size()) == rank) smallest = heap.front();
    }
  return static_cast<int64_t>(heap.size()) == rank ? heap.front() : -std::numeric_limits<float>::infinity();
}

// Keep the k largest logits of row x [n] and every one equal to the k-th; the others become
// -inf. Counted by the same buckets as top_p: only the bucket holding the k-th is searched.
inline void top_k_row(float* x, int64_t n, int64_t k, std::vector<float>& candidates) {
  using pdserve_cpu::kLanes;
  using pdserve_cpu::Vec;
  using pdserve_cpu::VecI32;
  if (k <= 0 || k >= n) return;
  const pdserve_cpu::ArgmaxPart top = pdserve_cpu::argmax_part(x, n);
  if (!has_distribution(top))
    return;
  const float maximum = top.value;
  int64_t count[kFarBucket + 1] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const VecI32 bucket = buckets_of(pdserve_cpu::load_vec(x + i), maximum);
    const VecI32 near = bucket < kFarBucket;
    const uint32_t near_bits = pdserve_cpu::lane_bits(near);
    count[kFarBucket] += kLanes - std::popcount(near_bits);
    for (uint32_t bits = near_bits; bits != 0; bits &= bits - 1) ++count[bucket[std::countr_zero(bits)]];
  }
  for (; i < n; ++i) ++count[bucket_of(x[i], maximum)];
  int64_t num_above = 0;  // tokens in the buckets before `crossing`
  int32_t crossing = 0;
  while (crossing < kFarBucket && num_above + count[crossing] < k) num_above += count[crossing++];
  if (crossing == kFarBucket && k - num_above <= kMaxFarRank) {
    apply_threshold(x, n, largest_far_value(x, n, maximum, k - num_above, candidates));
    return;
  }
  candidates.clear();
  for (i = 0; i + kLanes <= n; i += kLanes) {
    const Vec v = pdserve_cpu::load_vec(x + i);
    const VecI32 in_crossing = buckets_of(v, maximum) == crossing;
    for (uint32_t bits = pdserve_cpu::lane_bits(in_crossing); bits != 0; bits &= bits - 1)
      candidates.push_back(v[std::countr_zero(bits)]);
  }
  for (; i < n; ++i)
    if (bucket_of(x[i], maximum) == crossing) candidates.push_back(x[i]);
  // The k-th largest of the row is the (k - num_above)-th largest of its bucket.
  const auto kth = candidates.begin() + (k - num_above - 1);
  std::nth_element(candidates.begin(), kth, candidates.end(), std::greater<float>());
  apply_threshold(x, n, *kth);
}

// Every logit of x [n] below the maximum + log(min_p) becomes -inf: the tokens less likely
// than min_p times the most likely one. min_p <= 0 leaves the row whole.
inline void min_p_row(float* x, int64_t n, float min_p) {
  if (!(min_p > 0.f) || n == 0) return;
  const pdserve_cpu::ArgmaxPart top = pdserve_cpu::argmax_part(x, n);
  if (!has_distribution(top)) return;
  apply_threshold(x, n, top.value + std::log(min_p));
}

// One row's truncations: top_k <= 0 or >= the row's length, top_p >= 1 and min_p <= 0 leave
// it whole.
struct Truncation {
  int64_t top_k = -1;
  float top_p = 1.f;
  float min_p = 0.f;
};

// What the truncations reuse from row to row.
struct RowScratch {
  std::vector<float> candidates;
  std::vector<int32_t> buckets;
};

// The token drawn at u in [0, 1) from row x [n] (temperature applied), truncated in place in
// the sampler's order: top_k, top_p, min_p, then the draw.
inline int64_t sample_row(float* x, int64_t n, const Truncation& truncation, double u, RowScratch& scratch) {
  top_k_row(x, n, truncation.top_k, scratch.candidates);
  top_p_row(x, n, truncation.top_p, scratch.buckets);
  min_p_row(x, n, truncation.min_p);
  return draw_row(x, n, u);
}

// The k most likely tokens of row x [n] (k <= n), most likely first, equal logits by column:
// their columns to ids [k], their logits to values [k]. NaN ranks below every number. A
// min-heap of the k best seen so far; once it is full, a vector with no lane above its worst is
// passed over whole, so past the first vectors a row costs about one compare a vector.
inline void top_tokens(const float* x, int64_t n, int64_t k, int64_t* ids, float* values,
                       std::vector<std::pair<float, int64_t>>& heap) {
  using pdserve_cpu::kLanes;
  using pdserve_cpu::Vec;
  using pdserve_cpu::VecI32;
  if (k <= 0) return;
  // a ranks above b: the larger logit, or the same one at a lower column
  const auto ranks_above = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  heap.clear();
  // Columns come in rising order, so a value equal to the worst kept ranks below it: only a
  // larger one enters a full heap. NaN first takes -inf's place, then any number displaces it.
  const auto consider = [&](float value, int64_t column) {
    if (std::isnan(value)) value = -std::numeric_limits<float>::infinity();
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.emplace_back(value, column);
      std::push_heap(heap.begin(), heap.end(), ranks_above);
    } else if (value > heap.front().first) {
      std::pop_heap(heap.begin(), heap.end(), ranks_above);
      heap.back() = {value, column};
      std::push_heap(heap.begin(), heap.end(), ranks_above);
    }
  };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = pdserve_cpu::load_vec(x + i);
    if (static_cast<int64_t>(heap.size()) == k) {
      const VecI32 above = v > heap.front().first;
      uint32_t bits = pdserve_cpu::lane_bits(above);
      for (; bits != 0; bits &= bits - 1) {
        const int lane = std::countr_zero(bits);
        consider(v[lane], i + lane);
      }
    } else {
      for (int lane = 0; lane < kLanes; ++lane) consider(v[lane], i + lane);
    }
  }
  for (; i < n; ++i) consider(x[i], i);
  std::sort_heap(heap.begin(), heap.end(), ranks_above);  // ascending by ranks_above: best first
  for (int64_t j = 0; j < k; ++j) {
    values[j] = heap[j].first;
    ids[j] = heap[j].second;
  }
}

// The sampler's logprobs of row x [n] (the logits as fp32, before temperature and truncation):
// log_softmax(x) at token to token_logprob, and its top k (k <= n) to top_ids [k] and
// top_logprobs [k] (top_tokens' order). A row with no distribution (NaN, +inf, every value
// -inf) gets NaN logprobs, as torch's log_softmax gives such rows.
inline void row_logprobs(const float* x, int64_t n, int64_t token, int64_t k, float* token_logprob, int64_t* top_ids,
                         float* top_logprobs, std::vector<std::pair<float, int64_t>>& heap) {
  top_tokens(x, n, k, top_ids, top_logprobs, heap);
  const pdserve_cpu::ArgmaxPart top = pdserve_cpu::argmax_part(x, n);
  if (!has_distribution(top)) {
    *token_logprob = std::numeric_limits<float>::quiet_NaN();
    std::fill(top_logprobs, top_logprobs + k, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  // the log-softmax's normalizer past the maximum, the weights summed as draw_row sums them
  const float maximum = top.value, log_sum = static_cast<float>(std::log(sum_weights(x, n, maximum)));
  // torch's order: the shift by the maximum first, then the normalizer, each rounded to fp32
  *token_logprob = (x[token] - maximum) - log_sum;
  for (int64_t j = 0; j < k; ++j) top_logprobs[j] = (top_logprobs[j] - maximum) - log_sum;
}

// What one row's tokens so far do to its logits, as the sampler applies it: vLLM's penalties
// (repetition over the prompt's and the output's tokens, a positive logit divided by it, a
// negative one multiplied; then frequency, once per occurrence in the output; presence, once
// per distinct output token), then its stop tokens held back (-inf) while it has fewer
// tokens than min_tokens. take() counts a token the row just took, for the next step of the
// same call.
class RowHistory {
 public:
  RowHistory() = default;
  // prompt_ids [num_prompt] (read only where repetition != 1), output_ids [num_output] and
  // held_back_ids [num_held_back] (its stop tokens: -inf for the next held_back_steps steps),
  // each in [0, vocab_size).
  RowHistory(float repetition, float frequency, float presence, const int64_t* prompt_ids, int64_t num_prompt,
             const int64_t* output_ids, int64_t num_output, const int64_t* held_back_ids, int64_t num_held_back,
             int64_t held_back_steps, int64_t vocab_size)
      : repetition_(repetition), frequency_(frequency), presence_(presence),
        held_back_ids_(held_back_ids, held_back_ids + num_held_back),
        held_back_steps_(num_held_back > 0 ? std::max<int64_t>(held_back_steps, 0) : 0) {
    if (repetition_ != 1.f) {
      seen_bits_.assign((vocab_size + 63) / 64, 0);
      for (int64_t i = 0; i < num_prompt; ++i) see(prompt_ids[i]);
    }
    for (int64_t i = 0; i < num_output; ++i) count(output_ids[i]);
  }

  bool any() const { return repetition_ != 1.f || frequency_ != 0.f || presence_ != 0.f || held_back_steps_ > 0; }

  void take(int64_t token) {
    count(token);
    if (held_back_steps_ > 0) --held_back_steps_;
  }

  // x [vocab_size] fp32, in place; the sampler's fp32 arithmetic in its order, so the same bits.
  void apply(float* x) const {
    if (repetition_ != 1.f)
      for (int64_t token : seen_) x[token] = x[token] > 0.f ? x[token] / repetition_ : x[token] * repetition_;
    if (frequency_ != 0.f)
      for (int64_t token : output_order_)
        for (int32_t c = output_counts_.at(token); c > 0; --c) x[token] += -frequency_;  // one add an occurrence
    if (presence_ != 0.f)
      for (int64_t token : output_order_) x[token] -= presence_;
    if (held_back_steps_ > 0)
      for (int64_t token : held_back_ids_) x[token] = -std::numeric_limits<float>::infinity();
  }

 private:
  void count(int64_t token) {
    if (frequency_ != 0.f || presence_ != 0.f) {
      auto [entry, added] = output_counts_.try_emplace(token, 0);
      if (added) output_order_.push_back(token);
      ++entry->second;
    }
    if (repetition_ != 1.f) see(token);
  }

  void see(int64_t token) {
    uint64_t& word = seen_bits_[token / 64];
    const uint64_t bit = uint64_t{1} << (token % 64);
    if (word & bit) return;
    word |= bit;
    seen_.push_back(token);
  }

  float repetition_ = 1.f, frequency_ = 0.f, presence_ = 0.f;
  std::vector<uint64_t> seen_bits_;  // prompt and output tokens, repetition != 1 only
  std::vector<int64_t> seen_;        // the same, each once
  std::unordered_map<int64_t, int32_t> output_counts_;  // frequency or presence only
  std::vector<int64_t> output_order_;                   // output_counts_' keys, each once
  std::vector<int64_t> held_back_ids_;
  int64_t held_back_steps_ = 0;  // steps left whose draws hold back held_back_ids_
};

}  // namespace pdserve_cpu::sampling

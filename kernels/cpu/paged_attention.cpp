// Paged attention on CPU that reads K/V in place from the block-table cache.
//
// One op serves decode and ragged prefill (decode is prefill with one query per
// sequence): query row j of sequence i sits at position context_len + j and sees the
// keys (position - sliding_window, position] clipped to [0, position]. Each work item
// is (sequence, kv head, tile of query tokens): its query heads share every K/V row
// it loads, and an online softmax (flash style) runs over the cache blocks, so
// nothing is gathered and the scores never exceed one block per query row.
// Math is fp32 whatever the cache dtype (with AVX512-BF16, bf16 query . key products are
// exact and summed in fp32: attention_bf16.h). Bad arguments raise ValueError, as the
// torch path does.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

// The head dims whose loops are unrolled at compile time; any other runs the generic loops
// (head_dim a runtime value), which compute the same function. All three unless the build
// names its own (-DPDSERVE_ATTENTION_HEAD_DIMS_NAMED -DPDSERVE_ATTENTION_HD64 ...: the
// engine builds the ones of the models it serves, kernels/cpu_attention.py): each costs ~10 s
// of one core's g++, a cold start's wait for this library.
#ifndef PDSERVE_ATTENTION_HEAD_DIMS_NAMED
#define PDSERVE_ATTENTION_HD64
#define PDSERVE_ATTENTION_HD128
#define PDSERVE_ATTENTION_HD256
#endif
// Likewise the (query, cache) dtype pairs: fp32 and bf16 queries over their own dtype
// (F32, BF16) or fp8 codes (F32_FP8, BF16_FP8), fp16 over fp16 (F16). A call of a pair the
// build lacks raises; the Python callers send it to the torch path instead
// (kernels/cpu_attention.py: native_attention_serves).
#ifndef PDSERVE_ATTENTION_DTYPES_NAMED
#define PDSERVE_ATTENTION_F32
#define PDSERVE_ATTENTION_F32_FP8
#define PDSERVE_ATTENTION_BF16
#define PDSERVE_ATTENTION_BF16_FP8
#define PDSERVE_ATTENTION_F16
#endif

#include "attention_amx.h"
#include "attention_bf16.h"
#include "attention_blocks.h"
#include "attention_team.h"
#include "check_message.h"
#include "fp8.h"
#include "stream_prefetch.h"
#include "vec_math.h"

namespace {

// f(std::integral_constant<int64_t, HD>{}) where head_dim is one this build unrolls; false,
// f not called, for any other head dim.
template <typename F>
bool with_unrolled_head_dim(int64_t head_dim, F&& f) {
  switch (head_dim) {
#ifdef PDSERVE_ATTENTION_HD64
    case 64: f(std::integral_constant<int64_t, 64>{}); return true;
#endif
#ifdef PDSERVE_ATTENTION_HD128
    case 128: f(std::integral_constant<int64_t, 128>{}); return true;
#endif
#ifdef PDSERVE_ATTENTION_HD256
    case 256: f(std::integral_constant<int64_t, 256>{}); return true;
#endif
    default: return false;
  }
}

using namespace pdserve_cpu;

constexpr int64_t kQueryTile = 16;  // query tokens per work item in prefill chunks
constexpr int64_t kTransposeMinRows = 8;  // rows from which transposing a K block pays
// Blocks lie anywhere in the cache, so no hardware prefetcher sees the next one coming;
// a thread asks for its head's rows of the block this many ahead in its stream of blocks
// (BlockStream), into L2: the L1 has too few miss buffers for a whole block's lines, and
// the requests stall. Measured at batch 32: 2 ahead into L2 ~1.4x faster than 1 into L1.
constexpr int64_t kPrefetchBlocks = 2;
// Decode tokens are split over their keys (flash-decoding) only while a call has fewer
// than kWorkPerThread (sequence, kv head) items per thread, and never into parts
// shorter than kMinSplitKeys keys. One sequence of SmolLM2 (3 kv heads) on 2 threads, one
// layer, KV from DRAM, Zen 5: unsplit, one thread takes two heads, the other one; split in
// two from 256 keys (was 512), 256 / 320 / 384 keys 7.5 / 8.9 / 10.4 -> 6.7 / 7.7 / 8.8 us.
constexpr int64_t kWorkPerThread = 2;
constexpr int64_t kMinSplitKeys = 128;

}  // namespace

// The types a call's plan is made of, and claim_work, have external linkage: a second
// translation unit instantiates claim_work for some dtype pairs (PDSERVE_BUILD_PART, below).
namespace pdserve_attention {

struct WorkItem {
  int64_t seq;
  int64_t first_token;     // index into q
  int64_t num_tokens;
  int64_t first_position;  // position of first_token in its sequence
  // A part of a split decode token: keys [key_begin, key_end) only, and the unnormalised
  // result goes to partial slot `partial` (x num_kv_heads + kv head) instead of out.
  int64_t key_begin = 0;
  int64_t key_end = std::numeric_limits<int64_t>::max();
  int64_t partial = -1;
};

struct SplitToken {  // a decode token whose keys went to num_parts consecutive partial slots
  int64_t token, first_partial, num_parts;
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
  int64_t block_table_stride, num_blocks, block_size, num_kv_heads, group, head_dim, sliding_window;
  float scale, logit_softcap;
  float* partials;  // [num_partials, num_kv_heads, group, head_dim + 2]: acc, then max and sum
  // Keys paired once for the whole-rows form (pair_prompt_keys), per sequence: the word
  // offset of its pairs in paired_kv, or -1 where it has none.
  const uint32_t* paired_kv = nullptr;
  const int64_t* paired_offsets = nullptr;
  // Keys transposed and values laid in one run once for the fp32 whole-rows form
  // (transpose_prompt_keys), per sequence and kv head: the float offsets of its spans' K^T and
  // of its values in `prepared`, or -1 where it has none.
  const float* prepared = nullptr;
  const int64_t* keys_t_offsets = nullptr;
  const int64_t* values_offsets = nullptr;
};

}  // namespace pdserve_attention

using pdserve_attention::Problem;
using pdserve_attention::SplitToken;
using pdserve_attention::WorkItem;

namespace {

// Rows [0, num_rows) in groups of kGroup rows, then the rest (fewer than kGroup) as one
// group, so each call's row count R is a compile-time constant: fn.template operator()<R>(r).
template <int64_t kGroup, typename Fn>
inline void for_fixed_groups(int64_t num_rows, Fn&& fn) {
  static_assert(kGroup >= 1 && kGroup <= 6);
  int64_t r = 0;
  for (; r + kGroup <= num_rows; r += kGroup) fn.template operator()<kGroup>(r);
  switch (num_rows - r) {
    case 5: if constexpr (kGroup > 5) fn.template operator()<5>(r); break;
    case 4: if constexpr (kGroup > 4) fn.template operator()<4>(r); break;
    case 3: if constexpr (kGroup > 3) fn.template operator()<3>(r); break;
    case 2: if constexpr (kGroup > 2) fn.template operator()<2>(r); break;
    case 1: fn.template operator()<1>(r); break;
    default: break;
  }
}

// The same, each group called only where its rows see any key of the block: fn.template
// operator()<R>(r, begin, end), [begin, end) the union of its rows' keys (row_begin /
// row_end, relative to the block).
template <int64_t kGroup, typename Fn>
inline void for_row_groups(int64_t num_rows, const int64_t* row_begin, const int64_t* row_end, Fn&& fn) {
  for_fixed_groups<kGroup>(num_rows, [&]<int64_t R>(int64_t r) {
    const int64_t begin = *std::min_element(row_begin + r, row_begin + r + R);
    const int64_t end = *std::max_element(row_end + r, row_end + r + R);
    if (begin < end) fn.template operator()<R>(r, begin, end);
  });
}

// The token at position p sees keys [first_visible_key(p), p].
inline int64_t first_visible_key(const Problem& pr, int64_t p) {
  return pr.sliding_window > 0 ? std::max<int64_t>(0, p - pr.sliding_window + 1) : 0;
}

// A whole-rows item's row at `position` over its scores s, num_keys columns (column c: key
// base + c) of the keys [lo, hi): the keys it sees, [begin, end) in columns (set here),
// soft-capped where the model caps, and its softmax numerators over every column against
// max(running_max, their maximum), each Vec handed to store(j, p), zeros outside [begin, end).
// Returns their sums per lane; running_max becomes the new maximum, and rescale the factor
// the row's sums and accumulators from earlier keys take to be against it (1 where it held).
// Both whole-rows forms' softmax: over all of an item's keys at once, or a chunk at a time.
//
// score_scale: what the scores are yet to be multiplied by (1 where they are scaled), taken
// into the exps' argument (a positive scale keeps the maximum's key). running_max is scaled.
template <typename Exp, typename Store>
inline Vec whole_row_probabilities(const Problem& pr, int64_t position, int64_t lo, int64_t hi, int64_t base, float* s,
                                   int64_t num_keys, float score_scale, int64_t& begin, int64_t& end,
                                   float& running_max, float& rescale, Store&& store) {
  begin = std::max(first_visible_key(pr, position), lo) - base;
  end = std::min(position + 1, hi) - base;
  rescale = 1.f;
  if (begin >= end) {
    for (int64_t j = 0; j < num_keys; j += kLanes) store(j, Vec{});
    return Vec{};
  }
  if (pr.logit_softcap > 0.f) {
    for (int64_t j = begin; j < end; ++j) s[j] = std::tanh(s[j] * score_scale / pr.logit_softcap) * pr.logit_softcap;
    score_scale = 1.f;
  }
  const float max = row_block_max(s, begin, end, begin, end) * score_scale;
  if (max > running_max) {
    rescale = running_max == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(running_max - max);
    running_max = max;
  }
  return row_probabilities<Exp>(s, 0, num_keys, begin, end, running_max, score_scale, store);
}

// The same over all of the row's keys at once, their scores scaled.
template <typename Exp, typename Store>
inline Vec whole_row_probabilities(const Problem& pr, int64_t position, int64_t lo, int64_t hi, int64_t base, float* s,
                                   int64_t num_keys, int64_t& begin, int64_t& end, Store&& store) {
  float running_max = -std::numeric_limits<float>::infinity(), rescale;
  return whole_row_probabilities<Exp>(pr, position, lo, hi, base, s, num_keys, 1.f, begin, end, running_max, rescale,
                                      store);
}

// The keys [lo, hi) some row of the item sees.
inline std::pair<int64_t, int64_t> item_keys(const Problem& pr, const WorkItem& item) {
  return {std::max(first_visible_key(pr, item.first_position), item.key_begin),
          std::min(item.first_position + item.num_tokens, item.key_end)};
}

// One thread's blocks, item after item, read as one stream: each block asks for the one
// kPrefetchBlocks ahead, past the end of its item into the item the thread takes next, so
// a new item's first blocks are on their way before it starts (decode at batch 64 and
// context 200, KV from DRAM: ~10% faster than each item fetching its own first blocks).
struct BlockStream {
  const WorkItem* upcoming = nullptr;  // the thread's next item (claimed before this one starts), or none
  int64_t upcoming_head = 0;
  bool primed = false;  // the previous item asked for this item's first kPrefetchBlocks blocks
};

// Cache block b of sequence seq, checked against the cache's size.
inline int64_t checked_block_id(const Problem& pr, int64_t seq, int64_t b) {
  const int64_t block_id = pr.block_tables[seq * pr.block_table_stride + b];
  PDSERVE_CHECK_VALUE(block_id >= 0 && block_id < pr.num_blocks, "block table entry ", block_id, " of sequence ",
                      seq, " is outside the cache's ", pr.num_blocks, " blocks");
  return block_id;
}

// Cache block b of the item's sequence, checked against the cache's size.
inline int64_t item_block_id(const Problem& pr, const WorkItem& item, int64_t b) {
  return checked_block_id(pr, item.seq, b);
}

// Consecutive buffers of the given float counts in `scratch`, the first on a 4 KB boundary,
// each after it on a fresh 64-byte line.
class ScratchLayout {
 public:
  ScratchLayout(std::vector<float>& scratch, std::initializer_list<int64_t> num_floats) {
    constexpr int64_t kLine = 16, kPage = 1024;  // in floats
    int64_t offsets[kMaxBuffers], total = 0, count = 0;
    for (const int64_t n : num_floats) {
      offsets[count++] = total;
      total += (n + kLine - 1) / kLine * kLine;
    }
    if (scratch.size() < static_cast<size_t>(total + kPage)) scratch.resize(total + kPage);
    const auto address = reinterpret_cast<uintptr_t>(scratch.data());
    float* base = scratch.data() + (4096 - address % 4096) % 4096 / sizeof(float);
    for (int64_t i = 0; i < count; ++i) buffers_[i] = base + offsets[i];
  }
  float* operator[](int64_t i) const { return buffers_[i]; }

 private:
  static constexpr int64_t kMaxBuffers = 11;
  float* buffers_[kMaxBuffers];
};

inline bool is_fp8(at::ScalarType dtype) { return dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2; }

// What block_rows' rows of a C cache are short of their values by: scores take scale times it,
// outputs are multiplied by it (both exact: a power of two).
template <typename C>
constexpr float kCodeScale = [] {
  if constexpr (kIsFp8<C>)
    return kWidenedScale<C>;
  else
    return 1.f;
}();

// Rows [keys_begin, keys_end) of one head's cache block as T, and their stride: the cache's
// own rows where it holds T, else its fp8 codes widened into `buffer` (row j at j * head_dim),
// each value divided by kCodeScale<C> (fp8.h: E4M3's by 2^8), which the item's scale and
// output multiply back.
// Widened once per item and block, the rows serve every row of the item and every path
// below unchanged; the pass costs about what reading half the bytes saves (decode on the
// Zen 5 EPYC: docs/benchmarks.md, "8-bit KV cache").
template <typename T, typename C>
inline std::pair<const T*, int64_t> block_rows(const C* rows, int64_t pos_stride, int64_t keys_begin,
                                               int64_t keys_end, int64_t head_dim, T* buffer) {
  if constexpr (std::is_same_v<C, T>) {
    return {rows, pos_stride};
  } else {
    static_assert(kIsFp8<C>);
    for (int64_t j = keys_begin; j < keys_end; ++j)
      widen_fp8<C>(reinterpret_cast<const uint8_t*>(rows + j * pos_stride), buffer + j * head_dim, head_dim);
    return {buffer, head_dim};
  }
}

// A sequence whose whole-rows items read keys prepared once a call (pair_prompt_keys,
// transpose_prompt_keys).
struct PromptSequence {
  int64_t seq, seq_len;
};

// The call's sequences whose query tokens make several whole-rows items (prompts and their
// chunks) of at most max_scores scores, each kv head's keys laid out once in one buffer of
// units_per_head(seq_len) units a head: offsets[seq * num_kv_heads + head] its first unit,
// -1 for the other sequences, whose items prepare their own. Returns the units in all.
template <typename UnitsPerHead>
int64_t prompt_sequences(const Problem& pr, const int32_t* seq_lens, const int32_t* query_starts, int64_t num_seqs,
                         int64_t max_scores, UnitsPerHead&& units_per_head, std::vector<PromptSequence>& seqs,
                         std::vector<int64_t>& offsets) {
  offsets.assign(num_seqs * pr.num_kv_heads, -1);
  int64_t num_units = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t query_len = query_starts[i + 1] - query_starts[i], seq_len = seq_lens[i];
    const int64_t max_keys = (seq_len + pr.block_size - 1) / pr.block_size * pr.block_size;
    if (query_len <= kQueryTile || kQueryTile * pr.group * max_keys > max_scores) continue;
    seqs.push_back({i, seq_len});
    for (int64_t head = 0; head < pr.num_kv_heads; ++head) {
      offsets[i * pr.num_kv_heads + head] = num_units;
      num_units += units_per_head(seq_len);
    }
  }
  return num_units;
}

// fn(seq, seq_len, head, unit) for every unit of every kv head of the prompt sequences, split
// over the call's threads (units_of(seq_len) units a head: prompt_sequences' layouts).
template <typename UnitsOf, typename Fn>
void for_prompt_units(const Problem& pr, const std::vector<PromptSequence>& seqs, int64_t grain, UnitsOf&& units_of,
                      Fn&& fn) {
  std::vector<int64_t> first_task(seqs.size() + 1, 0);  // tasks: (sequence, kv head, unit)
  for (size_t i = 0; i < seqs.size(); ++i)
    first_task[i + 1] = first_task[i] + pr.num_kv_heads * units_of(seqs[i].seq_len);
  at::parallel_for(0, first_task.back(), grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
      const auto [seq, seq_len] = seqs[i];
      const int64_t num_units = units_of(seq_len);
      fn(seq, seq_len, (task - first_task[i]) / num_units, (task - first_task[i]) % num_units);
    }
  });
}

#ifdef PDSERVE_BF16_DOT
// Words of one 16-key group's pairs in pair_prompt_keys' layout: K's, then V's.
template <int64_t kHeadDim>
constexpr int64_t kPairedGroupWords = 2 * kBf16PairWords<kHeadDim>;

// Scores (rows x keys) an item holds at once in the whole-rows form below: a chunk of its
// keys at a time. On AMX tiles 48 rows (16 tokens of 3 query heads per KV head) by 2,048
// keys, whose scores, probabilities and V pairs then take ~0.8 MiB, within a core's L2 (as
// measured on the Xeon of model 207). On the vector dot products the form stays ahead of the
// block-by-block one far past the L2: one SmolLM2 layer on the Zen 5 EPYC, prompts of 3,072 /
// 4,096 / 8,192 / 16,384 tokens 22.3 / 42.0 / 170.7 / 694 ms -> 16.8 / 29.1 / 118.9 / 494 ms;
// 16,384 keys a chunk, whose buffers take ~4.7 MiB a thread.
constexpr int64_t kWholeRowsMaxScoresAmx = 48 * 2048;
constexpr int64_t kWholeRowsMaxScoresVector = 48 * 16384;
inline int64_t whole_rows_max_scores(bool amx) { return amx ? kWholeRowsMaxScoresAmx : kWholeRowsMaxScoresVector; }

// The most scores (kQueryTile rows a query head by keys) of the sequences whose keys a call
// pairs once (pair_prompts): 16,384 keys of SmolLM2 take 12 MiB of pairs.
constexpr int64_t kPairedMaxScores = kWholeRowsMaxScoresVector;

// An item's attention in three passes over a chunk of its keys at once (all of them where
// they fit whole_rows_max_scores): the chunk's scores, one softmax per row over all the keys
// of the chunk it sees, then P.V with each group of rows' accumulators held across every key
// of the chunk (in AMX tiles, or in vector registers: attention_bf16.h's
// whole_rows_accumulate_bf16). The block-by-block form pays per block and row for the
// online softmax (a maximum, a rescale of the row's accumulators) and loads and stores
// every accumulator after each block's 16 keys (AMX, a 1,902-token prefill step of SmolLM2,
// one layer: 2.74 -> 1.8 ms; a 1,024-token prompt's time to first token 0.41 -> 0.33 s, the
// Xeon of model 207); here a row pays that once a chunk. Fills acc [num_tile_rows, kHeadDim]
// and row_sums [num_rows, kLanes] (each row's denominator as sums per lane) for attend_item's
// last step.
//
// paired: the sequence's keys [0, seq_len) for this kv head as pair_prompt_keys lays them
// out, or null: then the item pairs its own keys, 16 at a time.
template <int64_t kHeadDim, bool kAmx, typename C>
void attend_whole_rows(const Problem& pr, const WorkItem& item, int64_t kv_head, const c10::BFloat16* q_bf16,
                       int64_t num_rows, int64_t lo, int64_t hi, float* acc, float* row_sums, const uint32_t* paired) {
  static_assert(kHeadDim % 64 == 0);
  constexpr int64_t kPairWords = kBf16PairWords<kHeadDim>;
  const int64_t block_size = pr.block_size, group = pr.group;
  const int64_t first_b = lo / block_size, last_b = (hi - 1) / block_size;
  const int64_t num_tile_rows = kAmx ? (num_rows + 15) / 16 * 16 : num_rows;
  const int64_t chunk_blocks = std::max<int64_t>(1, whole_rows_max_scores(kAmx) / (num_rows * block_size));
  const int64_t max_chunk_keys = std::min(last_b - first_b + 1, chunk_blocks) * block_size;
  // scores [num_tile_rows, chunk's keys] fp32 (AMX: unscaled); p [num_tile_rows, chunk's keys]: the probabilities
  // in bf16; v_pairs [chunk's keys / 16][kPairWords]: each 16 keys' V in pairs
  // (pair_value_rows); row_max [num_rows]: each row's maximum over the chunks so far. A
  // buffer of this thread's beside attend_item's scratch, whose buffers are in use.
  thread_local std::vector<float> buffer;
  const ScratchLayout layout(buffer, {num_tile_rows * max_chunk_keys, num_tile_rows * max_chunk_keys / 2,
                                      paired ? 0 : max_chunk_keys / 16 * kPairWords, num_rows});
  float* scores = layout[0];
  auto* p = reinterpret_cast<c10::BFloat16*>(layout[1]);
  auto* v_pairs = reinterpret_cast<uint32_t*>(layout[2]);
  float* row_max = layout[3];
  std::fill(row_max, row_max + num_rows, -std::numeric_limits<float>::infinity());
  alignas(64) uint32_t k_pairs[kPairWords];
  const C* k_head = static_cast<const C*>(pr.k) + kv_head * pr.k_head_stride;
  const C* v_head = static_cast<const C*>(pr.v) + kv_head * pr.v_head_stride;
  const float scale = pr.scale * kCodeScale<C>;
  // An fp8 cache's block widened (block_rows); empty for a bf16 one.
  thread_local std::vector<c10::BFloat16> widened;
  if constexpr (kIsFp8<C>) widened.resize(2 * block_size * kHeadDim);
  for (int64_t chunk_b = first_b; chunk_b <= last_b; chunk_b += chunk_blocks) {
    const bool first_chunk = chunk_b == first_b;
    const int64_t chunk_last_b = std::min(last_b, chunk_b + chunk_blocks - 1);
    const int64_t base = chunk_b * block_size;                        // the key of column 0
    const int64_t num_keys = (chunk_last_b + 1) * block_size - base;  // columns, a multiple of 16 (block_size is)
    const int64_t chunk_lo = std::max(lo, base), chunk_hi = std::min(hi, base + num_keys);
    // Column c's 16 keys in pairs: K's words, then V's (kPairedGroupWords apart).
    auto paired_keys = [&](int64_t column) { return paired + (base + column) / 16 * kPairedGroupWords<kHeadDim>; };
    auto scores_of = [&](const uint32_t* key_pairs, int64_t column) {
      if constexpr (kAmx) {
#ifdef PDSERVE_ATTENTION_AMX
        amx_block_raw_scores<kHeadDim>(q_bf16, num_rows, key_pairs, num_keys, scores + column);
#endif
      } else {
        paired_scores_bf16<kHeadDim>(q_bf16, num_rows, key_pairs, scale, num_keys, scores + column);
      }
    };
    if (paired != nullptr)
      for (int64_t column = 0; column < num_keys; column += 16) scores_of(paired_keys(column), column);
    for (int64_t b = chunk_b; b <= chunk_last_b && paired == nullptr; ++b) {
      const int64_t block_id = item_block_id(pr, item, b);
      const int64_t block_start = b * block_size;
      const int64_t keys_begin = std::max(lo, block_start) - block_start;
      const int64_t keys_end = std::min(hi, block_start + block_size) - block_start;
      const auto [k_block, k_pos_stride] = block_rows(k_head + block_id * pr.k_block_stride, pr.k_pos_stride,
                                                      keys_begin, keys_end, kHeadDim, widened.data());
      const auto [v_block, v_pos_stride] = block_rows(v_head + block_id * pr.v_block_stride, pr.v_pos_stride,
                                                      keys_begin, keys_end, kHeadDim,
                                                      widened.data() + block_size * kHeadDim);
      for (int64_t first = 0; first < block_size; first += 16) {
        const int64_t column = block_start - base + first;
        // Keys outside [keys_begin, keys_end) pair as zeros: a score of 0 (masked below) and a V
        // of 0, never whatever the cache holds there.
        pair_key_rows<kHeadDim>(k_block, k_pos_stride, first, keys_begin, keys_end, k_pairs);
        scores_of(k_pairs, column);
        pair_value_rows<kHeadDim>(v_block, v_pos_stride, first, keys_begin, keys_end,
                                  v_pairs + column / 16 * kPairWords);
      }
    }
    for (int64_t r = 0; r < num_tile_rows; ++r) {
      c10::BFloat16* p_row = p + r * num_keys;
      if (r >= num_rows) {
        std::fill(p_row, p_row + num_keys, c10::BFloat16(0.f));
        continue;
      }
      int64_t begin, end;
      float rescale;
      // The numerators straight to bf16 for P.V (their fp32 sums are the denominator).
      const Vec sum = whole_row_probabilities<ExpForBf16>(
          pr, item.first_position + r / group, chunk_lo, chunk_hi, base, scores + r * num_keys, num_keys,
          kAmx ? scale : 1.f, begin, end, row_max[r], rescale, [p_row](int64_t j, Vec probability) {
            _mm256_store_si256(reinterpret_cast<__m256i*>(p_row + j),
                               (__m256i)_mm512_cvtneps_pbh((__m512)probability));
          });
      if (first_chunk) {
        std::memcpy(row_sums + r * kLanes, &sum, sizeof sum);
      } else {
        // The row's earlier chunks were against a smaller maximum: their sums and P.V scale down.
        const Vec sums = load_vec(row_sums + r * kLanes) * rescale + sum;
        std::memcpy(row_sums + r * kLanes, &sums, sizeof sums);
        if (rescale != 1.f)
          for (int64_t d = 0; d < kHeadDim; ++d) acc[r * kHeadDim + d] *= rescale;
      }
    }
    // Where group g's V pairs lie, and the words from one group's to the next's.
    const uint32_t* v_groups = paired ? paired_keys(0) + kPairWords : v_pairs;
    const int64_t group_stride = paired ? kPairedGroupWords<kHeadDim> : kPairWords;
    if constexpr (!kAmx) {
      whole_rows_accumulate_bf16<kHeadDim>(acc, num_rows, p, num_keys, v_groups, group_stride, !first_chunk);
    } else {
#ifdef PDSERVE_ATTENTION_AMX
      constexpr int64_t kChunks = kHeadDim / 16;  // accumulator tiles per row tile, four at a time
      constexpr int64_t kAccStride = kHeadDim * sizeof(float), kPairStride = kChunks * 16 * sizeof(uint32_t);
      for (int64_t r0 = 0; r0 < num_tile_rows; r0 += 16)
        for (int64_t c = 0; c < kChunks; c += 4) {
          // Four accumulators (tiles 0, 1, 2 and 5: the scores' and query's tiles are free now),
          // so four multiplies are in flight, not one waiting on the last.
          float* acc_tile = acc + r0 * kHeadDim + c * 16;
          if (first_chunk) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(5);
          } else {
            _tile_loadd(0, acc_tile, kAccStride);
            _tile_loadd(1, acc_tile + 16, kAccStride);
            _tile_loadd(2, acc_tile + 32, kAccStride);
            _tile_loadd(5, acc_tile + 48, kAccStride);
          }
          for (int64_t g = 0; g < num_keys / 16; ++g) {
            const uint32_t* pairs = v_groups + g * group_stride + c * 16;
            _tile_loadd(3, p + r0 * num_keys + g * 16, num_keys * sizeof(c10::BFloat16));
            _tile_loadd(4, pairs, kPairStride);
            _tile_dpbf16ps(0, 3, 4);
            _tile_loadd(4, pairs + 16, kPairStride);
            _tile_dpbf16ps(1, 3, 4);
            _tile_loadd(4, pairs + 32, kPairStride);
            _tile_dpbf16ps(2, 3, 4);
            _tile_loadd(4, pairs + 48, kPairStride);
            _tile_dpbf16ps(5, 3, 4);
          }
          _tile_stored(0, acc_tile, kAccStride);
          _tile_stored(1, acc_tile + 16, kAccStride);
          _tile_stored(2, acc_tile + 32, kAccStride);
          _tile_stored(5, acc_tile + 48, kAccStride);
        }
#endif
    }
  }
}

// Groups of 16 keys paired for a sequence: its blocks' keys, whole (the whole-rows form
// reads every key of each block it touches).
inline int64_t num_paired_groups(const Problem& pr, int64_t seq_len) {
  return (seq_len + pr.block_size - 1) / pr.block_size * pr.block_size / 16;
}

// Every 16 keys of each sequence's blocks, per kv head, in pairs for the whole-rows
// form, once a call: each of a prompt's items (one per 16 query tokens) would otherwise pair
// again every key it sees (a 1,024-token prompt: each key ~32 times, ~20% of its attention).
// Keys past seq_len pair as zeros (their slots may hold anything); every key before it has
// been written, so the finite K and V of a key a row does not see, masked to p = 0, add
// nothing. offsets[seq * num_kv_heads + head]: where in out (64-byte aligned) that
// sequence's head starts, kPairedGroupWords a group of 16 keys.
template <int64_t kHeadDim, typename C>
void pair_prompt_keys(const Problem& pr, const std::vector<PromptSequence>& seqs, const int64_t* offsets,
                      uint32_t* out) {
  auto num_groups = [&](int64_t seq_len) { return num_paired_groups(pr, seq_len); };
  for_prompt_units(pr, seqs, 16, num_groups, [&](int64_t seq, int64_t seq_len, int64_t head, int64_t group_index) {
    const int64_t key = group_index * 16;
    const int64_t b = key / pr.block_size, block_start = b * pr.block_size;
    const int64_t block_id = item_block_id(pr, WorkItem{seq, 0, 0, 0}, b);
    const int64_t keys_end = std::min(seq_len - block_start, pr.block_size);  // zeros past the sequence
    const int64_t first = key - block_start, last = std::min(first + 16, keys_end);
    thread_local std::vector<c10::BFloat16> widened;  // an fp8 cache's rows (block_rows)
    if constexpr (kIsFp8<C>) widened.resize(2 * pr.block_size * kHeadDim);
    const auto [k_block, k_pos_stride] =
        block_rows(static_cast<const C*>(pr.k) + head * pr.k_head_stride + block_id * pr.k_block_stride,
                   pr.k_pos_stride, first, last, kHeadDim, widened.data());
    const auto [v_block, v_pos_stride] =
        block_rows(static_cast<const C*>(pr.v) + head * pr.v_head_stride + block_id * pr.v_block_stride,
                   pr.v_pos_stride, first, last, kHeadDim, widened.data() + pr.block_size * kHeadDim);
    uint32_t* group = out + offsets[seq * pr.num_kv_heads + head] + key / 16 * kPairedGroupWords<kHeadDim>;
    pair_key_rows<kHeadDim>(k_block, k_pos_stride, first, 0, keys_end, group);
    pair_value_rows<kHeadDim>(v_block, v_pos_stride, first, 0, keys_end,
                              group + kBf16PairWords<kHeadDim>);
  });
}
#endif

// Spans (kSpanKeys keys, span_keys_transposed's K^T) over a sequence's blocks, whole: as many
// as the columns of its items' scores from key 0 (attend_whole_rows_fp32).
inline int64_t num_key_spans(const Problem& pr, int64_t seq_len) {
  const int64_t num_keys = (seq_len + pr.block_size - 1) / pr.block_size * pr.block_size;
  return (num_keys + kSpanKeys - 1) / kSpanKeys;
}

// Every span of each sequence's keys, per kv head, transposed once a call for the fp32
// whole-rows form, and the span's values copied into one run of rows: each of a prompt's items
// (one per 16 query tokens) would otherwise transpose again every key it sees (a 4,096-token
// prompt: each key ~128 times), and its P.V would read each key's V row where the cache keeps
// it, kv heads interleaved and blocks anywhere, which the prefetchers do not follow. Keys past
// seq_len are zeros. keys_t_offsets / values_offsets[seq * num_kv_heads + head]: where in out
// that sequence's head has its spans' K^T (kHeadDim * kSpanKeys floats a span) and its values
// [num_spans * kSpanKeys, kHeadDim], each on a 64-byte line.
template <int64_t kHeadDim>
void transpose_prompt_keys(const Problem& pr, const std::vector<PromptSequence>& seqs, const int64_t* keys_t_offsets,
                           const int64_t* values_offsets, float* out) {
  auto num_spans_of = [&](int64_t seq_len) { return num_key_spans(pr, seq_len); };
  for_prompt_units(pr, seqs, 4, num_spans_of, [&](int64_t seq, int64_t seq_len, int64_t head, int64_t span) {
    const float* k_head = static_cast<const float*>(pr.k) + head * pr.k_head_stride;
    const float* v_head = static_cast<const float*>(pr.v) + head * pr.v_head_stride;
    const int64_t last_b = (seq_len - 1) / pr.block_size;
    auto block_id = [&](int64_t b) { return item_block_id(pr, WorkItem{seq, 0, 0, 0}, b); };
    auto block_k_rows = [&](int64_t b) -> const float* {
      return b <= last_b ? k_head + block_id(b) * pr.k_block_stride : nullptr;
    };
    span_keys_transposed<kHeadDim>(block_k_rows, pr.k_pos_stride, pr.block_size, span * kSpanKeys, 0, seq_len,
                                   out + keys_t_offsets[seq * pr.num_kv_heads + head] + span * kHeadDim * kSpanKeys);
    float* values = out + values_offsets[seq * pr.num_kv_heads + head] + span * kSpanKeys * kHeadDim;
    for (int64_t key = span * kSpanKeys; key < (span + 1) * kSpanKeys; ++key, values += kHeadDim) {
      if (key < seq_len) {
        const int64_t b = key / pr.block_size;
        std::memcpy(values, v_head + block_id(b) * pr.v_block_stride + (key - b * pr.block_size) * pr.v_pos_stride,
                    kHeadDim * sizeof(float));
      } else {
        std::fill(values, values + kHeadDim, 0.f);
      }
    }
  });
}

// An fp32 item's rows against all their keys at once, as attend_whole_rows does for bf16:
// every key's scores (a span of K^T at a time, span_scores), one softmax per row over all the
// keys it sees, then P.V with each group of rows' accumulators held in registers across
// every block (whole_rows_accumulate), where the block-by-block form rescales and reloads
// them per block. One SmolLM2 layer's attention over a prompt of 512 / 1,024 / 2,048 /
// 4,096 / 8,192 tokens, 2 threads of the Zen 4 EPYC, medians: 2.7-3.1 / 10.3-10.7 / 39.5 /
// 156 / 587 ms -> 1.9-2.0 / 7.5 / 28.1-28.5 / 110-118 / 503 ms (scores capped at 48 x 4,096
// there: 592). Then (the Zen 5 EPYC, 1,024 / 4,096 tokens) K^T in spans, each prompt's keys
// transposed and values laid in one run once a call (transpose_prompt_keys) and the P.V in
// ranges of keys: 3.64 / 61.2 -> 3.28 / 47.7 ms; built for AVX2 there, 7.1 / 116 -> 6.3 / 97 ms.
// Scores of rows x keys up to kWholeRowsMaxScoresFp32 (3 MiB a thread, as the bf16 vector
// form's). Fills acc [num_rows, kHeadDim] and row_sums [num_rows, kLanes] for attend_item's
// last step. An fp32 cache only.
constexpr int64_t kWholeRowsMaxScoresFp32 = 48 * 16384;

// Both fp32 whole-rows forms' softmax: each row's scores [num_rows, stride] (column c: key
// base + c) become its numerators in place over every column from 0, p = 0 outside the row's
// keys whatever their scores hold (a block's keys before lo are not scored); fills row_sums
// [num_rows, kLanes] and each row's keys [row_begin, row_end) in columns.
inline void whole_rows_softmax_fp32(const Problem& pr, const WorkItem& item, int64_t num_rows, int64_t lo,
                                    int64_t hi, int64_t base, float* scores, int64_t stride, float* row_sums,
                                    int64_t* row_begin, int64_t* row_end) {
  for (int64_t r = 0; r < num_rows; ++r) {
    float* s = scores + r * stride;
    const Vec sum = whole_row_probabilities<ExpFp32>(pr, item.first_position + r / pr.group, lo, hi, base, s, stride,
                                                     row_begin[r], row_end[r],
                                                     [s](int64_t j, Vec p) { std::memcpy(s + j, &p, sizeof p); });
    std::memcpy(row_sums + r * kLanes, &sum, sizeof sum);
  }
}

template <int64_t kHeadDim>
void attend_whole_rows_fp32(const Problem& pr, const WorkItem& item, int64_t kv_head, const float* q_rows,
                            int64_t num_rows, int64_t lo, int64_t hi, float* acc, float* row_sums,
                            int64_t* row_begin, int64_t* row_end) {
  constexpr int64_t kNumVec = kHeadDim / kLanes;
  const int64_t block_size = pr.block_size;
  const int64_t first_b = lo / block_size, last_b = (hi - 1) / block_size;
  const int64_t base = first_b * block_size;  // the key of column 0
  // Columns: whole spans of keys (span_scores' width) over the item's whole blocks; those
  // past the last block score zeros, which the softmax leaves out with every key outside a row's.
  const int64_t score_stride = ((last_b + 1) * block_size - base + kSpanKeys - 1) / kSpanKeys * kSpanKeys;
  // scores [num_rows, score_stride], then the probabilities; k_t [kHeadDim, kSpanKeys]: one
  // span's K^T. A buffer of this thread's beside attend_item's scratch, whose buffers are in use.
  thread_local std::vector<float> buffer;
  thread_local std::vector<const float*> k_blocks, v_blocks;  // [last_b - first_b + 1]: each block's first row
  const ScratchLayout layout(buffer, {num_rows * score_stride, kHeadDim * kSpanKeys});
  float* scores = layout[0];
  float* k_t = layout[1];
  k_blocks.resize(last_b - first_b + 1);
  v_blocks.resize(last_b - first_b + 1);
  // The sequence's spans transposed and values laid out once this call (transpose_prompts),
  // where this item's columns start on a span; keys they hold outside [lo, hi) score, and the
  // softmax leaves them out. Else the cache's own rows, K transposed a span at a time here.
  const int64_t head_index = item.seq * pr.num_kv_heads + kv_head;
  const bool prepared = pr.keys_t_offsets != nullptr && pr.keys_t_offsets[head_index] >= 0 && base % kSpanKeys == 0;
  const float* spans_t = nullptr;  // the item's first span's K^T, then the next ones'
  int64_t v_pos_stride = pr.v_pos_stride;
  if (prepared) {
    spans_t = pr.prepared + pr.keys_t_offsets[head_index] + base / kSpanKeys * kHeadDim * kSpanKeys;
    const float* values = pr.prepared + pr.values_offsets[head_index];  // [num_spans * kSpanKeys, kHeadDim]
    for (int64_t b = first_b; b <= last_b; ++b) v_blocks[b - first_b] = values + b * block_size * kHeadDim;
    v_pos_stride = kHeadDim;
  } else {
    const float* k_head = static_cast<const float*>(pr.k) + kv_head * pr.k_head_stride;
    const float* v_head = static_cast<const float*>(pr.v) + kv_head * pr.v_head_stride;
    for (int64_t b = first_b; b <= last_b; ++b) {
      const int64_t block_id = item_block_id(pr, item, b);
      k_blocks[b - first_b] = k_head + block_id * pr.k_block_stride;
      v_blocks[b - first_b] = v_head + block_id * pr.v_block_stride;
    }
  }
  auto block_k_rows = [&](int64_t b) { return b <= last_b ? k_blocks[b - first_b] : nullptr; };
  for (int64_t column = 0; column < score_stride; column += kSpanKeys) {
    const float* span_t = k_t;
    if (prepared)
      span_t = spans_t + column * kHeadDim;
    else
      span_keys_transposed<kHeadDim>(block_k_rows, pr.k_pos_stride, block_size, base + column, lo, hi, k_t);
    for_fixed_groups<kSpanRows>(num_rows, [&]<int64_t R>(int64_t r) {
      span_scores<kHeadDim, R>(q_rows + r * kHeadDim, span_t, scores + r * score_stride + column, score_stride);
    });
  }
  whole_rows_softmax_fp32(pr, item, num_rows, lo, hi, base, scores, score_stride, row_sums, row_begin, row_end);
  // P.V a range of keys at a time, every group of rows over it before the next: its V rows
  // (128 KB) then stay in L2 for the groups after the first, where each group's pass over all
  // the item's keys (a 4,096-token prompt: 1 MB of V) read them from L3 again. acc starts at
  // zero (attend_item) and each range adds to it.
  constexpr int64_t kPvKeys = 32768 / kHeadDim;
  for (int64_t keys_begin = 0; keys_begin < score_stride; keys_begin += kPvKeys) {
    const int64_t keys_end = std::min(keys_begin + kPvKeys, score_stride);
    for_row_groups<kAccumRows>(num_rows, row_begin, row_end, [&]<int64_t R>(int64_t r, int64_t begin, int64_t end) {
      begin = std::max(begin, keys_begin);
      end = std::min(end, keys_end);
      if (begin < end)
        whole_rows_accumulate<kNumVec, R>(acc + r * kHeadDim, kHeadDim, scores + r * score_stride, score_stride,
                                          v_blocks.data(), v_pos_stride, block_size, begin, end, [](int64_t) {});
    });
  }
}

// A decode item's few rows (fewer than kTransposeMinRows: one token's group of query heads, or
// a few tokens') against all their keys at once, as the whole-rows forms do for many: every
// key's scores from K's rows as they lie, one softmax per row, then P.V with the rows'
// accumulators in registers across every block. The block-by-block form pays per 16 keys
// for a running maximum, a rescale and a load and store of every accumulator (decode at batch
// 64 and context 256, one SmolLM2 layer, KV from DRAM, the Zen 5 EPYC: 0.86-0.94 -> 0.82-0.89
// ms). Not for bf16, whose block-by-block form (bf16 dot products) was faster there: 0.44-0.50
// against 0.53-0.66 ms.
// Its K pass asks for the K rows kPrefetchBlocks blocks ahead, then for the V pass's first
// blocks; the V pass for its own, then for the stream's next item's first blocks (K and V),
// so that item starts primed; each asks a share between its work on a block.
// stream_block(b, n): the stream's K and V rows n blocks past the item's block b. q_rows:
// pre-scaled. Fills acc [num_rows, kHeadDim] and row_sums [num_rows, kLanes]. An fp32 cache only.
template <int64_t kHeadDim, typename StreamBlock>
void attend_few_rows_fp32(const Problem& pr, const WorkItem& item, int64_t kv_head, const float* q_rows,
                          int64_t num_rows, int64_t lo, int64_t hi, float* acc, float* row_sums, int64_t* row_begin,
                          int64_t* row_end, StreamBlock&& stream_block) {
  using T = float;
  constexpr int64_t kNumVec = kHeadDim / kLanes;
  const int64_t block_size = pr.block_size;
  const int64_t first_b = lo / block_size, last_b = (hi - 1) / block_size;
  const int64_t base = first_b * block_size;  // the key of column 0
  const int64_t score_stride = ((last_b + 1) * block_size - base + kLanes - 1) / kLanes * kLanes;  // whole Vecs
  thread_local std::vector<float> buffer;
  thread_local std::vector<const T*> v_blocks;  // [last_b - first_b + 1]: each block's first V row
  const ScratchLayout layout(buffer, {num_rows * score_stride});
  float* scores = layout[0];  // [num_rows, score_stride], then the probabilities
  v_blocks.resize(last_b - first_b + 1);
  const T* k_head = static_cast<const T*>(pr.k) + kv_head * pr.k_head_stride;
  const T* v_head = static_cast<const T*>(pr.v) + kv_head * pr.v_head_stride;
  for (int64_t b = first_b; b <= last_b; ++b) {
    const int64_t block_start = b * block_size;
    const int64_t block_id = item_block_id(pr, item, b);
    v_blocks[b - first_b] = v_head + block_id * pr.v_block_stride;
    const bool own_k = b + kPrefetchBlocks <= last_b;
    const int64_t v_b = b + kPrefetchBlocks - last_b - 1 + first_b;  // past the last: the V pass's
    RowsAhead<T, kHeadDim> ahead(own_k ? stream_block(b, kPrefetchBlocks).first
                                       : (v_b <= last_b ? stream_block(v_b, 0).second : nullptr),
                                 own_k ? pr.k_pos_stride : pr.v_pos_stride, block_size, kHeadDim);
    const int64_t keys_begin = std::max(lo, block_start) - block_start;
    const int64_t keys_end = std::min(hi, block_start + block_size) - block_start;
    const T* k_block = k_head + block_id * pr.k_block_stride;
    float* block_scores = scores + (block_start - base);
    for (int64_t j = keys_begin; j < keys_end; j += 4) {  // 4 keys at a time, as rows_scores takes them
      const int64_t j_end = std::min(j + 4, keys_end);
      for_fixed_groups<kScoreRows>(num_rows, [&]<int64_t R>(int64_t r) {
        rows_scores<kNumVec, R>(q_rows + r * kHeadDim, kHeadDim, k_block, pr.k_pos_stride, j, j_end,
                                block_scores + r * score_stride, score_stride);
      });
      ahead.ask_until((j_end - keys_begin) * block_size / (keys_end - keys_begin));
    }
    ahead.ask_rest();
  }
  whole_rows_softmax_fp32(pr, item, num_rows, lo, hi, base, scores, score_stride, row_sums, row_begin, row_end);
  // The V pass: a V row kPrefetchBlocks blocks ahead per key, and past the last block the
  // stream's next item's K rows too.
  RowsAhead<T, kHeadDim> v_ahead(nullptr, 0, 0, kHeadDim), next_k_ahead(nullptr, 0, 0, kHeadDim);
  auto ask_ahead = [&](int64_t column) {
    if (column % block_size == 0) {
      v_ahead.ask_rest();
      next_k_ahead.ask_rest();
      const int64_t b = first_b + column / block_size;
      const auto [k_rows, v_rows] = stream_block(b, kPrefetchBlocks);
      v_ahead = RowsAhead<T, kHeadDim>(v_rows, pr.v_pos_stride, block_size, kHeadDim);
      next_k_ahead = RowsAhead<T, kHeadDim>(b + kPrefetchBlocks > last_b ? k_rows : nullptr, pr.k_pos_stride,
                                            block_size, kHeadDim);
    }
    next_k_ahead.ask_next();
    v_ahead.ask_next();
  };
  for_row_groups<kAccumRows>(num_rows, row_begin, row_end, [&]<int64_t R>(int64_t r, int64_t begin, int64_t end) {
    whole_rows_accumulate<kNumVec, R>(acc + r * kHeadDim, kHeadDim, scores + r * score_stride, score_stride,
                                      v_blocks.data(), pr.v_pos_stride, block_size, begin, end, [&](int64_t column) {
                                        if (r == 0) ask_ahead(column);
                                      });
  });
  v_ahead.ask_rest();
  next_k_ahead.ask_rest();
}

// A cache block's every kv head's rows (K or V: consecutive lines), asked for the way the
// weight streams are (stream_prefetch.h: non-temporal on AMD) a part at a time between the
// work on the block before. Inlined, with no division and no branch on the way: a call from
// the P.V's per-key hook has the accumulators stored to the stack and loaded back around it
// at every key, and a switch on kStreamPrefetch there cost as much (30 layers at batch 56,
// context 200: 15.5-15.7 ms a step with it, 12.1-12.2 with the way fixed at compile time).
template <StreamPrefetch kWay>
class BlockLinesAhead {
 public:
  BlockLinesAhead(const void* block, int64_t num_bytes)
      : block_(static_cast<const char*>(block)), num_bytes_(block == nullptr ? 0 : num_bytes) {}
  // Ask for the next num_bytes of the block.
  __attribute__((always_inline)) void ask_next(int64_t num_bytes) {
    const int64_t upto = std::min(num_bytes_, asked_ + num_bytes);
    if (upto > asked_) prefetch_lines_as<kWay>(block_ + asked_, upto - asked_);
    asked_ = upto;
  }
  void ask_rest() { ask_next(num_bytes_); }

 private:
  const char* block_;
  int64_t num_bytes_, asked_ = 0;
};

// Whether attend_token_all_heads serves the item: an unsplit decode token of a cache whose
// blocks hold every kv head's rows contiguously, few query heads a kv head (else the per-head
// tiles transpose K), and all its heads' scores within kWholeRowsMaxScoresFp32.
inline bool all_heads_fit(const Problem& pr, const WorkItem& item) {
  const auto [lo, hi] = item_keys(pr, item);
  if (item.num_tokens != 1 || item.partial >= 0 || hi <= lo || pr.group >= kTransposeMinRows) return false;
  const int64_t row = pr.num_kv_heads * pr.head_dim, num_blocks = (hi - 1) / pr.block_size - lo / pr.block_size + 1;
  return pr.k_head_stride == pr.head_dim && pr.v_head_stride == pr.head_dim && pr.k_pos_stride == row &&
         pr.v_pos_stride == row && pr.k_block_stride == pr.block_size * row &&
         pr.v_block_stride == pr.block_size * row &&
         pr.num_kv_heads * pr.group * (num_blocks * pr.block_size + kLanes) <= kWholeRowsMaxScoresFp32;
}

constexpr int64_t kAllHeadsAhead = 1;  // blocks a decode token's stream asks for ahead (2: 2-5% slower)

// A decode token against all its keys for every kv head at once (all_heads_fit), as
// attend_few_rows_fp32 does for one head's rows, with the same sums in the same order (the
// same bits for fp32): a block's K, then its V, read whole, each head's rows in turn, where an item
// per head reads its head's 256-byte rows 768 bytes apart, three times over the same
// blocks. In a C++ model of the reads alone (fp32 SmolLM2's 30 layers at batch 56 and
// context 200, KV from DRAM, 2 threads of the Zen 5 EPYC) the strided form ran at ~39 GB/s,
// the whole blocks at ~50 (the block ahead into L2) to ~60 (non-temporal). While it works
// on a block it asks for the lines of the block kAllHeadsAhead on in its stream: its K
// blocks, its V blocks, then `upcoming`'s (the thread's next item) K blocks. Measured:
// docs/benchmarks.md, "Decode attention over every kv head at once". A bf16 cache's rows are
// widened to fp32 as they are read (the query T's and the cache C's dtypes alike): at long
// contexts the per-head items' strided reads, not the arithmetic, bound a bf16 decode step.
template <typename T, typename C, int64_t kHeadDim, StreamPrefetch kWay>
void attend_token_all_heads_at(const Problem& pr, const WorkItem& item, const WorkItem* upcoming) {
  constexpr int64_t kNumVec = kHeadDim / kLanes;
  const int64_t block_size = pr.block_size, group = pr.group, num_kv_heads = pr.num_kv_heads;
  const int64_t num_rows = num_kv_heads * group;  // row r: query head r, of kv head r / group
  const auto [lo, hi] = item_keys(pr, item);
  const int64_t first_b = lo / block_size, last_b = (hi - 1) / block_size;
  const int64_t base = first_b * block_size;  // the key of column 0
  const int64_t score_stride = ((last_b + 1) * block_size - base + kLanes - 1) / kLanes * kLanes;  // whole Vecs
  // A block's bytes, and one head's row of it: what each head's work on a key reads.
  const int64_t block_bytes = block_size * pr.k_pos_stride * static_cast<int64_t>(sizeof(C));
  const int64_t row_bytes = kHeadDim * static_cast<int64_t>(sizeof(C));
  thread_local std::vector<float> buffer;
  thread_local std::vector<int64_t> bounds;
  const ScratchLayout layout(buffer, {num_rows * kHeadDim, num_rows * kHeadDim, num_rows * score_stride,
                                      num_rows * kLanes});
  float* q_rows = layout[0];    // [num_rows, kHeadDim], pre-scaled
  float* acc = layout[1];       // [num_rows, kHeadDim]
  float* scores = layout[2];    // [num_rows, score_stride], then the probabilities
  float* row_sums = layout[3];  // [num_rows, kLanes]: each row's softmax denominator, per lane
  bounds.resize(2 * num_rows);
  int64_t* row_begin = bounds.data();  // [num_rows] each row's keys [row_begin, row_end), in columns
  int64_t* row_end = row_begin + num_rows;
  const T* q = static_cast<const T*>(pr.q) + item.first_token * pr.q_token_stride;
  for (int64_t r = 0; r < num_rows; ++r)
    for (int64_t d = 0; d < kHeadDim; ++d)
      q_rows[r * kHeadDim + d] = static_cast<float>(q[r * pr.q_head_stride + d]) * pr.scale;
  const auto* k = static_cast<const C*>(pr.k);
  const auto* v = static_cast<const C*>(pr.v);
  auto prefetch_id = [&](const WorkItem& owner, int64_t b) {  // never faults: clamped, not checked
    return std::clamp<int64_t>(pr.block_tables[owner.seq * pr.block_table_stride + b], 0, pr.num_blocks - 1);
  };

  // The item's blocks as one stream: its K blocks, its V blocks, then the upcoming item's K
  // blocks. Work on stream block i asks for block i + kAllHeadsAhead.
  const int64_t num_blocks = last_b - first_b + 1;
  auto stream_block = [&](int64_t i) -> const C* {
    if (i < num_blocks) return k + prefetch_id(item, first_b + i) * pr.k_block_stride;
    if (i < 2 * num_blocks) return v + prefetch_id(item, first_b + i - num_blocks) * pr.v_block_stride;
    if (upcoming == nullptr) return nullptr;
    const auto [next_lo, next_hi] = item_keys(pr, *upcoming);
    const int64_t b = next_lo / block_size + i - 2 * num_blocks;
    return b * block_size < next_hi ? k + prefetch_id(*upcoming, b) * pr.k_block_stride : nullptr;
  };
  for (int64_t b = first_b; b <= last_b; ++b) {
    const int64_t block_start = b * block_size;
    const C* k_block = k + item_block_id(pr, item, b) * pr.k_block_stride;
    BlockLinesAhead<kWay> ahead(stream_block(b - first_b + kAllHeadsAhead), block_bytes);
    const int64_t keys_begin = std::max(lo, block_start) - block_start;
    const int64_t keys_end = std::min(hi, block_start + block_size) - block_start;
    float* block_scores = scores + (block_start - base);
    for (int64_t j = keys_begin; j < keys_end; j += 4) {  // 4 keys at a time, as rows_scores takes them
      const int64_t j_end = std::min(j + 4, keys_end);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        for_fixed_groups<kScoreRows>(group, [&]<int64_t R>(int64_t r) {
          const int64_t row = h * group + r;
          rows_scores<kNumVec, R>(q_rows + row * kHeadDim, kHeadDim, k_block + h * pr.k_head_stride, pr.k_pos_stride,
                                  j, j_end, block_scores + row * score_stride, score_stride);
        });
        ahead.ask_next((j_end - j) * row_bytes);
      }
    }
    ahead.ask_rest();
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    float* s = scores + r * score_stride;
    const Vec sum = whole_row_probabilities<ExpFp32>(pr, item.first_position, lo, hi, base, s, score_stride,
                                                     row_begin[r], row_end[r],
                                                     [s](int64_t j, Vec p) { std::memcpy(s + j, &p, sizeof p); });
    std::memcpy(row_sums + r * kLanes, &sum, sizeof sum);
  }
  std::fill(acc, acc + num_rows * kHeadDim, 0.f);
  for (int64_t b = first_b; b <= last_b; ++b) {
    const int64_t column0 = b * block_size - base;  // the block's first key's column
    const C* v_block = v + item_block_id(pr, item, b) * pr.v_block_stride;
    BlockLinesAhead<kWay> ahead(stream_block(num_blocks + b - first_b + kAllHeadsAhead), block_bytes);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      // p = 0 outside a row's keys: a group of rows runs over the union of theirs.
      for_row_groups<kAccumRows>(group, row_begin + h * group, row_end + h * group,
                                 [&]<int64_t R>(int64_t r, int64_t begin, int64_t end) {
                                   const int64_t row = h * group + r;
                                   const int64_t first = std::max(begin, column0) - column0;
                                   const int64_t last = std::min(end, column0 + block_size) - column0;
                                   if (first < last)
                                     rows_accumulate<kNumVec, R>(acc + row * kHeadDim, kHeadDim,
                                                                 scores + row * score_stride + column0, score_stride,
                                                                 v_block + h * pr.v_head_stride, pr.v_pos_stride,
                                                                 first, last, [&](int64_t) {
                                                                   if (r == 0) ahead.ask_next(row_bytes);
                                                                 });
                                 });
    }
    ahead.ask_rest();
  }
  T* out = static_cast<T*>(pr.out) + item.first_token * pr.out_token_stride;
  for (int64_t r = 0; r < num_rows; ++r) {
    const float sum = hsum(load_vec(row_sums + r * kLanes));
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t d = 0; d < kHeadDim; ++d)
      out[r * pr.out_head_stride + d] = static_cast<T>(acc[r * kHeadDim + d] * inv);
  }
}

// Whether the build unrolls the head dim (attend_item's kHeadDim > 0).
constexpr bool unrolls_head_dim(int64_t head_dim) {
  bool hd64 = false, hd128 = false, hd256 = false;
#ifdef PDSERVE_ATTENTION_HD64
  hd64 = true;
#endif
#ifdef PDSERVE_ATTENTION_HD128
  hd128 = true;
#endif
#ifdef PDSERVE_ATTENTION_HD256
  hd256 = true;
#endif
  return (head_dim == 64 && hd64) || (head_dim == 128 && hd128) || (head_dim == 256 && hd256);
}

// The (query, cache) dtypes attend_token_all_heads is built for: both fp32 or both bf16.
template <typename T, typename C>
constexpr bool kAllHeadsDtypes = std::is_same_v<T, C> && (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>);

// Whether attend_token_all_heads serves the item: kAllHeadsDtypes, the build unrolls the head
// dim, and all_heads_fit. Else each kv head is an item of its own.
template <typename T, typename C>
bool serves_all_heads(const Problem& pr, const WorkItem& item) {
  return kAllHeadsDtypes<T, C> && unrolls_head_dim(pr.head_dim) && all_heads_fit(pr, item);
}

// attend_token_all_heads at the item's head dim, its prefetches kStreamPrefetch's, where
// serves_all_heads<T, C>.
template <typename T, typename C>
void attend_token_all_heads(const Problem& pr, const WorkItem& item, const WorkItem* upcoming) {
  if constexpr (kAllHeadsDtypes<T, C>) {
    with_unrolled_head_dim(pr.head_dim, [&](auto head_dim) {
      constexpr int64_t kHeadDim = decltype(head_dim)::value;
      switch (kStreamPrefetch) {
        case StreamPrefetch::kNonTemporal:
          return attend_token_all_heads_at<T, C, kHeadDim, StreamPrefetch::kNonTemporal>(pr, item, upcoming);
        case StreamPrefetch::kL1:
          return attend_token_all_heads_at<T, C, kHeadDim, StreamPrefetch::kL1>(pr, item, upcoming);
        case StreamPrefetch::kOff:
          return attend_token_all_heads_at<T, C, kHeadDim, StreamPrefetch::kOff>(pr, item, upcoming);
      }
    });
  }
}

// One work item: the item's query tokens x the kv head's group of query heads ("rows",
// row r = token r / group, head r % group) against the keys they see, one cache block
// at a time. kHeadDim > 0 fixes head_dim at compile time: the rows' dot products and
// accumulators then live in vector registers.
template <typename T, typename C, int64_t kHeadDim>
void attend_item(const Problem& pr, const WorkItem& item, int64_t kv_head, BlockStream& stream,
                 std::vector<float>& scratch, std::vector<int64_t>& bounds) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : pr.head_dim;
  constexpr int64_t kNumVec = kHeadDim > 0 && kHeadDim % kLanes == 0 ? kHeadDim / kLanes : 0;
  const int64_t block_size = pr.block_size, group = pr.group;
  const int64_t num_rows = item.num_tokens * group;
  // Score rows padded to whole Vecs, so the transposed path stores full vectors.
  const int64_t score_stride = (block_size + kLanes - 1) / kLanes * kLanes;
  const bool transposed = kNumVec > 0 && num_rows >= kTransposeMinRows;
#ifdef PDSERVE_BF16_DOT
  // Rows' scores straight from the bf16 query and keys (fp32 sums), scaled after.
  constexpr bool kBf16Dot = std::is_same_v<T, c10::BFloat16> && kHeadDim > 0 && kHeadDim % kBf16PerVec == 0;
#else
  constexpr bool kBf16Dot = false;
#endif
#ifdef PDSERVE_ATTENTION_AMX
  // Both products on AMX tiles (attention_amx.h), whose query and accumulator buffers hold
  // whole blocks of 16 rows.
  const bool amx = kBf16Dot && transposed && amx_tiles_usable();
#else
  constexpr bool amx = false;
#endif
  const int64_t num_tile_rows = amx ? (num_rows + 15) / 16 * 16 : num_rows;
  // The bf16 dot products read the query as given: no fp32 copy (which would also crowd L1).
  const int64_t q_float_floats = kBf16Dot ? 0 : num_rows * head_dim;
  const int64_t q_bf16_floats = kBf16Dot ? (num_tile_rows * head_dim + 1) / 2 : 0;
  const bool k_transposed = transposed && !kBf16Dot;  // the fp32 path's K^T; the bf16 one pairs K itself
#ifdef PDSERVE_BF16_DOT
  const int64_t pair_floats = kBf16Dot && transposed ? kBf16PairWords<kHeadDim> : 0;
#else
  const int64_t pair_floats = 0;
#endif
  // Every buffer on its own cache line from a 4 KB page boundary: their addresses modulo
  // 4 KB (a load waits on an earlier store whose address has the same low 12 bits) are
  // then the same in every process, where stack buffers moved with ASLR's stack offset
  // and a 1024-token prompt's attention took 14 or 20 ms from one process to the next.
  // An fp8 cache's block, K and V, widened to T (block_rows).
  const int64_t widened_floats = kIsFp8<C> ? (block_size * head_dim * static_cast<int64_t>(sizeof(T)) + 3) / 4 : 0;
  // Rows that accumulate P.V one V row at a time in fp32 (rows_accumulate: decode) take an fp8
  // cache's V widened to fp32 at once, not to T and then again to fp32 for every key.
  const bool v_as_float = kIsFp8<C> && kNumVec > 0 && !transposed;
  const int64_t v_widened_floats = v_as_float ? block_size * head_dim : widened_floats;
  const ScratchLayout layout(scratch, {q_float_floats, num_tile_rows * head_dim, num_rows, num_rows * score_stride,
                                       k_transposed ? head_dim * score_stride : 0, q_bf16_floats, pair_floats,
                                       pair_floats, num_rows * kLanes, widened_floats, v_widened_floats});
  bounds.resize(2 * num_rows);
  float* q_rows = layout[0];   // [num_rows, head_dim], pre-scaled (fp32 paths only)
  float* acc = layout[1];      // [num_tile_rows, head_dim]
  float* row_max = layout[2];  // [num_rows]
  float* scores = layout[3];   // [num_rows, score_stride], then probabilities
  float* k_t = layout[4];      // [head_dim, score_stride]: the block's K, transposed (fp32 path)
  auto* q_bf16 = reinterpret_cast<T*>(layout[5]);  // [num_tile_rows, head_dim]: the query as given (kBf16Dot)
  // The bf16 tiles' K and V of one block in pairs (attention_bf16.h)
  auto* k_pairs = reinterpret_cast<uint32_t*>(layout[6]);
  auto* v_pairs = reinterpret_cast<uint32_t*>(layout[7]);
  float* row_sums = layout[8];  // [num_rows, kLanes]: each row's softmax denominator, per lane
  auto* k_widened = reinterpret_cast<T*>(layout[9]);  // [block_size, head_dim] (fp8 caches)
  auto* v_widened = reinterpret_cast<T*>(layout[10]);  // (or fp32, v_as_float)
  int64_t* row_begin = bounds.data();              // [num_rows] visible keys of this block, relative
  int64_t* row_end = row_begin + num_rows;         // [num_rows]
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::fill(acc, acc + num_tile_rows * head_dim, 0.f);
  std::fill(row_max, row_max + num_rows, kNegInf);
  std::fill(row_sums, row_sums + num_rows * kLanes, 0.f);

  const T* q = static_cast<const T*>(pr.q);
  const float scale = pr.scale * kCodeScale<C>;  // of the rows block_rows gives
  for (int64_t r = 0; r < num_rows; ++r) {
    const T* src =
        q + (item.first_token + r / group) * pr.q_token_stride + (kv_head * group + r % group) * pr.q_head_stride;
    if constexpr (kBf16Dot)
      std::memcpy(q_bf16 + r * head_dim, src, head_dim * sizeof(T));  // a constant size: inlined moves
    else
      for (int64_t d = 0; d < head_dim; ++d) q_rows[r * head_dim + d] = to_float(src[d]) * scale;
  }
  if constexpr (kBf16Dot) std::fill(q_bf16 + num_rows * head_dim, q_bf16 + num_tile_rows * head_dim, T(0.f));
#ifdef PDSERVE_ATTENTION_AMX
  if (amx) configure_attention_tiles();
#endif
  const auto [lo, hi] = item_keys(pr, item);
  const C* k_head = static_cast<const C*>(pr.k) + kv_head * pr.k_head_stride;
  const C* v_head = static_cast<const C*>(pr.v) + kv_head * pr.v_head_stride;
  const int64_t first_b = lo / block_size, last_b = (hi - 1) / block_size;
  // The stream's block `ahead` past this item's block b: this item's, the upcoming item's
  // (its block b + ahead - last_b - 1), or none past both.
  auto stream_block = [&](int64_t b, int64_t ahead) -> std::pair<const C*, const C*> {
    const WorkItem* owner = &item;
    int64_t head = kv_head, index = b + ahead;
    if (index > last_b) {
      if (stream.upcoming == nullptr) return {nullptr, nullptr};
      owner = stream.upcoming;
      head = stream.upcoming_head;
      const auto [next_lo, next_hi] = item_keys(pr, *owner);
      index = next_lo / block_size + index - last_b - 1;
      if (index * block_size >= next_hi) return {nullptr, nullptr};
    }
    const int64_t id = std::clamp<int64_t>(pr.block_tables[owner->seq * pr.block_table_stride + index], 0,
                                           pr.num_blocks - 1);
    return {static_cast<const C*>(pr.k) + head * pr.k_head_stride + id * pr.k_block_stride,
            static_cast<const C*>(pr.v) + head * pr.v_head_stride + id * pr.v_block_stride};
  };
  // Unprimed (a thread's first item, or after a short one), this item's own first blocks
  // after the first (which is needed at once: no use asking).
  const int64_t first_asked = stream.primed ? kPrefetchBlocks : 1;  // past first_b
  for (int64_t ahead = first_asked; ahead < kPrefetchBlocks && hi > lo; ++ahead) {
    const auto [k_rows, v_rows] = stream_block(first_b, ahead);
    if (k_rows == nullptr) break;
    prefetch_rows(k_rows, pr.k_pos_stride, block_size, head_dim);
    prefetch_rows(v_rows, pr.v_pos_stride, block_size, head_dim);
  }
  // This item asks for the stream's blocks first_b + first_asked to last_b + kPrefetchBlocks
  // without a gap: the upcoming item's first kPrefetchBlocks blocks (last_b + 1 on) are
  // among them unless this item has fewer blocks than first_asked.
  stream.primed = hi > lo && last_b - first_b + 1 >= first_asked;
  // Whether the item takes a whole-rows form (attend_whole_rows, attend_whole_rows_fp32):
  // many rows, all the item's keys in this call, whole 16-key groups per block (blocks of
  // 16, 32, ... keys: the transposed scores' width) and at most max_scores scores, over all
  // its keys or (chunked: attend_whole_rows) over a block's.
  auto whole_rows_fit = [&](int64_t max_scores, bool chunked) {
    const int64_t num_keys = chunked ? block_size : (last_b - first_b + 1) * block_size;
    return transposed && item.partial < 0 && hi > lo && block_size % 16 == 0 && num_rows * num_keys <= max_scores;
  };

#ifdef PDSERVE_BF16_DOT
  if constexpr (kBf16Dot && kHeadDim % 64 == 0) {
    if (whole_rows_fit(whole_rows_max_scores(amx), true)) {
      const int64_t paired_offset =
          pr.paired_offsets != nullptr ? pr.paired_offsets[item.seq * pr.num_kv_heads + kv_head] : -1;
      const uint32_t* paired = paired_offset >= 0 ? pr.paired_kv + paired_offset : nullptr;
      if (amx)
        attend_whole_rows<kHeadDim, true, C>(pr, item, kv_head, q_bf16, num_rows, lo, hi, acc, row_sums, paired);
      else
        attend_whole_rows<kHeadDim, false, C>(pr, item, kv_head, q_bf16, num_rows, lo, hi, acc, row_sums, paired);
      stream.primed = false;  // nothing asked for the next item's blocks: it asks itself
      goto rows_done;
    }
  }
#endif
  if constexpr (std::is_same_v<T, float> && std::is_same_v<C, float> && kNumVec > 0) {
    if (whole_rows_fit(kWholeRowsMaxScoresFp32, false)) {
      attend_whole_rows_fp32<kHeadDim>(pr, item, kv_head, q_rows, num_rows, lo, hi, acc, row_sums, row_begin,
                                       row_end);
      stream.primed = false;  // nothing asked for the next item's blocks: it asks itself
      goto rows_done;
    }
    if (!transposed && item.partial < 0 && hi > lo &&
        num_rows * ((last_b - first_b + 1) * block_size + kLanes) <= kWholeRowsMaxScoresFp32) {
      attend_few_rows_fp32<kHeadDim>(pr, item, kv_head, q_rows, num_rows, lo, hi, acc, row_sums, row_begin, row_end,
                                     stream_block);
      // The V pass asked for the next item's first blocks at its last kPrefetchBlocks block
      // starts (the first block's only where the item's keys begin on it).
      stream.primed = last_b - first_b + 1 > kPrefetchBlocks;
      goto rows_done;
    }
  }
  for (int64_t b = first_b; b * block_size < hi; ++b) {
    const int64_t block_id = item_block_id(pr, item, b);
    const int64_t block_start = b * block_size;
    // The block kPrefetchBlocks ahead. Rows that score without transposing K (decode) ask
    // for it in parts between their work on this block: its K a share after each row's
    // scores, its V a row per key of the P.V. Tiles ask for its K now, its V after the
    // scores (both at once overflowed the L2's miss queue: decode at batch 64 ~12% slower).
    const auto [k_ahead_rows, v_ahead_rows] = stream_block(b, kPrefetchBlocks);
    RowsAhead<C, kHeadDim> k_ahead(k_ahead_rows, pr.k_pos_stride, block_size, head_dim);
    RowsAhead<C, kHeadDim> v_ahead(v_ahead_rows, pr.v_pos_stride, block_size, head_dim);
    const bool spread_ahead = kNumVec > 0 && !transposed;
    if (!spread_ahead) k_ahead.ask_rest();
    const int64_t keys_begin = std::max(lo, block_start) - block_start;       // any row's keys here
    const int64_t keys_end = std::min(hi, block_start + block_size) - block_start;
    const auto [k_block, k_pos_stride] =
        block_rows(k_head + block_id * pr.k_block_stride, pr.k_pos_stride, keys_begin, keys_end, head_dim, k_widened);
    const float* v_floats = nullptr;  // the block's V rows in fp32 (v_as_float), head_dim apart
    if constexpr (kIsFp8<C>)
      if (v_as_float)
        v_floats = block_rows(v_head + block_id * pr.v_block_stride, pr.v_pos_stride, keys_begin, keys_end, head_dim,
                              layout[10]).first;
    const auto [v_block, v_pos_stride] =
        v_as_float ? std::pair<const T*, int64_t>{nullptr, head_dim}
                   : block_rows(v_head + block_id * pr.v_block_stride, pr.v_pos_stride, keys_begin, keys_end, head_dim,
                                v_widened);
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t position = item.first_position + r / group;
      row_begin[r] = std::max({first_visible_key(pr, position), lo, block_start}) - block_start;
      row_end[r] = std::min({position + 1, hi, block_start + block_size}) - block_start;
    }
    // Scores over [keys_begin, keys_end); a row's masked keys hold anything (the softmax skips them).
    if constexpr (kNumVec > 0) {
      if (amx) {
#ifdef PDSERVE_ATTENTION_AMX
        if constexpr (kBf16Dot)
          for (int64_t first = keys_begin / 16 * 16; first < keys_end; first += 16) {
            pair_key_rows<kHeadDim>(k_block, k_pos_stride, first, keys_begin, keys_end, k_pairs);
            amx_block_scores<kHeadDim>(q_bf16, num_rows, k_pairs, scale, score_stride, scores + first);
          }
#endif
      } else if (transposed) {
#ifdef PDSERVE_BF16_DOT
        if constexpr (kBf16Dot)
          transposed_scores_bf16<kHeadDim>(q_bf16, num_rows, k_block, k_pos_stride, keys_begin, keys_end, scale,
                                           score_stride, scores, k_pairs);
        else
#endif
          transposed_scores<kHeadDim>(q_rows, num_rows, k_block, k_pos_stride, keys_begin, keys_end,
                                      score_stride, k_t, score_stride, scores);
      } else {
#ifdef PDSERVE_BF16_DOT
        if constexpr (kBf16Dot) {
          for (int64_t r = 0; r < num_rows; ++r) {
            if (row_begin[r] < row_end[r])
              row_scores_bf16<kHeadDim>(q_bf16 + r * head_dim, k_block, k_pos_stride, row_begin[r], row_end[r],
                                        scale, scores + r * score_stride);
            k_ahead.ask_until(block_size * (r + 1) / num_rows);
          }
        } else
#endif
        {
          // Rows in groups of kScoreRows over the union of their keys (what a row does not
          // see is scored too and skipped by the softmax).
          auto score = [&]<int64_t R>(int64_t r, int64_t begin, int64_t end) {
            rows_scores<kNumVec, R>(q_rows + r * head_dim, head_dim, k_block, k_pos_stride, begin, end,
                                    scores + r * score_stride, score_stride);
          };
          for_row_groups<kScoreRows>(num_rows, row_begin, row_end, score);
        }
      }
    } else {  // each K row loaded once for all rows
      for (int64_t j = keys_begin; j < keys_end; ++j) {
        const T* k_row = k_block + j * k_pos_stride;
        for (int64_t r = 0; r < num_rows; ++r)
          if (j >= row_begin[r] && j < row_end[r])
            scores[r * score_stride + j] = dot<kHeadDim>(q_rows + r * head_dim, k_row, head_dim);
      }
    }
    if (!spread_ahead) v_ahead.ask_rest();
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
      const float new_max = std::max(row_max[r], row_block_max(s, keys_begin, keys_end, begin, end));
      Vec sum = load_vec(row_sums + r * kLanes);
      if (new_max > row_max[r] && row_max[r] != kNegInf) {  // rescale what earlier blocks accumulated
        const float correction = std::exp(row_max[r] - new_max);
        sum *= correction;
        float* acc_row = acc + r * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) acc_row[d] *= correction;
      }
      row_max[r] = new_max;
      // The tiles round p to bf16 for P.V.
      sum += kBf16Dot && transposed ? row_probabilities<ExpForBf16>(s, keys_begin, keys_end, begin, end, new_max)
                                    : row_probabilities(s, keys_begin, keys_end, begin, end, new_max);
      std::memcpy(row_sums + r * kLanes, &sum, sizeof sum);
    }
    // acc += P V over each row's visible keys (masked ones are skipped, not added as 0 x V).
    if (amx) {
#ifdef PDSERVE_ATTENTION_AMX
      if constexpr (kBf16Dot)
        for (int64_t first = keys_begin / 16 * 16; first < keys_end; first += 16) {
          pair_value_rows<kHeadDim>(v_block, v_pos_stride, first, keys_begin, keys_end, v_pairs);
          amx_block_accumulate<kHeadDim>(acc, num_rows, scores + first, score_stride,
                                         keys_in_range(first, keys_begin, keys_end), v_pairs);
        }
#endif
      continue;
    }
#ifdef PDSERVE_BF16_DOT
    if constexpr (kBf16Dot) {
      if (transposed) {
        transposed_accumulate_bf16<kHeadDim>(acc, num_rows, scores, score_stride, v_block, v_pos_stride,
                                             keys_begin, keys_end, v_pairs);
        continue;
      }
    }
#endif
    if constexpr (kNumVec > 0) {
      // Softmax left p = 0 on [keys_begin, keys_end) outside a row's keys, and those V rows
      // are real cached positions, so a group of rows runs over the union of its ranges.
      auto accumulate = [&](const auto* v_rows) {
        for_row_groups<kAccumRows>(num_rows, row_begin, row_end, [&]<int64_t R>(int64_t r, int64_t begin, int64_t end) {
          rows_accumulate<kNumVec, R>(acc + r * head_dim, head_dim, scores + r * score_stride, score_stride, v_rows,
                                      v_pos_stride, begin, end, [&](int64_t) {
                                        k_ahead.ask_next();  // the fp32 scores' K (bf16's are all asked)
                                        v_ahead.ask_next();
                                      });
        });
      };
      if (v_floats != nullptr)
        accumulate(v_floats);
      else
        accumulate(v_block);
      k_ahead.ask_rest();  // what fewer keys than the block's left
      v_ahead.ask_rest();
    } else {  // each V row loaded once for all rows
      for (int64_t j = keys_begin; j < keys_end; ++j) {
        const T* v_row = v_block + j * v_pos_stride;
        for (int64_t r = 0; r < num_rows; ++r)
          if (j >= row_begin[r] && j < row_end[r])
            axpy<kHeadDim>(acc + r * head_dim, scores[r * score_stride + j], v_row, head_dim);
      }
    }
  }
rows_done:
#ifdef PDSERVE_ATTENTION_AMX
  if (amx) _tile_release();
#endif
  auto row_sum = [&](int64_t r) { return hsum(load_vec(row_sums + r * kLanes)); };
  if (item.partial >= 0) {  // one part of a split token: merged by merge_split_token
    float* slot = pr.partials + (item.partial * pr.num_kv_heads + kv_head) * group * (head_dim + 2);
    for (int64_t r = 0; r < num_rows; ++r) {
      for (int64_t d = 0; d < head_dim; ++d) slot[r * (head_dim + 2) + d] = acc[r * head_dim + d] * kCodeScale<C>;
      slot[r * (head_dim + 2) + head_dim] = row_max[r];
      slot[r * (head_dim + 2) + head_dim + 1] = row_sum(r);
    }
    return;
  }
  T* out = static_cast<T*>(pr.out);
  for (int64_t r = 0; r < num_rows; ++r) {
    T* dst = out + (item.first_token + r / group) * pr.out_token_stride +
             (kv_head * group + r % group) * pr.out_head_stride;
    const float sum = row_sum(r);
    const float inv = sum > 0.f ? kCodeScale<C> / sum : 0.f;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc[r * head_dim + d] * inv);
  }
}

template <typename T, typename C>
void attend_item_any_dim(const Problem& pr, const WorkItem& item, int64_t kv_head, BlockStream& stream,
                         std::vector<float>& scratch, std::vector<int64_t>& bounds) {
  const bool unrolled = with_unrolled_head_dim(pr.head_dim, [&](auto head_dim) {
    attend_item<T, C, decltype(head_dim)::value>(pr, item, kv_head, stream, scratch, bounds);
  });
  if (!unrolled) attend_item<T, C, 0>(pr, item, kv_head, stream, scratch, bounds);
}

// Decode tokens (one-token items) cut into up to `parts` items over their visible keys,
// at block boundaries, each part at least kMinSplitKeys long; records them in `splits`.
std::vector<WorkItem> split_decode_tokens(const std::vector<WorkItem>& items, int64_t parts, int64_t sliding_window,
                                          int64_t block_size, std::vector<SplitToken>& splits) {
  std::vector<WorkItem> out;
  int64_t num_partials = 0;
  for (const WorkItem& item : items) {
    const int64_t position = item.first_position;
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, position - sliding_window + 1) : 0;
    const int64_t num_keys = position + 1 - first;
    const int64_t num_parts = std::min(parts, num_keys / kMinSplitKeys);
    if (item.num_tokens != 1 || num_parts < 2) {
      out.push_back(item);
      continue;
    }
    const int64_t part_len = (num_keys + num_parts - 1) / num_parts / block_size * block_size + block_size;
    splits.push_back({item.first_token, num_partials, 0});
    for (int64_t begin = first; begin <= position; begin += part_len) {
      WorkItem part = item;
      part.key_begin = begin;
      part.key_end = std::min(begin + part_len, position + 1);
      part.partial = num_partials++;
      out.push_back(part);
      ++splits.back().num_parts;
    }
  }
  return out;
}

// out = the split token's parts combined: each part's sum and accumulator rescaled to the
// largest part max (the online-softmax merge), then normalised.
template <typename T>
void merge_split_token(const Problem& pr, const SplitToken& split) {
  const int64_t head_dim = pr.head_dim, row_len = head_dim + 2, rows = pr.num_kv_heads * pr.group;
  std::vector<float> acc(head_dim);
  for (int64_t row = 0; row < rows; ++row) {  // row = kv_head * group + g = the query head
    auto part_row = [&](int64_t p) { return pr.partials + ((split.first_partial + p) * rows + row) * row_len; };
    float max = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (int64_t p = 0; p < split.num_parts; ++p)
      if (part_row(p)[head_dim + 1] > 0.f) max = std::max(max, part_row(p)[head_dim]);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t p = 0; p < split.num_parts; ++p) {
      const float* part = part_row(p);
      if (!(part[head_dim + 1] > 0.f)) continue;
      const float weight = std::exp(part[head_dim] - max);
      sum += part[head_dim + 1] * weight;
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += part[d] * weight;
    }
    T* dst = static_cast<T*>(pr.out) + split.token * pr.out_token_stride + row * pr.out_head_stride;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
  }
}

#ifdef PDSERVE_BF16_DOT
// The sequences of the call whose query tokens make several whole-rows items (prompts and
// their chunks) get their keys paired once (pair_prompt_keys), into this thread's buffer,
// which pr then points at; the others' items pair their own.
template <typename C>
void pair_prompts(Problem& pr, const int32_t* seq_lens, const int32_t* query_starts, int64_t num_seqs,
                  std::vector<int64_t>& offsets) {
  std::vector<PromptSequence> seqs;
  const int64_t group_words = 2 * (pr.head_dim / 2 * 16);  // kPairedGroupWords<head_dim>
  const int64_t num_words = prompt_sequences(
      pr, seq_lens, query_starts, num_seqs, kPairedMaxScores,
      [&](int64_t seq_len) { return num_paired_groups(pr, seq_len) * group_words; }, seqs, offsets);
  if (seqs.empty()) return;
  thread_local std::vector<uint32_t> buffer;  // kept: a fresh allocation faults its pages in each call
  buffer.resize(num_words + 16);
  uint32_t* out = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64 / sizeof(uint32_t);
  const bool paired = with_unrolled_head_dim(pr.head_dim, [&](auto head_dim) {
    pair_prompt_keys<decltype(head_dim)::value, C>(pr, seqs, offsets.data(), out);
  });
  if (!paired) return;
  pr.paired_kv = out;
  pr.paired_offsets = offsets.data();
}
#endif

// The fp32 sequences of the call whose query tokens make several whole-rows items get each
// span of their keys transposed and their values laid in one run once (transpose_prompt_keys),
// into this thread's buffer, which pr then points at; the others' items read the cache.
inline void transpose_prompts(Problem& pr, const int32_t* seq_lens, const int32_t* query_starts, int64_t num_seqs,
                              std::vector<int64_t>& keys_t_offsets, std::vector<int64_t>& values_offsets) {
  std::vector<PromptSequence> seqs;
  const int64_t span_floats = pr.head_dim * kSpanKeys;  // a span's K^T, or its values
  const int64_t num_floats = prompt_sequences(
      pr, seq_lens, query_starts, num_seqs, kWholeRowsMaxScoresFp32,
      [&](int64_t seq_len) { return 2 * num_key_spans(pr, seq_len) * span_floats; }, seqs, keys_t_offsets);
  if (seqs.empty()) return;
  values_offsets.assign(keys_t_offsets.size(), -1);
  for (const auto& [seq, seq_len] : seqs)
    for (int64_t head = 0; head < pr.num_kv_heads; ++head)
      values_offsets[seq * pr.num_kv_heads + head] =
          keys_t_offsets[seq * pr.num_kv_heads + head] + num_key_spans(pr, seq_len) * span_floats;
  thread_local std::vector<float> buffer;  // kept: a fresh allocation faults its pages in each call
  buffer.resize(num_floats + 16);
  float* out = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64 / sizeof(float);
  const bool transposed = with_unrolled_head_dim(pr.head_dim, [&](auto head_dim) {
    transpose_prompt_keys<decltype(head_dim)::value>(pr, seqs, keys_t_offsets.data(), values_offsets.data(), out);
  });
  if (!transposed) return;
  pr.prepared = out;
  pr.keys_t_offsets = keys_t_offsets.data();
  pr.values_offsets = values_offsets.data();
}

}  // namespace

namespace pdserve_attention {

// One call's work: its items (longest first in `order`), the decode tokens split over
// their keys and their partial slots, what the items share, and the output.
struct CallPlan {
  std::vector<WorkItem> items;
  std::vector<SplitToken> splits;
  std::vector<int64_t> order;  // work w is the kv head w % num_kv_heads of item order[w / num_kv_heads]
  Problem problem;
  int64_t num_work = 0, work_per_claim = 1, num_workers = 0;
  at::Tensor out, partials;
};

}  // namespace pdserve_attention

using pdserve_attention::CallPlan;

namespace {

// Checks a call's arguments (ValueError on a bad one) and lays out its work for
// num_threads threads.
CallPlan plan_call(const at::Tensor& q,            // [num_tokens, num_q_heads, head_dim]
                   const at::Tensor& k_cache,      // [num_blocks, block_size, num_kv_heads, head_dim]
                   const at::Tensor& v_cache,      // [num_blocks, block_size, num_kv_heads, head_dim]
                   const at::Tensor& block_tables,     // [num_seqs, max_blocks] int32
                   const at::Tensor& query_start_loc,  // [num_seqs + 1] int32
                   const at::Tensor& seq_lens,         // [num_seqs] int32
                   double scale, int64_t sliding_window, double logit_softcap, int64_t num_threads) {
  PDSERVE_CHECK_VALUE(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
                      "bad q/cache shapes");
  PDSERVE_CHECK_VALUE(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
                      "q and the caches must be contiguous in head_dim");
  PDSERVE_CHECK_VALUE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 ||
                          q.scalar_type() == at::kHalf,
                      "paged_attention takes float32, bfloat16 or float16, got ", q.scalar_type());
  PDSERVE_CHECK_VALUE(k_cache.scalar_type() == v_cache.scalar_type() &&
                          (k_cache.scalar_type() == q.scalar_type() ||
                           (is_fp8(k_cache.scalar_type()) && q.scalar_type() != at::kHalf)),
                      "dtype mismatch: q ", q.scalar_type(), ", caches ", k_cache.scalar_type(), " and ",
                      v_cache.scalar_type(), " (a cache holds q's dtype, or fp8 codes for float32 and bfloat16)");
  PDSERVE_CHECK_VALUE(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0, "head mismatch");
  PDSERVE_CHECK_VALUE(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                          seq_lens.scalar_type() == at::kInt,
                      "metadata must be int32");
  PDSERVE_CHECK_VALUE(block_tables.dim() == 2 && block_tables.stride(1) == 1,
                      "block_tables must be [num_seqs, max_blocks]");
  const int64_t num_seqs = block_tables.size(0), max_blocks = block_tables.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  PDSERVE_CHECK_VALUE(query_start_loc.is_contiguous() && query_start_loc.numel() == num_seqs + 1,
                      "bad query_start_loc");
  PDSERVE_CHECK_VALUE(seq_lens.is_contiguous() && seq_lens.numel() == num_seqs, "bad seq_lens");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  PDSERVE_CHECK_VALUE(starts[num_seqs] <= q.size(0), "query_start_loc ends past num_tokens");

  PDSERVE_CHECK_VALUE(starts[0] >= 0, "query_start_loc must start at 0 or later");
  CallPlan plan;
  std::vector<WorkItem>& items = plan.items;
  items.reserve(num_seqs);
  std::vector<int64_t> padding_seqs;  // seq_len 0 with queries: batch padding, whose rows are zeros
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t query_len = starts[i + 1] - starts[i], seq_len = lens[i];
    PDSERVE_CHECK_VALUE(query_len >= 0, "query_start_loc must be non-decreasing");
    if (query_len > 0 && seq_len == 0) padding_seqs.push_back(i);
    if (query_len == 0 || seq_len == 0) continue;
    PDSERVE_CHECK_VALUE(seq_len >= query_len, "sequence ", i, ": seq_len ", seq_len, " < query_len ", query_len);
    PDSERVE_CHECK_VALUE((seq_len + block_size - 1) / block_size <= max_blocks, "sequence ", i, ": seq_len ", seq_len,
                        " needs more blocks than block_tables has columns");
    for (int64_t t = 0; t < query_len; t += kQueryTile)
      items.push_back({i, starts[i] + t, std::min(kQueryTile, query_len - t), seq_len - query_len + t});
  }
  const int64_t min_items = kWorkPerThread * num_threads;
  const int64_t num_unsplit = static_cast<int64_t>(items.size()) * num_kv_heads;
  if (num_threads > 1 && num_unsplit > 0 && num_unsplit < min_items)
    items = split_decode_tokens(items, (min_items + num_unsplit - 1) / num_unsplit, sliding_window, block_size,
                                plan.splits);
  const int64_t num_partials =
      plan.splits.empty() ? 0 : plan.splits.back().first_partial + plan.splits.back().num_parts;
  const int64_t group = q.size(1) / num_kv_heads, head_dim = q.size(2);
  plan.partials = at::empty({num_partials, num_kv_heads, group, head_dim + 2}, q.options().dtype(at::kFloat));
  // Every row an item covers is written; only the rest (padding) is zeroed, not the whole
  // output (a bf16 fill of it cost ~0.6% of a 64-sequence decode step).
  at::Tensor& out = plan.out;
  out = at::empty(q.sizes(), q.options());
  auto zero_rows = [&](int64_t begin, int64_t end) {
    if (end > begin) out.narrow(0, begin, end - begin).zero_();
  };
  zero_rows(0, starts[0]);
  zero_rows(starts[num_seqs], q.size(0));
  for (const int64_t i : padding_seqs) zero_rows(starts[i], starts[i + 1]);
  plan.num_work = static_cast<int64_t>(items.size()) * num_kv_heads;
  plan.problem = Problem{q.data_ptr(), q.stride(0), q.stride(1),
                         k_cache.data_ptr(), v_cache.data_ptr(),
                         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                         out.data_ptr(), out.stride(0), out.stride(1),
                         block_tables.data_ptr<int32_t>(), block_tables.stride(0), k_cache.size(0),
                         block_size, num_kv_heads, q.size(1) / num_kv_heads, q.size(2), sliding_window,
                         static_cast<float>(scale), static_cast<float>(logit_softcap), plan.partials.data_ptr<float>()};
  // Longest items first, handed out one at a time: a static split of a batch with mixed
  // lengths leaves threads idle while one finishes the long sequences.
  std::vector<int64_t>& order = plan.order;
  order.resize(items.size());
  for (size_t i = 0; i < items.size(); ++i) order[i] = static_cast<int64_t>(i);
  auto cost = [&](int64_t i) {
    const WorkItem& item = items[i];
    return item.num_tokens * (std::min(item.first_position + item.num_tokens, item.key_end) - item.key_begin);
  };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  // Where there are enough items to go round (kWorkPerThread a thread), a thread takes all
  // of an item's kv heads in turn, whose rows interleave in the same cache blocks: decode at
  // batch 64, context 200, KV from DRAM ~12 -> ~14 GB/s. Not because the next head's lines
  // are in L2 by then (without its own prefetches it is far slower); most likely the
  // memory's open pages. Otherwise (item, head) pairs go one by one.
  plan.work_per_claim = static_cast<int64_t>(items.size()) >= kWorkPerThread * num_threads ? num_kv_heads : 1;
  plan.num_workers = std::min<int64_t>(num_threads, plan.num_work);
  return plan;
}

}  // namespace

namespace pdserve_attention {

// One thread's share of a call's work: items claimed from `next` until none is left.
template <typename T, typename C>
void claim_work(const CallPlan& plan, std::atomic<int64_t>& next) {
  const int64_t num_kv_heads = plan.problem.num_kv_heads, num_work = plan.num_work;
  std::vector<float> scratch;
  std::vector<int64_t> bounds;
  BlockStream stream;
  int64_t claimed_end = 0;  // past this thread's last claimed work
  auto claim = [&] {
    const int64_t first = next.fetch_add(plan.work_per_claim);
    claimed_end = first + plan.work_per_claim;
    return first;
  };
  // Each item's successor is claimed before the item starts, so the stream can run into it.
  // A claim of all of an item's kv heads is one work where attend_token_all_heads serves it.
  for (int64_t w = claim(), following = 0; w < num_work; w = following) {
    const WorkItem& item = plan.items[plan.order[w / num_kv_heads]];
    const bool all_heads = num_kv_heads > 1 && w % num_kv_heads == 0 && claimed_end - w == num_kv_heads &&
                           serves_all_heads<T, C>(plan.problem, item);
    following = all_heads ? claim() : w + 1 < claimed_end ? w + 1 : claim();
    stream.upcoming = following < num_work ? &plan.items[plan.order[following / num_kv_heads]] : nullptr;
    stream.upcoming_head = following % num_kv_heads;
    if (all_heads) {
      attend_token_all_heads<T, C>(plan.problem, item, stream.upcoming);
      stream.primed = false;  // it asked for the next item's first K block, every head's, not the stream's blocks
    } else {
      attend_item_any_dim<T, C>(plan.problem, item, w % num_kv_heads, stream, scratch, bounds);
    }
  }
}

// A build holding bf16 or fp16 pairs is compiled as two translation units side by side
// (kernels/cpu_attention.py, SECOND_PART_DTYPE_PAIRS): claim_work of each dtype pair, over
// every unrolled head dim, is the heaviest of the library (~15 s of one core's g++ a pair).
// Part 1 instantiates it for bf16 and fp16 queries and ends here; part 0 (the rest of the
// file: plans, ops, registration) declares those and instantiates the fp32 ones itself.
// Without PDSERVE_BUILD_PART, one unit holds everything.
#define PDSERVE_CLAIM_WORK_INSTANCE(T, C) template void claim_work<T, C>(const CallPlan&, std::atomic<int64_t>&);
#define PDSERVE_CLAIM_WORK_ELSEWHERE(T, C) \
  extern template void claim_work<T, C>(const CallPlan&, std::atomic<int64_t>&);
#if !defined(PDSERVE_BUILD_PART)
#define PDSERVE_PART_1_PAIR(T, C)
#elif PDSERVE_BUILD_PART == 1
#define PDSERVE_PART_1_PAIR PDSERVE_CLAIM_WORK_INSTANCE
#else
#define PDSERVE_PART_1_PAIR PDSERVE_CLAIM_WORK_ELSEWHERE
#endif
#ifdef PDSERVE_ATTENTION_BF16
PDSERVE_PART_1_PAIR(c10::BFloat16, c10::BFloat16)
#endif
#ifdef PDSERVE_ATTENTION_BF16_FP8
PDSERVE_PART_1_PAIR(c10::BFloat16, c10::Float8_e4m3fn)
PDSERVE_PART_1_PAIR(c10::BFloat16, c10::Float8_e5m2)
#endif
#ifdef PDSERVE_ATTENTION_F16
PDSERVE_PART_1_PAIR(c10::Half, c10::Half)
#endif

}  // namespace pdserve_attention

using pdserve_attention::claim_work;

#if !defined(PDSERVE_BUILD_PART) || PDSERVE_BUILD_PART == 0
namespace {

// Whether this build holds the kernels of dtype queries over caches of their own dtype
// (fp8: false) or of fp8 codes (true).
constexpr bool has_pair(at::ScalarType dtype, bool fp8) {
  bool f32 = false, f32_fp8 = false, bf16 = false, bf16_fp8 = false, f16 = false;
#ifdef PDSERVE_ATTENTION_F32
  f32 = true;
#endif
#ifdef PDSERVE_ATTENTION_F32_FP8
  f32_fp8 = true;
#endif
#ifdef PDSERVE_ATTENTION_BF16
  bf16 = true;
#endif
#ifdef PDSERVE_ATTENTION_BF16_FP8
  bf16_fp8 = true;
#endif
#ifdef PDSERVE_ATTENTION_F16
  f16 = true;
#endif
  if (dtype == at::kFloat) return fp8 ? f32_fp8 : f32;
  if (dtype == at::kBFloat16) return fp8 ? bf16_fp8 : bf16;
  return !fp8 && f16;
}

// Raises where this build has no kernel for dtype queries over cache_dtype caches.
void check_has_pair(at::ScalarType dtype, at::ScalarType cache_dtype) {
  PDSERVE_CHECK_VALUE(has_pair(dtype, is_fp8(cache_dtype)), "this build of the native CPU attention has no kernel for ",
                      dtype, " queries over ", cache_dtype, " caches (PDSERVE_ATTENTION_DTYPES=all builds every pair)");
}

// f(T{}, C{}) for the call's dtype T and its cache's C: T's own, or fp8 codes for float32
// and bfloat16 (checked by plan_call).
template <typename F>
void with_dtypes(at::ScalarType dtype, at::ScalarType cache_dtype, F&& f) {
  check_has_pair(dtype, cache_dtype);
  // Only the pairs has_pair names are instantiated: the rest are never compiled.
  auto with_cache = [&]<typename T, bool kOwn, bool kFp8>() {
    if (is_fp8(cache_dtype)) {
      if constexpr (kFp8) {
        if (cache_dtype == at::kFloat8_e4m3fn) f(T{}, c10::Float8_e4m3fn{});
        else f(T{}, c10::Float8_e5m2{});
      }
    } else if constexpr (kOwn) {
      f(T{}, T{});
    }
  };
  switch (dtype) {
    case at::kFloat:
      with_cache.template operator()<float, has_pair(at::kFloat, false), has_pair(at::kFloat, true)>();
      break;
    case at::kBFloat16:
      with_cache.template operator()<c10::BFloat16, has_pair(at::kBFloat16, false), has_pair(at::kBFloat16, true)>();
      break;
    default:
      with_cache.template operator()<c10::Half, has_pair(at::kHalf, false), false>();
      break;
  }
}

at::Tensor paged_attention(const at::Tensor& q,            // [num_tokens, num_q_heads, head_dim]
                           const at::Tensor& k_cache,      // [num_blocks, block_size, num_kv_heads, head_dim]
                           const at::Tensor& v_cache,      // [num_blocks, block_size, num_kv_heads, head_dim]
                           const at::Tensor& block_tables,     // [num_seqs, max_blocks] int32
                           const at::Tensor& query_start_loc,  // [num_seqs + 1] int32
                           const at::Tensor& seq_lens,         // [num_seqs] int32
                           double scale, int64_t sliding_window, double logit_softcap) {
  CallPlan plan = plan_call(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window,
                            logit_softcap, at::get_num_threads());
  std::atomic<int64_t> next{0};
  std::vector<int64_t> paired_offsets, values_offsets;  // pair_prompts' or transpose_prompts'
  with_dtypes(q.scalar_type(), k_cache.scalar_type(), [&](auto dtype_tag, auto cache_tag) {
    using T = decltype(dtype_tag);
    using C = decltype(cache_tag);
#ifdef PDSERVE_BF16_DOT
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      if (plan.problem.head_dim % 64 == 0 && plan.problem.head_dim <= 256 && plan.problem.block_size % 16 == 0)
        pair_prompts<C>(plan.problem, seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
                        block_tables.size(0), paired_offsets);
#endif
    if constexpr (std::is_same_v<T, float> && std::is_same_v<C, float>)
      if (plan.problem.head_dim % kLanes == 0 && plan.problem.block_size % 16 == 0)
        transpose_prompts(plan.problem, seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
                          block_tables.size(0), paired_offsets, values_offsets);
    at::parallel_for(0, plan.num_workers, 1, [&](int64_t, int64_t) { claim_work<T, C>(plan, next); });
    for (const SplitToken& split : plan.splits) merge_split_token<T>(plan.problem, split);
  });
  return plan.out;
}

}  // namespace

namespace pdserve_cpu {
struct TeamAttention {
  CallPlan plan;
  std::atomic<int64_t> next{0};
  at::Tensor k, v, slot_mapping;  // the step's new K/V [num_tokens, num_kv_heads, head_dim] and their slots
  at::ScalarType cache_dtype;
};
}  // namespace pdserve_cpu

namespace {
using pdserve_cpu::TeamAttention;

// The KV-write checks of paged_attention_with_kv_write.
void check_kv_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& slot_mapping) {
  PDSERVE_CHECK_VALUE(
      k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
      "bad k/v/cache shapes");
  PDSERVE_CHECK_VALUE(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), "k/v heads do not match the cache");
  PDSERVE_CHECK_VALUE(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type() &&
                          (k.scalar_type() == k_cache.scalar_type() ||
                           (is_fp8(k_cache.scalar_type()) &&
                            (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16))),
                      "k/v dtype ", k.scalar_type(), " does not go into a ", k_cache.scalar_type(),
                      " cache (the cache holds k's dtype, or fp8 codes of float32 or bfloat16)");
  PDSERVE_CHECK_VALUE(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(),
                      "k/v must be contiguous in head_dim and the caches contiguous");
  PDSERVE_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                          slot_mapping.numel() == k.size(0),
                      "slot_mapping must be [num_tokens] int64");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t)
    PDSERVE_CHECK_VALUE(slots[t] < num_slots, "slot ", slots[t], " of token ", t, " is past the cache's ", num_slots);
}

// Tokens [token_begin, token_end)'s K and V each at its slot (block * block_size + offset;
// < 0: padding, skipped).
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slot_mapping, int64_t token_begin, int64_t token_end) {
  const int64_t num_kv_heads = k.size(1), elem = k.element_size();
  const int64_t row_bytes = k.size(2) * elem;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto* k_dst = static_cast<char*>(k_cache.data_ptr());
  auto* v_dst = static_cast<char*>(v_cache.data_ptr());
  const auto* k_src = static_cast<const char*>(k.data_ptr());
  const auto* v_src = static_cast<const char*>(v.data_ptr());
  if (is_fp8(k_cache.scalar_type())) {
    with_dtypes(k.scalar_type(), k_cache.scalar_type(), [&](auto dtype_tag, auto cache_tag) {
      using T = decltype(dtype_tag);
      using C = decltype(cache_tag);
      if constexpr (kIsFp8<C>) {
        const int64_t head_dim = k.size(2);
        for (int64_t t = token_begin; t < token_end; ++t) {
          if (slots[t] < 0) continue;
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            const int64_t dst = (slots[t] * num_kv_heads + h) * head_dim;
            quantize_fp8<C>(k.data_ptr<T>() + t * k.stride(0) + h * k.stride(1),
                            reinterpret_cast<uint8_t*>(k_dst) + dst, head_dim);
            quantize_fp8<C>(v.data_ptr<T>() + t * v.stride(0) + h * v.stride(1),
                            reinterpret_cast<uint8_t*>(v_dst) + dst, head_dim);
          }
        }
      }
    });
    return;
  }
  for (int64_t t = token_begin; t < token_end; ++t) {
    if (slots[t] < 0) continue;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t dst = (slots[t] * num_kv_heads + h) * row_bytes;
      std::memcpy(k_dst + dst, k_src + (t * k.stride(0) + h * k.stride(1)) * elem, row_bytes);
      std::memcpy(v_dst + dst, v_src + (t * v.stride(0) + h * v.stride(1)) * elem, row_bytes);
    }
  }
}

TeamAttention* team_begin(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                          int64_t sliding_window, int64_t num_threads) {
  check_kv_write(k, v, k_cache, v_cache, slot_mapping);
  check_has_pair(q.scalar_type(), k_cache.scalar_type());  // here, not inside the caller's parallel region
  auto team = std::make_unique<TeamAttention>();
  team->plan = plan_call(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window, 0.0,
                         num_threads);
  // Every block a sequence's keys lie in, checked here rather than as the items read them
  // (item_block_id), which would raise inside the caller's parallel region.
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const Problem& pr = team->plan.problem;
  for (int64_t i = 0; i < block_tables.size(0); ++i)
    for (int64_t b = 0; b < (lens[i] + pr.block_size - 1) / pr.block_size; ++b) checked_block_id(pr, i, b);
  team->k = k;
  team->v = v;
  team->slot_mapping = slot_mapping;
  team->cache_dtype = k_cache.scalar_type();
  return team.release();
}

void team_write(TeamAttention* team, const at::Tensor& k_cache, const at::Tensor& v_cache, int t,
                int64_t token_begin, int64_t token_end) {
  write_kv(team->k, team->v, k_cache, v_cache, team->slot_mapping, token_begin, token_end);
  if (t == 0) {
    CallPlan& plan = team->plan;
    plan.problem.k = k_cache.data_ptr();
    plan.problem.v = v_cache.data_ptr();
    team->next.store(0);
  }
}

void team_attend(TeamAttention* team, int t) {
  CallPlan& plan = team->plan;
  with_dtypes(plan.out.scalar_type(), team->cache_dtype, [&](auto dtype_tag, auto cache_tag) {
    using T = decltype(dtype_tag);
    claim_work<T, decltype(cache_tag)>(plan, team->next);
#pragma omp barrier
    // Split tokens' parts merged (on the first thread), and a barrier after them; none for
    // a step without splits.
    if (!plan.splits.empty()) {
      if (t == 0)
        for (const SplitToken& split : plan.splits) merge_split_token<T>(plan.problem, split);
#pragma omp barrier
    }
  });
}

at::Tensor team_out(TeamAttention* team) { return team->plan.out; }

void team_end(TeamAttention* team) { delete team; }

const pdserve_cpu::TeamAttentionApi kTeamAttentionApi{&team_begin, &team_write, &team_attend, &team_out,
                                                     &team_end};

// The address of kTeamAttentionApi, for decode_layers.cpp (attention_team.h).
int64_t team_attention_api() { return reinterpret_cast<int64_t>(&kTeamAttentionApi); }

// Writes each new token's K and V at its slot (block * block_size + offset; < 0: padding,
// skipped), then attends: the whole of one layer's attention in one call.
at::Tensor paged_attention_with_kv_write(const at::Tensor& q,        // [num_tokens, num_q_heads, head_dim]
                                         const at::Tensor& k,        // [num_tokens, num_kv_heads, head_dim]
                                         const at::Tensor& v,        // [num_tokens, num_kv_heads, head_dim]
                                         const at::Tensor& k_cache,  // [num_blocks, block_size, num_kv_heads, head_dim]
                                         const at::Tensor& v_cache,  // [num_blocks, block_size, num_kv_heads, head_dim]
                                         const at::Tensor& slot_mapping,     // [num_tokens] int64
                                         const at::Tensor& block_tables,     // [num_seqs, max_blocks] int32
                                         const at::Tensor& query_start_loc,  // [num_seqs + 1] int32
                                         const at::Tensor& seq_lens,         // [num_seqs] int32
                                         double scale, int64_t sliding_window, double logit_softcap) {
  check_kv_write(k, v, k_cache, v_cache, slot_mapping);
  write_kv(k, v, k_cache, v_cache, slot_mapping, 0, k.size(0));
  return paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window,
                         logit_softcap);
}


// The step's ragged batch (every sequence's block table, query starts and lengths, and
// each new token's slot), published by the runner's forward context for this thread while
// one forward pass runs (kernels/cpu_attention.publish_step). Unset where a step needs
// more than the fused kernel does (a KV-connector hook per layer, no ragged batch).
struct StepBatch {
  at::Tensor slot_mapping, block_tables, query_start_loc, seq_lens;
};
thread_local std::optional<StepBatch> current_step;

void set_step(const std::optional<at::Tensor>& slot_mapping, const std::optional<at::Tensor>& block_tables,
              const std::optional<at::Tensor>& query_start_loc, const std::optional<at::Tensor>& seq_lens) {
  if (!slot_mapping.has_value()) {
    current_step.reset();
    return;
  }
  PDSERVE_CHECK_VALUE(block_tables.has_value() && query_start_loc.has_value() && seq_lens.has_value(),
                      "set_step: a step needs its slot mapping, block tables, query starts and sequence lengths");
  current_step = StepBatch{*slot_mapping, *block_tables, *query_start_loc, *seq_lens};
}

bool has_step() { return current_step.has_value(); }

// One layer's attention as a compiled graph calls it: with the step published and
// contiguous caches, the fused write-and-attend kernel straight from C++; otherwise the
// Python op pdserve::paged_attention (common/engine/models/attention.py), which reads the
// step from the forward context. In C++ the common case saves that op's ~35 us per layer.
// layer_idx is a 0-d tensor (only the Python op reads it, for the KV connector's per-layer
// hook) so that one compiled decoder layer serves every layer.
at::Tensor layer_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, double scale, const at::Tensor& layer_idx,
                           std::optional<int64_t> sliding_window, std::optional<double> logit_softcap) {
  if (current_step.has_value() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
      has_pair(q.scalar_type(), is_fp8(k_cache.scalar_type()))) {
    PDSERVE_CHECK_VALUE(!sliding_window.has_value() || *sliding_window >= 1,
                        "sliding_window must be a positive number of positions, got ", *sliding_window);
    PDSERVE_CHECK_VALUE(!logit_softcap.has_value() || *logit_softcap > 0, "logit_softcap must be positive, got ",
                        *logit_softcap);
    const StepBatch& step = *current_step;
    return paged_attention_with_kv_write(q, k, v, k_cache, v_cache, step.slot_mapping, step.block_tables,
                                         step.query_start_loc, step.seq_lens, scale, sliding_window.value_or(0),
                                         logit_softcap.value_or(0.0));
  }
  static const auto python_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pdserve::paged_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, double, const at::Tensor&, std::optional<int64_t>,
                            std::optional<double>)>();
  return python_op.call(q, k, v, k_cache, v_cache, scale, layer_idx, sliding_window, logit_softcap);
}

}  // namespace

// The head dims this build unrolled its loops for (the rest take the generic loops).
std::vector<int64_t> specialised_head_dims() {
  std::vector<int64_t> dims;
#ifdef PDSERVE_ATTENTION_HD64
  dims.push_back(64);
#endif
#ifdef PDSERVE_ATTENTION_HD128
  dims.push_back(128);
#endif
#ifdef PDSERVE_ATTENTION_HD256
  dims.push_back(256);
#endif
  return dims;
}

// The (query, cache) dtype pairs this build holds kernels for: float32, float32/fp8,
// bfloat16, bfloat16/fp8, float16.
std::vector<std::string> dtype_pairs() {
  std::vector<std::string> pairs;
  if (has_pair(at::kFloat, false)) pairs.push_back("float32");
  if (has_pair(at::kFloat, true)) pairs.push_back("float32/fp8");
  if (has_pair(at::kBFloat16, false)) pairs.push_back("bfloat16");
  if (has_pair(at::kBFloat16, true)) pairs.push_back("bfloat16/fp8");
  if (has_pair(at::kHalf, false)) pairs.push_back("float16");
  return pairs;
}

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("specialised_head_dims() -> int[]", &specialised_head_dims);
  m.def("dtype_pairs() -> str[]", &dtype_pairs);
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, float scale, int sliding_window, float logit_softcap) -> Tensor");
  m.def("paged_attention_with_kv_write(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, "
        "int sliding_window, float logit_softcap) -> Tensor");
  m.def("set_step(Tensor? slot_mapping, Tensor? block_tables, Tensor? query_start_loc, Tensor? seq_lens) -> ()",
        &set_step);
  m.def("has_step() -> bool", &has_step);
  m.def("team_attention_api() -> int", &team_attention_api);
  m.def("layer_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, float scale, "
        "Tensor layer_idx, int? sliding_window, float? logit_softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_with_kv_write", &paged_attention_with_kv_write);
  m.impl("layer_attention", &layer_attention);
}

#endif  // PDSERVE_BUILD_PART 0

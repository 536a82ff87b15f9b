// Scores of a bf16 query row against bf16 cache keys with AVX512-BF16 dot products
// (vdpbf16ps: bf16 pairs multiplied exactly, summed in fp32). For decode rows this
// replaces a bf16 -> fp32 conversion of every key and a horizontal sum per key: the
// partial sums of 16 keys are reduced together (transpose_sum16).
#pragma once

#include "vec_math.h"

#ifdef PDSERVE_BF16_DOT
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

#include "transpose16.h"

namespace pdserve_cpu {

// scores[j] = scale * (q . k_j) for j in [begin, end), written 16 at a time from begin
// rounded down to 16 (the score row is padded to whole vectors; keys outside
// [begin, end) get some in-range key's score, which the softmax masks).
template <int64_t kHeadDim>
inline void row_scores_bf16(const c10::BFloat16* q_row, const c10::BFloat16* k_block, int64_t k_pos_stride,
                            int64_t begin, int64_t end, float scale, float* scores) {
  static_assert(kHeadDim % kBf16PerVec == 0);
  constexpr int64_t kNumVec = kHeadDim / kBf16PerVec;
  __m512bh q[kNumVec];
  for (int64_t v = 0; v < kNumVec; ++v) q[v] = load_bf16x32(q_row + v * kBf16PerVec);
  const __m512 scale_vec = _mm512_set1_ps(scale);
  for (int64_t first = begin / 16 * 16; first < end; first += 16) {
    __m512 partial[16];
#pragma GCC unroll 16
    for (int64_t i = 0; i < 16; ++i) {
      const c10::BFloat16* k = k_block + std::clamp(first + i, begin, end - 1) * k_pos_stride;
      __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], load_bf16x32(k));
      for (int64_t v = 1; v < kNumVec; ++v) acc = _mm512_dpbf16_ps(acc, q[v], load_bf16x32(k + v * kBf16PerVec));
      partial[i] = acc;
    }
    _mm512_storeu_ps(scores + first, _mm512_mul_ps(transpose_sum16(partial), scale_vec));
  }
}

// Words of the buffer each of transposed_scores_bf16 and transposed_accumulate_bf16 fills
// with a block's K or V in pairs, 16 keys at a time.
template <int64_t kHeadDim>
constexpr int64_t kBf16PairWords = kHeadDim / 2 * 16;

// The 16 keys' K rows from `first` as words of d pairs transposed: k_pairs[i * 16 + j] =
// (k_{first + j}[2i], k_{first + j}[2i + 1]); keys outside [keys_begin, keys_end) zero (never
// read from the block). k_pairs: a 64-byte aligned buffer of kBf16PairWords<kHeadDim> words.
template <int64_t kHeadDim>
inline void pair_key_rows(const c10::BFloat16* k_block, int64_t k_pos_stride, int64_t first, int64_t keys_begin,
                          int64_t keys_end, uint32_t* k_pairs) {
  // In registers and whole-vector stores: 512 scattered word stores here would stall the
  // vector loads after them, and alias K's loads at random 4 KB offsets (ASLR).
  for (int64_t i0 = 0; i0 < kHeadDim / 2; i0 += 16)
    transpose_key_words16(k_block + 2 * i0, k_pos_stride, first, keys_begin, keys_end, k_pairs + i0 * 16, 16);
}

// Many rows (prefill tiles), bf16 dot products on both products of a block, 16 keys at a
// time: twice the multiply-adds per instruction of the fp32 FMAs, and no widening of K or V.
//
// Scores: the keys' 32-bit words of d pairs transposed so that lane j holds key j's pair
// (k_j[2i], k_j[2i + 1]); each row's scores for 16 keys are then kHeadDim / 2 dot products
// against the row's pair broadcast, no horizontal sums. scores[r * score_stride + j] =
// scale * (q_r . k_j) for the 16 keys of k_pairs (pair_key_rows' layout, 64-byte aligned).
template <int64_t kHeadDim>
inline void paired_scores_bf16(const c10::BFloat16* q_rows, int64_t num_rows, const uint32_t* k_pairs, float scale,
                               int64_t score_stride, float* scores) {
  static_assert(kHeadDim % kBf16PerVec == 0);
  constexpr int64_t kPairs = kHeadDim / 2;
  typedef uint32_t __attribute__((may_alias)) Word;  // read from bf16 storage
  const auto* q_words = reinterpret_cast<const Word*>(q_rows);  // [num_rows, kPairs]
  const __m512 scale_vec = _mm512_set1_ps(scale);
  auto pair = [](const Word* words, int64_t i) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(words[i])); };
  auto keys = [&](int64_t i) { return (__m512bh)_mm512_load_si512(k_pairs + i * 16); };
  // R rows x even and odd pairs: 2R dot-product chains, 16 for 8 rows (vdpbf16ps's latency
  // times its throughput wants ~12 in flight).
  auto pass = [&]<int R>(int64_t r) {
    const Word* q = q_words + r * kPairs;
    __m512 even[R], odd[R];
    for (int m = 0; m < R; ++m) even[m] = odd[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kPairs; i += 2) {
      const __m512bh k_even = keys(i), k_odd = keys(i + 1);
      for (int m = 0; m < R; ++m) {
        even[m] = _mm512_dpbf16_ps(even[m], k_even, pair(q + m * kPairs, i));
        odd[m] = _mm512_dpbf16_ps(odd[m], k_odd, pair(q + m * kPairs, i + 1));
      }
    }
    for (int m = 0; m < R; ++m)
      _mm512_storeu_ps(scores + (r + m) * score_stride, _mm512_mul_ps(_mm512_add_ps(even[m], odd[m]), scale_vec));
  };
  int64_t r = 0;
  for (; r + 8 <= num_rows; r += 8) pass.template operator()<8>(r);
  for (; r + 4 <= num_rows; r += 4) pass.template operator()<4>(r);
  for (; r < num_rows; ++r) pass.template operator()<1>(r);
}

// paired_scores_bf16 over a cache block's keys, paired 16 at a time into k_pairs (a 64-byte
// aligned buffer of kBf16PairWords<kHeadDim> words): scores for j in whole 16s around
// [keys_begin, keys_end); keys outside it score 0 (zeroed, never read from the block),
// which the softmax masks.
template <int64_t kHeadDim>
inline void transposed_scores_bf16(const c10::BFloat16* q_rows, int64_t num_rows, const c10::BFloat16* k_block,
                                   int64_t k_pos_stride, int64_t keys_begin, int64_t keys_end, float scale,
                                   int64_t score_stride, float* scores, uint32_t* k_pairs) {
  for (int64_t first = keys_begin / 16 * 16; first < keys_end; first += 16) {
    pair_key_rows<kHeadDim>(k_block, k_pos_stride, first, keys_begin, keys_end, k_pairs);
    paired_scores_bf16<kHeadDim>(q_rows, num_rows, k_pairs, scale, score_stride, scores + first);
  }
}

// The 16 keys' V rows from `first` in pairs: v_pairs[(pair * (kHeadDim / 16) + chunk) * 16 + d]
// = (v_{first + 2 pair}[16 chunk + d], v_{first + 2 pair + 1}[16 chunk + d]) as one 32-bit word,
// V = 0 for keys outside [keys_begin, keys_end) (their cache slots may hold anything, NaN
// bits included). v_pairs: a 64-byte aligned buffer of kBf16PairWords<kHeadDim> words.
template <int64_t kHeadDim>
inline void pair_value_rows(const c10::BFloat16* v_block, int64_t v_pos_stride, int64_t first, int64_t keys_begin,
                            int64_t keys_end, uint32_t* v_pairs) {
  static_assert(kHeadDim % kBf16PerVec == 0);
  constexpr int64_t kChunks = kHeadDim / 16;
  // vpermt2w indices: word w of the low half = (a[w], b[w]), of the high half (a[16 + w], b[16 + w]).
  alignas(64) static constexpr int16_t kLowIndex[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr int16_t kHighIndex[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                         24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLowIndex), high = _mm512_load_si512(kHighIndex);
  auto v_row = [&](int64_t key, int64_t c2) {  // 32 values of key's V from d = 32 c2; zero outside the range
    if (key < keys_begin || key >= keys_end) return _mm512_setzero_si512();
    return _mm512_loadu_si512(static_cast<const void*>(v_block + key * v_pos_stride + 32 * c2));
  };
  for (int64_t pair = 0; pair < 8; ++pair)
    for (int64_t c2 = 0; c2 < kChunks / 2; ++c2) {
      const __m512i a = v_row(first + 2 * pair, c2), b = v_row(first + 2 * pair + 1, c2);
      _mm512_store_si512(v_pairs + (pair * kChunks + 2 * c2) * 16, _mm512_permutex2var_epi16(a, low, b));
      _mm512_store_si512(v_pairs + (pair * kChunks + 2 * c2 + 1) * 16, _mm512_permutex2var_epi16(a, high, b));
    }
}

// Which of the 16 keys from `first` lie in [keys_begin, keys_end).
inline __mmask16 keys_in_range(int64_t first, int64_t keys_begin, int64_t keys_end) {
  return static_cast<__mmask16>(((1u << std::min<int64_t>(16, keys_end - first)) - 1) &
                                ~((1u << std::max<int64_t>(0, keys_begin - first)) - 1));
}

// acc_r += sum_j p_r[j] v_j over the block's keys in [keys_begin, keys_end), for many rows:
// p rounded to bf16 (as flash attention's P.V on GPUs; the sums stay fp32), V's rows
// interleaved in pairs (pair_value_rows) so that lane d of a 32-bit word holds
// (v_j[d], v_{j+1}[d]) and each row adds two keys per dot product. Keys outside the range
// take p = 0 and V = 0. acc: [num_rows, kHeadDim] fp32; v_pairs: a 64-byte aligned buffer
// of kBf16PairWords<kHeadDim> words.
template <int64_t kHeadDim>
inline void transposed_accumulate_bf16(float* acc, int64_t num_rows, const float* p_rows, int64_t p_stride,
                                       const c10::BFloat16* v_block, int64_t v_pos_stride, int64_t keys_begin,
                                       int64_t keys_end, uint32_t* v_pairs) {
  static_assert(kHeadDim % kBf16PerVec == 0);
  constexpr int64_t kChunks = kHeadDim / 16;  // fp32 accumulators per row
  // Rows per pass: their accumulators, one chunk's V pairs and the broadcast p fit 32 registers.
  constexpr int64_t kRows = kChunks >= 16 ? 1 : 24 / kChunks;
  // v_pairs[(pair * kChunks + chunk) * 16 + d]: key pair, chunk of 16 d, d
  auto pairs_at = [&](int64_t pair, int64_t chunk) { return v_pairs + (pair * kChunks + chunk) * 16; };
  for (int64_t first = keys_begin / 16 * 16; first < keys_end; first += 16) {
    pair_value_rows<kHeadDim>(v_block, v_pos_stride, first, keys_begin, keys_end, v_pairs);
    const __mmask16 in_range = keys_in_range(first, keys_begin, keys_end);
    auto pass = [&]<int64_t R>(int64_t r) {
      uint32_t p_words[R][8];  // the rows' p in bf16, two keys a word
      for (int64_t m = 0; m < R; ++m) {
        const __m256bh p = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(in_range, p_rows + (r + m) * p_stride + first));
        std::memcpy(p_words[m], &p, sizeof p);
      }
      __m512 sums[R][kChunks];
      for (int64_t m = 0; m < R; ++m)
        for (int64_t c = 0; c < kChunks; ++c) sums[m][c] = _mm512_loadu_ps(acc + (r + m) * kHeadDim + 16 * c);
      for (int64_t pair = 0; pair < 8; ++pair)
        for (int64_t c = 0; c < kChunks; ++c) {
          const __m512bh v = (__m512bh)_mm512_load_si512(pairs_at(pair, c));
          for (int64_t m = 0; m < R; ++m)
            sums[m][c] = _mm512_dpbf16_ps(sums[m][c], v, (__m512bh)_mm512_set1_epi32(static_cast<int>(p_words[m][pair])));
        }
      for (int64_t m = 0; m < R; ++m)
        for (int64_t c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc + (r + m) * kHeadDim + 16 * c, sums[m][c]);
    };
    int64_t r = 0;
    for (; r + kRows <= num_rows; r += kRows) pass.template operator()<kRows>(r);
    for (; r < num_rows; ++r) pass.template operator()<1>(r);
  }
}

// acc [num_rows, kHeadDim] = P V (add: acc += P V) over num_keys keys (a multiple of 16), for
// the whole-rows form: p [num_rows, num_keys] the probabilities in bf16, V in pairs 16 keys at
// a time (pair_value_rows' layout), group g's at v_pairs + g * group_stride (words). Each pass
// holds kRows rows' accumulators in registers across every key, where the block-by-block
// form loads and stores them per block.
template <int64_t kHeadDim>
inline void whole_rows_accumulate_bf16(float* acc, int64_t num_rows, const c10::BFloat16* p, int64_t num_keys,
                                       const uint32_t* v_pairs, int64_t group_stride, bool add) {
  static_assert(kHeadDim % kBf16PerVec == 0);
  constexpr int64_t kChunks = kHeadDim / 16;  // fp32 accumulators per row
  constexpr int64_t kRows = kChunks >= 16 ? 1 : 24 / kChunks;
  typedef uint32_t __attribute__((may_alias)) Word;  // two keys' p, read from bf16 storage
  auto pass = [&]<int64_t R>(int64_t r) {
    __m512 sums[R][kChunks];
    for (int64_t m = 0; m < R; ++m)
      for (int64_t c = 0; c < kChunks; ++c)
        sums[m][c] = add ? _mm512_loadu_ps(acc + (r + m) * kHeadDim + 16 * c) : _mm512_setzero_ps();
    for (int64_t g = 0; g < num_keys / 16; ++g) {
      const uint32_t* pairs = v_pairs + g * group_stride;
      for (int64_t pair = 0; pair < 8; ++pair) {
        __m512bh p_pair[R];
        for (int64_t m = 0; m < R; ++m)
          p_pair[m] = (__m512bh)_mm512_set1_epi32(
              static_cast<int>(reinterpret_cast<const Word*>(p + (r + m) * num_keys + g * 16)[pair]));
        for (int64_t c = 0; c < kChunks; ++c) {
          const __m512bh v = (__m512bh)_mm512_load_si512(pairs + (pair * kChunks + c) * 16);
          for (int64_t m = 0; m < R; ++m) sums[m][c] = _mm512_dpbf16_ps(sums[m][c], v, p_pair[m]);
        }
      }
    }
    for (int64_t m = 0; m < R; ++m)
      for (int64_t c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc + (r + m) * kHeadDim + 16 * c, sums[m][c]);
  };
  int64_t r = 0;
  for (; r + kRows <= num_rows; r += kRows) pass.template operator()<kRows>(r);
  for (; r < num_rows; ++r) pass.template operator()<1>(r);
}

}  // namespace pdserve_cpu
#endif

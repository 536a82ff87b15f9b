// Paged attention on CPU that reads K/V in place from the block-table cache.
//
// One op serves decode and ragged prefill (decode is prefill with one query per
// sequence): query row j of sequence i sits at position context_len + j and sees the
// keys (position - sliding_window, position] clipped to [0, position]. Each work item
// is (sequence, kv head, tile of query tokens): its query heads share every K/V row
// it loads, and an online softmax (flash style) runs over the cache blocks, so
// nothing is gathered and the scores never exceed one block per query row.
// Math is fp32 whatever the cache dtype. Bad arguments raise ValueError, as the torch path does.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kQueryTile = 16;  // query tokens per work item in prefill chunks

struct WorkItem {
  int64_t seq;
  int64_t first_token;  // index into q
  int64_t num_tokens;
  int64_t first_position;  // position of first_token in its sequence
};

template <typename T>
inline float dot(const float* __restrict q, const T* __restrict k, int64_t head_dim) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < head_dim; ++d) acc += q[d] * static_cast<float>(k[d]);
  return acc;
}

template <typename T>
inline void axpy(float* __restrict acc, float p, const T* __restrict v, int64_t head_dim) {
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * static_cast<float>(v[d]);
}

template <typename T>
void attend_item(const WorkItem& item, int64_t kv_head, const at::Tensor& q, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const int32_t* block_table, int64_t num_blocks, float scale,
                 int64_t sliding_window, float logit_softcap, at::Tensor& out, std::vector<float>& scratch) {
  const int64_t num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), group = num_q_heads / k_cache.size(2);
  const int64_t num_rows = item.num_tokens * group;  // row r: token r / group, head r % group
  const int64_t acc_size = num_rows * head_dim;
  scratch.resize(2 * acc_size + 2 * num_rows + block_size);
  float* q_rows = scratch.data();            // [num_rows, head_dim], scaled
  float* acc = q_rows + acc_size;            // [num_rows, head_dim]
  float* row_max = acc + acc_size;           // [num_rows]
  float* row_sum = row_max + num_rows;       // [num_rows]
  float* scores = row_sum + num_rows;        // [block_size]
  std::fill(acc, acc + acc_size, 0.f);
  std::fill(row_max, row_max + num_rows, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + num_rows, 0.f);

  const T* q_ptr = q.data_ptr<T>();
  for (int64_t r = 0; r < num_rows; ++r) {
    const T* src = q_ptr + (item.first_token + r / group) * q.stride(0) +
                   (kv_head * group + r % group) * q.stride(1);
    for (int64_t d = 0; d < head_dim; ++d) q_rows[r * head_dim + d] = static_cast<float>(src[d]) * scale;
  }
  // Visible keys of the token at position p: [first_key(p), p].
  auto first_key = [&](int64_t p) { return sliding_window > 0 ? std::max<int64_t>(0, p - sliding_window + 1) : 0; };
  const int64_t last_position = item.first_position + item.num_tokens - 1;
  const int64_t lo = first_key(item.first_position), hi = last_position + 1;  // the tile's keys [lo, hi)

  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int64_t k_block_stride = k_cache.stride(0), k_pos_stride = k_cache.stride(1);
  const int64_t v_block_stride = v_cache.stride(0), v_pos_stride = v_cache.stride(1);
  const T* k_head = k_ptr + kv_head * k_cache.stride(2);
  const T* v_head = v_ptr + kv_head * v_cache.stride(2);

  for (int64_t b = lo / block_size; b * block_size < hi; ++b) {
    const int64_t block_id = block_table[b];
    TORCH_CHECK_VALUE(block_id >= 0 && block_id < num_blocks, "block table entry ", block_id, " of sequence ",
                item.seq, " is outside the cache's ", num_blocks, " blocks");
    const int64_t block_start = b * block_size;
    const T* k_block = k_head + block_id * k_block_stride;
    const T* v_block = v_head + block_id * v_block_stride;
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t position = item.first_position + r / group;
      const int64_t begin = std::max(first_key(position), block_start) - block_start;
      const int64_t end = std::min(position + 1, block_start + block_size) - block_start;
      if (begin >= end) continue;
      const float* q_row = q_rows + r * head_dim;
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = begin; j < end; ++j) {
        float s = dot(q_row, k_block + j * k_pos_stride, head_dim);
        if (logit_softcap > 0.f) s = std::tanh(s / logit_softcap) * logit_softcap;
        scores[j] = s;
        block_max = std::max(block_max, s);
      }
      float* acc_row = acc + r * head_dim;
      const float new_max = std::max(row_max[r], block_max);
      if (new_max > row_max[r] && row_sum[r] > 0.f) {  // rescale what earlier blocks accumulated
        const float correction = std::exp(row_max[r] - new_max);
        row_sum[r] *= correction;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) acc_row[d] *= correction;
      }
      row_max[r] = new_max;
      float sum = 0.f;
      for (int64_t j = begin; j < end; ++j) {
        const float p = std::exp(scores[j] - new_max);
        sum += p;
        axpy(acc_row, p, v_block + j * v_pos_stride, head_dim);
      }
      row_sum[r] += sum;
    }
  }
  T* out_ptr = out.data_ptr<T>();
  for (int64_t r = 0; r < num_rows; ++r) {
    T* dst = out_ptr + (item.first_token + r / group) * out.stride(0) + (kv_head * group + r % group) * out.stride(1);
    const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc[r * head_dim + d] * inv);
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
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0), num_blocks = k_cache.size(0);
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_attention", [&] {
    at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
      std::vector<float> scratch;
      for (int64_t i = next++; i < num_work; i = next++) {
        const int64_t w = order[i];
        const WorkItem& item = items[w / num_kv_heads];
        attend_item<scalar_t>(item, w % num_kv_heads, q, k_cache, v_cache, tables + item.seq * table_stride,
                              num_blocks, static_cast<float>(scale), sliding_window,
                              static_cast<float>(logit_softcap), out, scratch);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, float scale, int sliding_window, float logit_softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }

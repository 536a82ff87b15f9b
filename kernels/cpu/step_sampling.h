// How a decode_tokens step (decode_layers.cpp) takes each row's next token from the head's
// logits, on the thread that owns the row: its argmax, or its draw (temperature, top_k,
// top_p, min_p: sample_row.h's passes) at a uniform the sampler drew, after its penalties and
// held-back stop tokens, and its logprobs; and decode_tokens' sampling arguments checked into
// the step's form (StepSampling's Truncations and RowHistories).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "argmax.h"
#include "check_message.h"
#include "sample_row.h"
#include "vec_math.h"

namespace pdserve_cpu::sampling {

// How a decode_tokens step takes each row's next token from the head's logits.
struct StepSampling {
  // [M] fp32: > 0 draws the row from softmax(logits / temperature), else takes its argmax;
  // nullptr: every row its argmax.
  const float* temperatures = nullptr;
  const Truncation* truncations = nullptr;  // [M]; with temperatures
  const double* uniforms = nullptr;  // [M] in [0, 1): this step's draw of each row
  // [M, the head's outputs] the model's dtype: where the head writes its logits, for the
  // caller to sample rows from too; nullptr: a buffer of the step's own.
  void* logits = nullptr;
  // [M]: < 0 the row reports no logprobs, else its taken token's and its top num_logprobs[m]
  // tokens' (the sampler's: the log-softmax of the logits before temperature and truncation);
  // nullptr: none does.
  const int64_t* num_logprobs = nullptr;
  int64_t max_logprobs = 0;  // the largest of num_logprobs: the top tokens' room in each row
  float* logprobs = nullptr;  // [M, 1 + max_logprobs] this step's: the taken token's, then the top ones'
  int64_t* logprob_token_ids = nullptr;  // [M, max_logprobs] this step's top tokens, most likely first
  // [M] what each row's tokens so far do to its logits (RowHistory: penalties, stop tokens held
  // back; a row with neither: nothing), applied to them as fp32 before its argmax, logprobs
  // and draw, then told the token it took; nullptr: no row has any.
  RowHistory* histories = nullptr;
};

// Whether row m of a step draws its token (else it takes its argmax).
inline bool draws(const StepSampling& sampling, int64_t m) {
  return sampling.temperatures != nullptr && sampling.temperatures[m] > 0.f;
}

// Whether row m's tokens so far change its logits this step (penalties, stop tokens held back).
inline bool has_history(const StepSampling& sampling, int64_t m) {
  return sampling.histories != nullptr && sampling.histories[m].any();
}

// Whether row m of a step reports logprobs.
inline bool reports_logprobs(const StepSampling& sampling, int64_t m) {
  return sampling.num_logprobs != nullptr && sampling.num_logprobs[m] >= 0;
}

// What a thread's draws reuse from row to row: the row as fp32 (its history applied, and as
// drawn), the truncations' scratch and the logprobs' top tokens.
struct DrawScratch {
  std::vector<float> with_history;
  std::vector<float> row;
  RowScratch truncation;
  std::vector<std::pair<float, int64_t>> top;
};

// Row m's token drawn from its logits [vocab_size] (the head's dtype) as the sampler draws it:
// widened to fp32 and divided by the temperature (the sampler's copy and division, the same
// bits), truncated, then drawn at the row's uniform.
template <typename T>
int64_t draw_token(const T* logits, int64_t vocab_size, const StepSampling& sampling, int64_t m,
                   DrawScratch& scratch) {
  scratch.row.resize(vocab_size);
  float* x = scratch.row.data();
  const float temperature = sampling.temperatures[m];
  const Vec divisor = Vec{} + temperature;
  int64_t i = 0;
  for (; i + kLanes <= vocab_size; i += kLanes) store_vec(x + i, load_vec(logits + i) / divisor);
  for (; i < vocab_size; ++i) x[i] = static_cast<float>(logits[i]) / temperature;
  return sample_row(x, vocab_size, sampling.truncations[m], sampling.uniforms[m],
                                           scratch.truncation);
}

// logits [n] (the head's dtype) widened to fp32 into `row`, as the sampler's fp32 copy: the row.
template <typename T>
float* widen_row(const T* logits, int64_t n, std::vector<float>& row) {
  row.resize(n);
  float* x = row.data();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store_vec(x + i, load_vec(logits + i));
  for (; i < n; ++i) x[i] = static_cast<float>(logits[i]);
  return x;
}

// Row m's logprobs where it reports them, as the sampler gives them from the same fp32 row x
// [vocab_size] (the head's logits widened, with any history applied) once it took `token`:
// the log-softmax at the token and at the row's top tokens.
inline void write_logprobs(const float* x, int64_t vocab_size, int64_t token, const StepSampling& sampling,
                           int64_t m, DrawScratch& scratch) {
  float* out = sampling.logprobs + m * (1 + sampling.max_logprobs);
  row_logprobs(x, vocab_size, token, sampling.num_logprobs[m], out,
                                      sampling.logprob_token_ids + m * sampling.max_logprobs, out + 1, scratch.top);
}

// Row m's token where its history changes its logits, as the sampler takes it: its logits
// [vocab_size] widened to fp32, penalized and its stop tokens held back, then their argmax or
// the draw over the temperature (the sampler's own passes); the row's logprobs from that row
// where it reports them; then its history counts the token for the next step.
template <typename T>
int64_t take_with_history(const T* logits, int64_t vocab_size, const StepSampling& sampling, int64_t m,
                          DrawScratch& scratch) {
  float* x = widen_row(logits, vocab_size, scratch.with_history);
  sampling.histories[m].apply(x);
  const int64_t token = draws(sampling, m) ? draw_token(x, vocab_size, sampling, m, scratch)
                                           : pdserve_cpu::argmax_part(x, vocab_size).index;
  if (reports_logprobs(sampling, m)) write_logprobs(x, vocab_size, token, sampling, m, scratch);
  sampling.histories[m].take(token);
  return token;
}

// The per-row sampling of a decode_tokens call checked, as Truncations (none: every row
// greedy). temperatures [M] fp32 (> 0: the row draws; else its argmax), uniforms [num_steps, M]
// float64 in [0, 1) (step s draws row m at uniforms[s, m]), top_k [M] int64, top_p and min_p
// [M] fp32 (each optional: none truncates).
inline std::vector<Truncation> check_sampling(
    int64_t M, int64_t num_steps, const std::optional<at::Tensor>& temperatures,
    const std::optional<at::Tensor>& uniforms, const std::optional<at::Tensor>& top_k,
    const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p) {
  PDSERVE_CHECK_VALUE(temperatures.has_value() == uniforms.has_value(),
                      "decode_tokens: temperatures and uniforms together, or neither");
  if (!temperatures.has_value()) {
    PDSERVE_CHECK_VALUE(!top_k.has_value() && !top_p.has_value() && !min_p.has_value(),
                        "decode_tokens: top_k, top_p and min_p need temperatures");
    return {};
  }
  const auto per_row = [&](const at::Tensor& values, at::ScalarType dtype, const char* name) {
    PDSERVE_CHECK_VALUE(values.dim() == 1 && values.numel() == M && values.scalar_type() == dtype &&
                            values.is_contiguous(),
                        "decode_tokens: ", name, " must be contiguous [num_tokens ", M, "] ", dtype, ", got ",
                        values.scalar_type(), " ", values.sizes());
  };
  per_row(*temperatures, at::kFloat, "temperatures");
  PDSERVE_CHECK_VALUE(uniforms->dim() == 2 && uniforms->size(0) == num_steps && uniforms->size(1) == M &&
                          uniforms->scalar_type() == at::kDouble && uniforms->is_contiguous(),
                      "decode_tokens: uniforms must be contiguous [num_steps ", num_steps, ", num_tokens ", M,
                      "] float64, got ", uniforms->scalar_type(), " ", uniforms->sizes());
  const float* temperature = temperatures->const_data_ptr<float>();
  const double* u = uniforms->const_data_ptr<double>();
  std::vector<Truncation> truncations(M);
  for (int64_t m = 0; m < M; ++m) {
    PDSERVE_CHECK_VALUE(std::isfinite(temperature[m]), "decode_tokens: row ", m, "'s temperature ", temperature[m],
                        " is not finite");
    if (!(temperature[m] > 0.f)) continue;
    for (int64_t step = 0; step < num_steps; ++step)
      PDSERVE_CHECK_VALUE(u[step * M + m] >= 0.0 && u[step * M + m] < 1.0, "decode_tokens: uniform ",
                          u[step * M + m], " of row ", m, " (step ", step, ") is outside [0, 1)");
  }
  if (top_k.has_value()) {
    per_row(*top_k, at::kLong, "top_k");
    for (int64_t m = 0; m < M; ++m) truncations[m].top_k = top_k->const_data_ptr<int64_t>()[m];
  }
  if (top_p.has_value()) {
    per_row(*top_p, at::kFloat, "top_p");
    for (int64_t m = 0; m < M; ++m) {
      const float p = top_p->const_data_ptr<float>()[m];
      PDSERVE_CHECK_VALUE(p > 0.f && p <= 1.f, "decode_tokens: row ", m, "'s top_p ", p, " is outside (0, 1]");
      truncations[m].top_p = p;
    }
  }
  if (min_p.has_value()) {
    per_row(*min_p, at::kFloat, "min_p");
    for (int64_t m = 0; m < M; ++m) {
      const float p = min_p->const_data_ptr<float>()[m];
      PDSERVE_CHECK_VALUE(p >= 0.f && p <= 1.f, "decode_tokens: row ", m, "'s min_p ", p, " is outside [0, 1]");
      truncations[m].min_p = p;
    }
  }
  return truncations;
}

// Each row's history for a decode_tokens call (RowHistory), checked (none: no row has one):
// penalties [M, 3] fp32 (repetition > 0, frequency, presence: 1, 0, 0 for a row without); the
// rows' tokens in history_token_ids [T] int64 (each in [0, vocab_size)): row m's prompt tokens
// at [offsets[m, 0], offsets[m, 1]), its output tokens at [offsets[m, 1], offsets[m, 2]) and
// its held-back stop tokens at [offsets[m, 2], offsets[m, 3]) of history_offsets [M, 4] int64;
// held_back_steps [M] int64: the steps, from this call's first, whose draws hold them back
// (<= 0: none); all four or none.
inline std::vector<RowHistory> check_history(int64_t M, int64_t vocab_size, const std::optional<at::Tensor>& penalties,
                                             const std::optional<at::Tensor>& token_ids,
                                             const std::optional<at::Tensor>& offsets,
                                             const std::optional<at::Tensor>& held_back_steps) {
  PDSERVE_CHECK_VALUE(penalties.has_value() == token_ids.has_value() && penalties.has_value() == offsets.has_value() &&
                          penalties.has_value() == held_back_steps.has_value(),
                      "decode_tokens: penalties, history_token_ids, history_offsets and held_back_steps together, "
                      "or none");
  if (!penalties.has_value()) return {};
  PDSERVE_CHECK_VALUE(penalties->dim() == 2 && penalties->size(0) == M && penalties->size(1) == 3 &&
                          penalties->scalar_type() == at::kFloat && penalties->is_contiguous(),
                      "decode_tokens: penalties must be contiguous fp32 [num_tokens ", M, ", 3], got ",
                      penalties->scalar_type(), " ", penalties->sizes());
  PDSERVE_CHECK_VALUE(offsets->dim() == 2 && offsets->size(0) == M && offsets->size(1) == 4 &&
                          offsets->scalar_type() == at::kLong && offsets->is_contiguous(),
                      "decode_tokens: history_offsets must be contiguous int64 [num_tokens ", M, ", 4], got ",
                      offsets->scalar_type(), " ", offsets->sizes());
  PDSERVE_CHECK_VALUE(held_back_steps->dim() == 1 && held_back_steps->size(0) == M &&
                          held_back_steps->scalar_type() == at::kLong && held_back_steps->is_contiguous(),
                      "decode_tokens: held_back_steps must be contiguous int64 [num_tokens ", M, "], got ",
                      held_back_steps->scalar_type(), " ", held_back_steps->sizes());
  PDSERVE_CHECK_VALUE(token_ids->dim() == 1 && token_ids->scalar_type() == at::kLong && token_ids->is_contiguous(),
                      "decode_tokens: history_token_ids must be contiguous int64 [T], got ", token_ids->scalar_type(),
                      " ", token_ids->sizes());
  const float* values = penalties->const_data_ptr<float>();
  const int64_t* bounds = offsets->const_data_ptr<int64_t>();
  const int64_t* steps = held_back_steps->const_data_ptr<int64_t>();
  const int64_t* ids = token_ids->const_data_ptr<int64_t>();
  const int64_t num_ids = token_ids->numel();
  for (int64_t i = 0; i < num_ids; ++i)
    PDSERVE_CHECK_VALUE(ids[i] >= 0 && ids[i] < vocab_size, "decode_tokens: history token id ", ids[i],
                        " is outside the vocabulary's ", vocab_size);
  std::vector<RowHistory> rows(M);
  for (int64_t m = 0; m < M; ++m) {
    const float repetition = values[3 * m], frequency = values[3 * m + 1], presence = values[3 * m + 2];
    PDSERVE_CHECK_VALUE(repetition > 0.f && std::isfinite(repetition) && std::isfinite(frequency) &&
                            std::isfinite(presence),
                        "decode_tokens: row ", m, "'s penalties (repetition ", repetition, ", frequency ", frequency,
                        ", presence ", presence, ") must be finite, repetition > 0");
    const int64_t* b = bounds + 4 * m;
    PDSERVE_CHECK_VALUE(0 <= b[0] && b[0] <= b[1] && b[1] <= b[2] && b[2] <= b[3] && b[3] <= num_ids,
                        "decode_tokens: row ", m, "'s history_offsets [", b[0], ", ", b[1], ", ", b[2], ", ", b[3],
                        "] are not ordered within [0, ", num_ids, "]");
    rows[m] = RowHistory(repetition, frequency, presence, ids + b[0], b[1] - b[0], ids + b[1],
                                                b[2] - b[1], ids + b[2], b[3] - b[2], steps[m], vocab_size);
  }
  return rows;
}

// The logprobs a decode_tokens call reports, checked: num_logprobs [M] int64 (< 0: none for the
// row, else the taken token's and the top num_logprobs[m] ones', at most the vocabulary),
// logprobs [num_steps, M, 1 + K] fp32 and logprob_token_ids [num_steps, M, K] int64 where K is
// the largest of num_logprobs; all three or none. Returns K (-1: none).
inline int64_t check_logprobs(int64_t M, int64_t num_steps, int64_t vocab_size,
                              const std::optional<at::Tensor>& num_logprobs,
                              const std::optional<at::Tensor>& logprobs,
                              const std::optional<at::Tensor>& logprob_token_ids) {
  PDSERVE_CHECK_VALUE(num_logprobs.has_value() == logprobs.has_value() &&
                          num_logprobs.has_value() == logprob_token_ids.has_value(),
                      "decode_tokens: num_logprobs, logprobs and logprob_token_ids together, or none");
  if (!num_logprobs.has_value()) return -1;
  PDSERVE_CHECK_VALUE(num_logprobs->dim() == 1 && num_logprobs->numel() == M &&
                          num_logprobs->scalar_type() == at::kLong && num_logprobs->is_contiguous(),
                      "decode_tokens: num_logprobs must be contiguous [num_tokens ", M, "] int64, got ",
                      num_logprobs->scalar_type(), " ", num_logprobs->sizes());
  const int64_t* counts = num_logprobs->const_data_ptr<int64_t>();
  int64_t K = -1;
  for (int64_t m = 0; m < M; ++m) {
    PDSERVE_CHECK_VALUE(counts[m] <= vocab_size, "decode_tokens: row ", m, " asks for ", counts[m],
                        " top logprobs, more than the vocabulary's ", vocab_size, " tokens");
    K = std::max(K, counts[m] < 0 ? int64_t{-1} : counts[m]);
  }
  const int64_t room = std::max<int64_t>(K, 0);
  PDSERVE_CHECK_VALUE(logprobs->dim() == 3 && logprobs->size(0) == num_steps && logprobs->size(1) == M &&
                          logprobs->size(2) == 1 + room && logprobs->scalar_type() == at::kFloat &&
                          logprobs->is_contiguous(),
                      "decode_tokens: logprobs must be contiguous fp32 [num_steps ", num_steps, ", num_tokens ", M,
                      ", 1 + ", room, "], got ", logprobs->scalar_type(), " ", logprobs->sizes());
  PDSERVE_CHECK_VALUE(logprob_token_ids->dim() == 3 && logprob_token_ids->size(0) == num_steps &&
                          logprob_token_ids->size(1) == M && logprob_token_ids->size(2) == room &&
                          logprob_token_ids->scalar_type() == at::kLong && logprob_token_ids->is_contiguous(),
                      "decode_tokens: logprob_token_ids must be contiguous int64 [num_steps ", num_steps,
                      ", num_tokens ", M, ", ", room, "], got ", logprob_token_ids->scalar_type(), " ",
                      logprob_token_ids->sizes());
  return K;
}

}  // namespace pdserve_cpu::sampling

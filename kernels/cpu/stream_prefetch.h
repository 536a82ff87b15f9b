// A decode step's weight stream asked for ahead of its reads with non-temporal prefetches
// (prefetchnta), for the kernels that read each weight once a step: the row-group GEMV over
// GGUF blocks at any row count (gguf_row_groups.h), the bf16 panels below one 12-row tile
// (panel_gemm.h) and the row-major GEMV (gemv.cpp).
//
// Why non-temporal: the stream is read once a step, so it need not push the step's other
// data (KV blocks, activations, the engine's own code between steps) out of the caches. On
// the 2-core Zen 5 EPYC, the same engine with and without, the two taking turns per prompt:
// a token of the bundled model's Q4_1 weights and Q8_0 head (~97 MB) 2.47-2.61 -> 2.33-2.34
// ms, of its bf16 panels (269 MB) 7.58-7.62 -> 7.31-7.33 ms on slow-memory minutes;
// prefetcht0 and prefetcht1 2 KB ahead changed nothing, 2 and 8 KB ahead less than 4.
#pragma once

#include <cstdint>

#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace pdserve_cpu {

constexpr int64_t kStreamAheadBytes = 4096;  // how far ahead of its reads a thread asks

// The cache lines of [p + kStreamAheadBytes, p + kStreamAheadBytes + num_bytes), asked for:
// what a thread reads kStreamAheadBytes on (past its share's end: harmless, a prefetch never faults).
inline void prefetch_stream_ahead(const void* p, int64_t num_bytes) {
#if defined(__SSE__)
  const char* ahead = static_cast<const char*>(p) + kStreamAheadBytes;
  for (int64_t offset = 0; offset < num_bytes; offset += 64) _mm_prefetch(ahead + offset, _MM_HINT_NTA);
#else
  (void)p;
  (void)num_bytes;
#endif
}

}  // namespace pdserve_cpu

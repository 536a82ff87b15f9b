// A decode step's weight stream asked for ahead of its reads, for the kernels that read
// each weight once a step: the row-group GEMV over GGUF blocks at any row count
// (gguf_row_groups.h), the bf16 panels below one 12-row tile (panel_gemm.h) and the
// row-major GEMV (gemv.cpp).
//
// Which prefetch depends on the CPU's vendor, measured on each:
// - AMD: non-temporal (prefetchnta). The stream is read once a step, so it need not push
//   the step's other data (KV blocks, activations, the engine's own code between steps)
//   out of the caches. On the 2-core Zen 5 EPYC, the same engine with and without, the
//   two taking turns per prompt: a token of the bundled model's Q4_1 weights and Q8_0 head
//   (~97 MB) 2.47-2.61 -> 2.33-2.34 ms, of its bf16 panels (269 MB) 7.58-7.62 -> 7.31-7.33
//   ms on slow-memory minutes; prefetcht0 and prefetcht1 2 KB ahead changed nothing, 2 and
//   8 KB ahead less than 4.
// - Intel: into every level (prefetcht0). There prefetchnta fills L1 and skips L2 (and,
//   it seems, L2's streamer, leaving the stream to L1's few fill buffers): on the
//   2-core AMX Xeon (CPUID model 167) SmolLM2's Q4_1 layers at one row took 9.2-9.8 ms with
//   it, 4.6-5.6 with prefetcht0, 5.6 with prefetcht1 and 6.5-7.2 with none, alternating
//   (`pdserve bench decode-linears --weights q4_1`, docs/benchmarks.md).
// PDSERVE_STREAM_PREFETCH=nta, t0 or off chooses for every CPU (for comparing them).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string_view>

#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace pdserve_cpu {

constexpr int64_t kStreamAheadBytes = 4096;  // how far ahead of its reads a thread asks

enum class StreamPrefetch { kNonTemporal, kL1, kOff };

// PDSERVE_STREAM_PREFETCH, else by the vendor.
inline StreamPrefetch choose_stream_prefetch() {
  if (const char* setting = std::getenv("PDSERVE_STREAM_PREFETCH")) {
    const std::string_view value(setting);
    if (value == "nta") return StreamPrefetch::kNonTemporal;
    if (value == "t0") return StreamPrefetch::kL1;
    if (value == "off") return StreamPrefetch::kOff;
  }
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_is("intel")) return StreamPrefetch::kL1;
#endif
  return StreamPrefetch::kNonTemporal;
}

// Decided once per library, as it loads. A variable, not a function's static: reading it is
// a load, where a function static's first-use guard is a call, and a kernel loop holding a
// call keeps its accumulators in memory (panel_gemm's tiles of 1-11 rows stored every one of
// them to the stack each step, ~2.5x slower at 8 rows on the Zen 4 EPYC).
inline const StreamPrefetch kStreamPrefetch = choose_stream_prefetch();

// The cache lines of [p, p + num_bytes), asked for the way kWay says, fixed at compile time
// (for a kernel's inner loop, whose registers a branch on kStreamPrefetch there can cost).
template <StreamPrefetch kWay>
inline void prefetch_lines_as(const void* p, int64_t num_bytes) {
#if defined(__SSE__)
  const char* first = static_cast<const char*>(p);
  if constexpr (kWay == StreamPrefetch::kNonTemporal)
    for (int64_t offset = 0; offset < num_bytes; offset += 64) _mm_prefetch(first + offset, _MM_HINT_NTA);
  else if constexpr (kWay == StreamPrefetch::kL1)
    for (int64_t offset = 0; offset < num_bytes; offset += 64) _mm_prefetch(first + offset, _MM_HINT_T0);
#else
  (void)p;
  (void)num_bytes;
#endif
}

// The same, kStreamPrefetch's way.
inline void prefetch_stream_lines(const void* p, int64_t num_bytes) {
  switch (kStreamPrefetch) {  // the same branch every call: predicted
    case StreamPrefetch::kNonTemporal: return prefetch_lines_as<StreamPrefetch::kNonTemporal>(p, num_bytes);
    case StreamPrefetch::kL1: return prefetch_lines_as<StreamPrefetch::kL1>(p, num_bytes);
    case StreamPrefetch::kOff: return;
  }
}

// The cache lines of [p + kStreamAheadBytes, p + kStreamAheadBytes + num_bytes), asked for:
// what a thread reads kStreamAheadBytes on (past its share's end: harmless, a prefetch never faults).
inline void prefetch_stream_ahead(const void* p, int64_t num_bytes) {
  prefetch_stream_lines(static_cast<const char*>(p) + kStreamAheadBytes, num_bytes);
}

}  // namespace pdserve_cpu

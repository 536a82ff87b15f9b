// The barrier between the phases of a decode step's parallel region (decode_layers.cpp):
// ten a layer, ~300 a step of the bundled model, each waiting a microsecond or two.
//
// libgomp's barrier costs a little more per crossing than a sense-reversing counter the
// threads spin on: the bundled model's Q4_1 layers, one row, 2 threads on the Zen 5 EPYC,
// the two barriers taking turns per prompt in one process (medians of 16 prompts' medians,
// three runs): 2.208 / 2.199 / 2.179 -> 2.168 / 2.145 / 2.148 ms a token; bf16 panels 5.774
// -> 5.756. The waits are that short because the threads share the step evenly; a thread
// that is not on a core (more threads than cores) is waited for with yields, not spins.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace pdserve_cpu {

class RegionBarrier {
 public:
  // Called by one thread of the region, then an OpenMP barrier, before the first wait: the
  // team may be smaller than asked for. num_procs: the cores the region may run on.
  void set_num_threads(int num_threads, int num_procs) {
    num_threads_ = num_threads;
    // Spins between yields: libgomp's throttled count where the threads outnumber the cores.
    spins_per_yield_ = num_threads > num_procs ? 1000 : 1 << 14;
  }

  // Returns once every thread of the region has called it; what each wrote before it, the
  // others read after it.
  void wait() {
    const uint32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == num_threads_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      return;
    }
    int64_t num_spins = 0;
    while (generation_.load(std::memory_order_acquire) == generation) {
#if defined(__SSE__)
      _mm_pause();
#endif
      if (++num_spins % spins_per_yield_ == 0) std::this_thread::yield();
    }
  }

 private:
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};
  int num_threads_ = 1;
  int64_t spins_per_yield_ = 1 << 14;
};

}  // namespace pdserve_cpu

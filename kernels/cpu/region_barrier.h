// The barrier between the phases of a decode step's parallel region (decode_layers.cpp):
// ten a layer, ~300 a step of the bundled model, each waiting a microsecond or two.
//
// libgomp's barrier costs a little more per crossing than a sense-reversing counter the
// threads spin on: the bundled model's Q4_1 layers, one row, 2 threads on the Zen 5 EPYC,
// the two barriers taking turns per prompt in one process (medians of 16 prompts' medians,
// three runs): 2.208 / 2.199 / 2.179 -> 2.168 / 2.145 / 2.148 ms a token; bf16 panels 5.774
// -> 5.756. The waits are that short because the threads share the step evenly; past
// libgomp's 300,000 spins (100 where the threads outnumber the cores) a waiting thread sleeps
// on a futex (std::atomic::wait), as libgomp's do.
#pragma once

#include <atomic>
#include <cstdint>

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
    // Spins before sleeping: few where the threads outnumber the cores, where a spinning
    // thread holds the core the one it waits for needs (3 threads on the Zen 5's 2 cores, a
    // 4-bit token: 7.5-8.1 ms with libgomp's barrier, 10.7 sleeping after 1,000 spins, 5.9-6.3
    // after 100, 6.9-7.7 after none).
    max_spins_ = num_threads > num_procs ? 100 : 300000;  // else libgomp's own count
  }

  // Returns once every thread of the region has called it; what each wrote before it, the
  // others read after it.
  void wait() {
    const uint32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == num_threads_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_seq_cst);
      if (num_sleeping_.load(std::memory_order_seq_cst) > 0) generation_.notify_all();
      return;
    }
    for (int64_t spin = 0; spin < max_spins_; ++spin) {
      if (generation_.load(std::memory_order_acquire) != generation) return;
#if defined(__SSE__)
      _mm_pause();
#endif
    }
    // Sleeps (a futex) until the last thread's store: it sees num_sleeping_ > 0 and wakes
    // the sleepers, or this thread sees the new generation before it sleeps.
    num_sleeping_.fetch_add(1, std::memory_order_seq_cst);
    while (generation_.load(std::memory_order_seq_cst) == generation) generation_.wait(generation);
    num_sleeping_.fetch_sub(1, std::memory_order_relaxed);
  }

 private:
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<int> num_sleeping_{0};
  int num_threads_ = 1;
  int64_t max_spins_ = 300000;
};

}  // namespace pdserve_cpu

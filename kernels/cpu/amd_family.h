// The CPU's AMD family (CPUID leaf 1, base plus extended family), for kernels whose best
// form differs between AMD generations: 25 (0x19) is Zen 3 (no AVX-512) and Zen 4 (512-bit
// vector ops as two 256-bit halves); 26 (0x1a) is Zen 5, which runs them at full width.
#pragma once

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace pdserve_cpu {

// 0 on other vendors and architectures; read once per process.
inline unsigned amd_cpu_family() {
  static const unsigned family = [] {
#if defined(__x86_64__)
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return 0u;
    const bool amd = ebx == 0x68747541 && edx == 0x69746e65 && ecx == 0x444d4163;  // "AuthenticAMD"
    if (!amd || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0u;
    const unsigned base = (eax >> 8) & 0xf;
    return base == 0xf ? base + ((eax >> 20) & 0xff) : base;
#else
    return 0u;
#endif
  }();
  return family;
}

}  // namespace pdserve_cpu

// AMX's tiles for the native kernels (panel_gemm_amx.h, attention_amx.h): whether this process
// may compute on them.
#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define PDSERVE_HAS_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <string_view>

namespace pdserve_cpu {

// Unless PDSERVE_AMX_TILES=0 (the vector tiles then, for comparing the two), once Linux has
// handed the process AMX's 8 KB of tile state, which it does only when asked (arch_prctl,
// since 5.16). Decided once per process (and library).
inline bool amx_tiles_usable() {
  static const bool usable = [] {
    const char* setting = std::getenv("PDSERVE_AMX_TILES");
    if (setting != nullptr && std::string_view(setting) == "0") return false;
    constexpr int kArchReqXcompPerm = 0x1023;
    constexpr int kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

}  // namespace pdserve_cpu
#endif

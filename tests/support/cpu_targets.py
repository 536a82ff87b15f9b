"""Which build of the native kernels a test of their 8-lane (AVX2) paths runs."""
from __future__ import annotations

from kernels.cpu.build import cpu_flags

# What the kernels' sources test beyond AVX2, FMA and F16C (x86-64-v3): AVX-512 (F, BW,
# BF16, VNNI) and AMX, all of which need AVX-512 Foundation on the CPUs that have them.
_WIDER_THAN_AVX2 = "avx512f"


def avx2_build_environment() -> dict[str, str]:
    """The environment in which the kernels build their AVX2 paths: on a CPU with AVX-512, a
    build for x86-64-v3; on one with AVX2 and no AVX-512 its own (native) build already takes
    those very paths, and the tests reuse it rather than run g++ for a second library
    (15-45 s of a core each on an AVX2-only Zen 3)."""
    flags = cpu_flags().split()
    if _WIDER_THAN_AVX2 not in flags and all(flag in flags for flag in ("avx2", "fma", "f16c")):
        return {}
    return {"PDSERVE_CPU_MARCH": "x86-64-v3"}

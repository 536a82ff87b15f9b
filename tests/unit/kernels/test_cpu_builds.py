"""Where this machine can build the native CPU libraries (kernels/cpu/build.py: a C++
compiler; for the GEMVs and the decode loop AVX2 and FMA), each one builds and loads. Their
own test modules skip where a library is unavailable, so a source that stopped compiling
would otherwise show up only as skipped tests."""
from __future__ import annotations

import os

import pytest

from kernels._backend import switched_off
from kernels.cpu.build import cpu_flags, find_compiler
from kernels.cpu_attention import native_attention_error
from kernels.cpu_decode import native_decode_available
from kernels.cpu_linear import native_gemv_available, panel_gemm_available
from kernels.cpu_sampling import native_argmax_available

FLAGS = set(cpu_flags().split())
needs_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C++ compiler here")
needs_avx2 = pytest.mark.skipif(not {"avx2", "fma"} <= FLAGS, reason="no AVX2 and FMA here")


@needs_compiler
def test_the_attention_and_the_argmax_build_and_load():
    assert native_attention_error() is None, native_attention_error()
    if not switched_off("PDSERVE_CPU_ARGMAX"):
        assert native_argmax_available()


@needs_compiler
@needs_avx2
@pytest.mark.skipif(switched_off("PDSERVE_CPU_GEMV"), reason="PDSERVE_CPU_GEMV=0")
def test_the_gemvs_and_the_decode_loop_build_and_load_in_the_build_the_cpu_takes():
    assert native_gemv_available()  # the library's log names the compiler's error otherwise
    if not os.environ.get("PDSERVE_CPU_MARCH"):  # built for this CPU, not an older target
        assert panel_gemm_available() == ("avx512_bf16" in FLAGS)
    assert native_decode_available()

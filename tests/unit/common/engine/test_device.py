"""dtype auto follows the hardware (native bf16: CUDA, AMX, AVX512-BF16; else fp32), and the
default thread count follows the CPUs a process may use (its affinity and its cgroup's quota)."""
from __future__ import annotations

import logging
import textwrap

import pytest
import torch

from common.engine.config import CacheConfig
from common.engine.device import select_dtype, select_kv_cache_dtype, set_num_threads
from tests.support.cpu_cgroup import one_cpu_cgroup
from tests.support.fresh_process import run_python

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_dtype_override(monkeypatch):
    monkeypatch.delenv("PDSERVE_DTYPE", raising=False)


@pytest.mark.parametrize("flags, expected", [
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),
    ({"avx512f", "amx_tile", "amx_bf16"}, torch.bfloat16),
    ({"avx2", "avx512f"}, torch.float32),  # bf16 would be emulated: slower than fp32
    (set(), torch.float32),
])
def test_auto_picks_bf16_only_where_the_cpu_computes_it(flags, expected, caplog):
    with caplog.at_level(logging.INFO, logger="common.engine.device"):
        assert select_dtype("auto", CPU, flags) == expected
    assert f"dtype auto -> {str(expected).removeprefix('torch.')}" in caplog.text


def test_auto_is_bf16_on_cuda():
    assert select_dtype("auto", torch.device("cuda"), set()) == torch.bfloat16


def test_environment_overrides_auto_but_not_an_explicit_dtype(monkeypatch):
    monkeypatch.setenv("PDSERVE_DTYPE", "float32")
    assert select_dtype("auto", CPU, {"avx512_bf16"}) == torch.float32
    assert select_dtype("bfloat16", CPU, set()) == torch.bfloat16


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of auto"):
        select_dtype("float8", CPU, set())


def test_kv_cache_dtype_names_vllms_formats_and_refuses_what_no_kernel_reads(caplog):
    with caplog.at_level(logging.INFO, logger="common.engine.device"):
        assert select_kv_cache_dtype("fp8", torch.bfloat16, CPU) == torch.float8_e4m3fn
    assert "KV cache dtype fp8 -> float8_e4m3fn" in caplog.text
    assert select_kv_cache_dtype("fp8_e4m3", torch.float32, CPU) == torch.float8_e4m3fn
    assert select_kv_cache_dtype("fp8_e5m2", torch.bfloat16, CPU) == torch.float8_e5m2
    assert select_kv_cache_dtype("auto", torch.float16, CPU) == torch.float16
    with pytest.raises(ValueError, match="float32 or bfloat16 model; dtype is float16"):
        select_kv_cache_dtype("fp8", torch.float16, CPU)
    with pytest.raises(ValueError, match="implemented for CPU and CUDA; on mps use kv_cache_dtype auto"):
        select_kv_cache_dtype("fp8", torch.bfloat16, torch.device("mps"))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        select_kv_cache_dtype("int8", torch.bfloat16, CPU)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        CacheConfig(cache_dtype="fp16")


@pytest.mark.parametrize("capability, accepted", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)])
def test_on_cuda_fp8_codes_need_a_gpu_whose_triton_converts_them(monkeypatch, capability, accepted):
    """The GPU's compute capability is what decides (faked here: this machine has no GPU)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda")
    if accepted:
        assert select_kv_cache_dtype("fp8", torch.bfloat16, cuda) == torch.float8_e4m3fn
        assert select_kv_cache_dtype("fp8_e5m2", torch.float32, cuda) == torch.float8_e5m2
    else:
        with pytest.raises(ValueError, match=rf"compute capability 8.9 or later .* this one is "
                                             rf"{capability[0]}.{capability[1]}: use kv_cache_dtype auto"):
            select_kv_cache_dtype("fp8", torch.bfloat16, cuda)


def test_num_threads_sets_this_processes_torch_threads():
    previous = torch.get_num_threads()
    try:
        set_num_threads(1)
        assert torch.get_num_threads() == 1
        set_num_threads(None)  # leaves torch's choice alone
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)



def test_default_threads_follow_a_real_cgroups_cpu_quota():
    """A process in a cgroup allowed one CPU of several starts one torch thread, not one per core."""
    script = textwrap.dedent("""
        import torch
        from common.engine.device import set_num_threads
        before = torch.get_num_threads()
        set_num_threads(None)
        print(before, torch.get_num_threads())
    """)
    with one_cpu_cgroup() as group:
        done = run_python(script, timeout_s=120, unset=("OMP_NUM_THREADS",), cgroup=group)
    before, after = map(int, done.stdout.split())
    assert before >= 2  # torch counted the cores, not the quota
    assert after == 1

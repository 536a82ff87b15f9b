"""dtype auto follows the hardware: native bf16 (CUDA, AMX, AVX512-BF16) or fp32."""
from __future__ import annotations

import logging

import pytest
import torch

from common.engine.device import select_dtype

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


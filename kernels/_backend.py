"""Backend choice shared by the public kernels: Triton on CUDA, plain torch elsewhere.

Attention on CPU may also run "native", the C++ kernel of kernels/cpu_attention.py
(kernels.attention picks it); the other kernels have no native variant.
"""
from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("triton", "torch", "native")


@functools.cache
def triton_available() -> bool:
    # triton is an optional dependency (the CPU-only install does not ship it).
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def switched_off(variable: str) -> bool:
    """Whether an on-by-default PDSERVE_* switch is set to 0, false, no or off."""
    return os.environ.get(variable, "1").lower() in ("0", "false", "no", "off")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def select_backend(device: torch.device, backend: str | None) -> str:
    """Resolve `backend` (None, "triton", "torch" or "native") for tensors living on `device`."""
    if backend is None:
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "native":
        if device.type != "cpu":
            raise ValueError(f"backend='native' is the CPU kernel; tensors are on {device.type}")
        from kernels.cpu_attention import native_attention_available, native_attention_error

        if not native_attention_available():
            raise ValueError(f"backend='native' requested but it cannot be built: {native_attention_error()}")
    if backend == "triton":
        if not triton_available():
            raise ValueError("backend='triton' requested but triton is not installed")
        # Off CUDA the kernels only run under the Triton interpreter (tests).
        if device.type != "cuda" and not _interpreting():
            raise ValueError(f"backend='triton' needs CUDA tensors (got {device.type}) "
                             "or TRITON_INTERPRET=1 set before triton is imported")
    return backend


def check_float_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


# 8-bit KV caches hold these codes (no scales) for float32 and bfloat16 models.
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_cache_dtypes(dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor, what: str = "q") -> None:
    """K and V caches hold `dtype` (what they are written from and read into), or fp8 codes of
    a float32 or bfloat16 `dtype`."""
    check_last_dim_contiguous("k_cache", k_cache)
    check_last_dim_contiguous("v_cache", v_cache)
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"dtype mismatch: k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if k_cache.dtype == dtype:
        return
    if k_cache.dtype in FP8_CACHE_DTYPES and dtype in (torch.float32, torch.bfloat16):
        return
    raise ValueError(f"dtype mismatch: {what} {dtype}, caches {k_cache.dtype} (a cache holds {what}'s dtype, or "
                     f"fp8 codes ({', '.join(str(d) for d in FP8_CACHE_DTYPES)}) for float32 and bfloat16)")


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: fp8 codes round to nearest and saturate at the format's largest
    finite value (torch saturates E4M3 itself but takes E5M2 to inf, which would poison every
    later softmax of its sequence), as the native kernel writes them."""
    if cache_dtype not in FP8_CACHE_DTYPES:
        return x
    limit = torch.finfo(cache_dtype).max
    return x.float().clamp(-limit, limit).to(cache_dtype)


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    # The Triton kernels take arbitrary outer strides but load head_dim as one run.
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension, "
                         f"got strides {tuple(t.stride())}")


def check_int32_1d(name: str, t: torch.Tensor, length: int, device: torch.device) -> None:
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name} must have shape [{length}], got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")

"""Where and in what precision the model runs: device, dtype `auto`, thread count.

`auto` means bf16 where the hardware computes it natively (CUDA; CPUs with AMX or
AVX512-BF16, where oneDNN runs bf16 matmuls at twice fp32's rate and half its
memory traffic) and fp32 elsewhere (emulated bf16 is slower than fp32 there).
PDSERVE_DTYPE in the environment overrides what `auto` resolves to, as it sets
--dtype for the services.
"""
from __future__ import annotations

import logging
import math
import os

import torch

from common.engine.cpus import cgroup_cpu_quota

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
_NATIVE_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def select_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def first_cpu_fields(cpuinfo: str | None = None) -> dict[str, str]:
    """/proc/cpuinfo's fields of its first processor, or of the text given ({} where there is none)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's fields end at its blank line
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return set(first_cpu_fields().get("flags", "").split())


def cpu_has_native_bf16(flags: set[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in _NATIVE_BF16_CPU_FLAGS)


def select_dtype(dtype: str, device: torch.device, flags: set[str] | None = None) -> torch.dtype:
    if dtype == "auto":
        dtype = os.environ.get("PDSERVE_DTYPE") or "auto"
    if dtype == "auto":
        native_bf16 = device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16(flags))
        chosen = torch.bfloat16 if native_bf16 else torch.float32
        why = "CUDA" if device.type == "cuda" else ("the CPU computes bf16 natively" if native_bf16
                                                    else "the CPU has no native bf16 (AMX or AVX512-BF16)")
        logger.info("dtype auto -> %s (%s)", str(chosen).removeprefix("torch."), why)
        return chosen
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


# vLLM's kv_cache_dtype names: "fp8" is E4M3. The codes carry no scales (vLLM's default
# scale of 1.0): every K and V value is rounded to the nearest code, saturating at the
# format's largest finite value.
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Triton converts fp8 codes (E4M3 at least) from compute capability 8.9 (Ada, Hopper) on.
FP8_MIN_CUDA_CAPABILITY = (8, 9)


def select_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What the paged KV cache holds: the model's dtype ("auto"), or 8-bit float codes, half
    of bf16's bytes: a pool holds twice the tokens and a remote prefill ships half the bytes
    (decode attention reads half as much too, which on the CPUs measured made it only 1.0-1.16x
    faster: the codes' widening costs much of what the reads save)."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}; "
                         f"got {kv_cache_dtype!r}")
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CUDA_CAPABILITY:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype} needs a GPU of compute capability "
                             f"{'.'.join(map(str, FP8_MIN_CUDA_CAPABILITY))} or later (Ada, Hopper), whose Triton "
                             f"reads fp8 codes; this one is {'.'.join(map(str, capability))}: use kv_cache_dtype auto")
    elif device.type != "cpu":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype} is implemented for CPU and CUDA; on {device.type} "
                         f"use kv_cache_dtype auto")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype} takes a float32 or bfloat16 model; dtype is "
                         f"{str(dtype).removeprefix('torch.')}")
    chosen = KV_CACHE_DTYPES[kv_cache_dtype]
    logger.info("KV cache dtype %s -> %s", kv_cache_dtype, str(chosen).removeprefix("torch."))
    return chosen


def set_num_threads(num_threads: int | None) -> None:
    """This process's torch intra-op threads. None: torch's default (one per CPU this
    process may run on), lowered to the CPU quota of its cgroup where that is smaller.

    Processes sharing a host (a prefill and a decode instance) each get their share,
    or their threads contend for the same cores and both slow down; why the quota counts
    is in common.engine.cpus."""
    why = ""
    if num_threads is None:
        num_threads, why = _threads_within_cpu_quota()
        if num_threads is None:
            return
    torch.set_num_threads(num_threads)
    logger.info("torch threads: %d%s", num_threads, why)


def _threads_within_cpu_quota() -> tuple[int | None, str]:
    if os.environ.get("OMP_NUM_THREADS"):
        return None, ""  # the user's own count, which torch already took
    quota = cgroup_cpu_quota()
    if quota is None or quota >= torch.get_num_threads():
        return None, ""
    return max(1, math.floor(quota)), f" (the cgroup's CPU quota: {quota:g} CPUs)"

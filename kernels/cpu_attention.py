"""Native CPU paged attention (kernels/cpu/paged_attention.cpp) as the torch op
`torch.ops.pdserve_cpu.paged_attention`, and the choice between it and the torch path.

The op reads K/V in place through the block tables (no per-step gather), batched over
a step's sequences, with GQA, sliding windows, logit soft-capping and fp32/bf16/fp16
caches (fp32 math). It is opaque to torch.compile: a fake implementation gives the
output's shape. The library is compiled on first use (kernels/cpu/build.py); if that
fails, one warning says so and CPU attention stays on the torch path.

PDSERVE_CPU_ATTENTION picks the CPU path: auto (default: native when it builds),
native (fail loudly if it cannot build) or torch.

The library unrolls its loops for head dims 64, 128 and 256 (any other runs the generic
loops). Each costs ~10 s of g++ on a cold start, so an engine names its models' head dims
before the first load (prefer_head_dims) and the build unrolls those alone;
PDSERVE_ATTENTION_HEAD_DIMS (`all`, or e.g. `64,128`) decides instead where set.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Iterable

import torch

from kernels.cpu.build import load_ops

log = logging.getLogger(__name__)

CPU_ATTENTION_MODES = ("auto", "native", "torch")
SPECIALISED_HEAD_DIMS = (64, 128, 256)  # the head dims paged_attention.cpp can unroll its loops for
HEAD_DIMS_ENV = "PDSERVE_ATTENTION_HEAD_DIMS"

# The head dims the engines of this process named before the library loaded, and the dims its
# build unrolls (None until the first load fixes them: one process holds one build).
_head_dims_lock = threading.Lock()
_preferred_head_dims: set[int] = set()
_built_head_dims: tuple[int, ...] | None = None


def _assume_constant_result(fn):
    """torch.compiler.assume_constant_result without its import of torch._dynamo (seconds
    of start-up for every process that imports the kernels, eager ones included): the mark
    is the attribute dynamo reads when it traces a call to fn."""
    fn._dynamo_marked_constant = True
    return fn


def prefer_head_dims(head_dims: Iterable[int]) -> None:
    """The head dims of the models this process serves, named before the library loads so
    that its build unrolls their loops alone. Named after the load, a dim the build lacks
    is logged: its model runs the generic loops (the same function, slower)."""
    dims = {int(d) for d in head_dims}
    with _head_dims_lock:
        if _built_head_dims is None:
            _preferred_head_dims.update(dims)
            return
        missing = sorted(d for d in dims if d in SPECIALISED_HEAD_DIMS and d not in _built_head_dims)
    if missing:
        log.info("native CPU attention was built before head_dim %s was named: those run its generic loops "
                 "(%s=all builds every one)", ", ".join(map(str, missing)), HEAD_DIMS_ENV)


def chosen_head_dims() -> tuple[int, ...]:
    """The head dims the library is (to be) built for: PDSERVE_ATTENTION_HEAD_DIMS where set,
    else the preferred ones, else all; fixed by the first call."""
    global _built_head_dims
    with _head_dims_lock:
        if _built_head_dims is None:
            _built_head_dims = _parse_head_dims(os.environ.get(HEAD_DIMS_ENV, ""), _preferred_head_dims)
        return _built_head_dims


def _parse_head_dims(value: str, preferred: set[int]) -> tuple[int, ...]:
    value = value.strip().lower()
    if value == "all" or (not value and not preferred):
        return SPECIALISED_HEAD_DIMS
    if not value:
        return tuple(d for d in SPECIALISED_HEAD_DIMS if d in preferred)
    try:
        dims = {int(part) for part in value.split(",") if part.strip()}
    except ValueError:
        dims = {-1}
    unknown = sorted(dims - set(SPECIALISED_HEAD_DIMS))
    if unknown:
        raise ValueError(f"{HEAD_DIMS_ENV} must be 'all' or a comma-separated list of "
                         f"{', '.join(map(str, SPECIALISED_HEAD_DIMS))}, got {value!r}")
    return tuple(sorted(dims))


@functools.cache
def native_attention_error() -> str | None:
    """None once the op is loaded in this process, else why it cannot be (built once)."""
    head_dims = chosen_head_dims()
    defines = () if head_dims == SPECIALISED_HEAD_DIMS else (
        "PDSERVE_ATTENTION_HEAD_DIMS_NAMED", *[f"PDSERVE_ATTENTION_HD{d}" for d in head_dims])
    error = load_ops("paged_attention", {"pdserve_cpu::paged_attention": _paged_attention_fake,
                                         "pdserve_cpu::paged_attention_with_kv_write": _with_kv_write_fake,
                                         "pdserve_cpu::layer_attention": _layer_attention_fake}, defines)
    if error is not None:
        log.warning("native CPU paged attention unavailable, using the torch path: %s", error)
    else:
        log.info("native CPU attention: loops unrolled for head_dim %s; others run the generic loops",
                 ", ".join(map(str, torch.ops.pdserve_cpu.specialised_head_dims())) or "none")
    return error


@_assume_constant_result
def native_attention_available() -> bool:
    return native_attention_error() is None


@_assume_constant_result  # torch.compile: decided once while tracing, not traced into
def cpu_attention_backend() -> str:
    """"native" or "torch" for CPU attention calls that do not force a backend."""
    mode = os.environ.get("PDSERVE_CPU_ATTENTION", "auto").lower()
    if mode not in CPU_ATTENTION_MODES:
        raise ValueError(f"PDSERVE_CPU_ATTENTION must be one of {CPU_ATTENTION_MODES}, got {mode!r}")
    if mode == "torch":
        return "torch"
    if mode == "native" and not native_attention_available():
        raise RuntimeError(f"PDSERVE_CPU_ATTENTION=native but the kernel cannot be built: "
                           f"{native_attention_error()}")
    return "native" if native_attention_available() else "torch"


def _paged_attention_fake(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                          sliding_window, logit_softcap):
    return q.new_empty(q.shape)


def _with_kv_write_fake(q, k, v, k_cache, v_cache, slot_mapping, block_tables, query_start_loc, seq_lens, scale,
                        sliding_window, logit_softcap):
    return q.new_empty(q.shape)


def _layer_attention_fake(q, k, v, k_cache, v_cache, scale, layer_idx, sliding_window, logit_softcap):
    return q.new_empty(q.shape)


def publish_step(
    slot_mapping: torch.Tensor | None,  # [num_tokens] int64; None: no step (clears it)
    block_tables: torch.Tensor | None = None,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor | None = None,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor | None = None,  # [num_seqs] int32
) -> None:
    """This thread's step for layer_attention to read from C++ (the native library must be loaded)."""
    torch.ops.pdserve_cpu.set_step(slot_mapping, block_tables, query_start_loc, seq_lens)


def layer_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    scale: float,
    layer_idx: torch.Tensor,  # [] int64 on the CPU: an input of a compiled layer, not a constant
    sliding_window: int | None,
    logit_softcap: float | None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """One layer's attention over the published step, written and attended in C++; the
    Python op pdserve::paged_attention where no step is published."""
    return torch.ops.pdserve_cpu.layer_attention(q, k, v, k_cache, v_cache, scale, layer_idx, sliding_window,
                                                 logit_softcap)


def prefill_attention_native(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim], contiguous; padding rows zero
    return torch.ops.pdserve_cpu.paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                                 float(scale), sliding_window or 0, float(logit_softcap or 0.0))


def decode_attention_native(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32; 0 is padding and yields zeros
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    # Decode is prefill with one query token per sequence.
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32)  # [num_seqs + 1]
    return prefill_attention_native(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                    sliding_window, logit_softcap)


def attention_with_kv_write_native(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], contiguous in head_dim
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], contiguous in head_dim
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0: padding, not written
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    return torch.ops.pdserve_cpu.paged_attention_with_kv_write(
        q, k, v, k_cache, v_cache, slot_mapping, block_tables, query_start_loc, seq_lens, float(scale),
        sliding_window or 0, float(logit_softcap or 0.0))

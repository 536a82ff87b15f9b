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
loops) and has kernels for five (query, cache) dtype pairs: ~10 s of g++ each head dim and
~3-4 s each pair on a cold start. So an engine names its models' head dims and its dtype pair
before the first load (prefer_build) and the build holds those alone; a pair it lacks takes
the torch path (native_attention_serves). PDSERVE_ATTENTION_HEAD_DIMS (`all`, or e.g.
`64,128`) and PDSERVE_ATTENTION_DTYPES (`all`, or e.g. `bfloat16,float32/fp8`) decide instead
where set.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from kernels.cpu.build import load_ops

log = logging.getLogger(__name__)

CPU_ATTENTION_MODES = ("auto", "native", "torch")
SPECIALISED_HEAD_DIMS = (64, 128, 256)  # the head dims paged_attention.cpp can unroll its loops for
HEAD_DIMS_ENV = "PDSERVE_ATTENTION_HEAD_DIMS"
# The (query, cache) dtype pairs it has kernels for, and each one's macro.
DTYPE_PAIRS = {"float32": "F32", "float32/fp8": "F32_FP8", "bfloat16": "BF16", "bfloat16/fp8": "BF16_FP8",
               "float16": "F16"}
DTYPES_ENV = "PDSERVE_ATTENTION_DTYPES"
# The pairs whose kernels paged_attention.cpp compiles in a second translation unit
# (PDSERVE_BUILD_PART 1; the first holds the rest of the library): a build holding any of
# them runs two g++ side by side. Every pair built: ~75 s of one core as one unit, ~42 s of
# wall as two; bf16 alone: 16.8 -> 11.3 s (the Zen 4 EPYC).
SECOND_PART_DTYPE_PAIRS = frozenset({"bfloat16", "bfloat16/fp8", "float16"})
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _assume_constant_result(fn):
    """torch.compiler.assume_constant_result without its import of torch._dynamo (seconds
    of start-up for every process that imports the kernels, eager ones included): the mark
    is the attribute dynamo reads when it traces a call to fn."""
    fn._dynamo_marked_constant = True
    return fn


class BuildChoice(NamedTuple):
    """What a build of the library holds: loops unrolled for these head dims (the rest run
    the generic loops) and kernels for these dtype pairs (the rest go to the torch path)."""
    head_dims: tuple[int, ...]
    dtype_pairs: tuple[str, ...]


ALL = BuildChoice(SPECIALISED_HEAD_DIMS, tuple(DTYPE_PAIRS))

# What the engines of this process named before the library loaded, and the build it
# loaded (None until the first load fixes it: one process holds one build).
_choice_lock = threading.Lock()
_preferred_head_dims: set[int] = set()
_preferred_dtype_pairs: set[str] = set()
_chosen: BuildChoice | None = None


def dtype_pair(dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
    """The pair's name: the query dtype's, with /fp8 for caches of fp8 codes."""
    name = str(dtype).removeprefix("torch.")
    return f"{name}/fp8" if cache_dtype in _FP8_DTYPES else name


def prefer_build(head_dims: Iterable[int], dtype_pairs: Iterable[str]) -> None:
    """The head dims and dtype pairs of the models this process serves, named before the
    library loads so that its build holds those alone. Named after the load, what the build
    lacks is logged: a head dim runs the generic loops, a dtype pair the torch path."""
    head_dims, dtype_pairs = {int(d) for d in head_dims}, set(dtype_pairs)
    with _choice_lock:
        if _chosen is None:
            _preferred_head_dims.update(head_dims)
            _preferred_dtype_pairs.update(dtype_pairs)
            return
        chosen = _chosen
    missing_dims = sorted(d for d in head_dims if d in SPECIALISED_HEAD_DIMS and d not in chosen.head_dims)
    if missing_dims:
        log.info("native CPU attention was built before head_dim %s was named: those run its generic loops "
                 "(%s=all builds every one)", ", ".join(map(str, missing_dims)), HEAD_DIMS_ENV)
    missing_pairs = sorted(pair for pair in dtype_pairs if pair in DTYPE_PAIRS and pair not in chosen.dtype_pairs)
    if missing_pairs:
        log.warning("native CPU attention was built before %s was named: those take the torch path "
                    "(%s=all builds every pair)", ", ".join(missing_pairs), DTYPES_ENV)


def chosen_build() -> BuildChoice:
    """The build the library is (to be) loaded as: PDSERVE_ATTENTION_HEAD_DIMS and
    PDSERVE_ATTENTION_DTYPES where set, else what was preferred, else all; fixed by the first call."""
    global _chosen
    with _choice_lock:
        if _chosen is None:
            _chosen = BuildChoice(
                _parse_choice(HEAD_DIMS_ENV, _preferred_head_dims, SPECIALISED_HEAD_DIMS, int),
                _parse_choice(DTYPES_ENV, _preferred_dtype_pairs, tuple(DTYPE_PAIRS), str))
        return _chosen


def _parse_choice(env: str, preferred: set, known: tuple, parse_item: Callable) -> tuple:
    """env's value (`all`, or a comma-separated list of known items), else the preferred
    items the kernel knows (an empty list where it knows none), else all of them."""
    value = os.environ.get(env, "").strip().lower()
    if value == "all" or (not value and not preferred):
        return known
    if not value:
        return tuple(item for item in known if item in preferred)
    try:
        items = {parse_item(part.strip()) for part in value.split(",") if part.strip()}
    except ValueError:
        items = {None}
    if not items <= set(known):
        raise ValueError(f"{env} must be 'all' or a comma-separated list of {', '.join(map(str, known))}, "
                         f"got {value!r}")
    return tuple(item for item in known if item in items)


def _build_defines(choice: BuildChoice) -> tuple[str, ...]:
    defines = []
    if choice.head_dims != ALL.head_dims:
        defines += ["PDSERVE_ATTENTION_HEAD_DIMS_NAMED", *[f"PDSERVE_ATTENTION_HD{d}" for d in choice.head_dims]]
    if choice.dtype_pairs != ALL.dtype_pairs:
        defines += ["PDSERVE_ATTENTION_DTYPES_NAMED",
                    *[f"PDSERVE_ATTENTION_{DTYPE_PAIRS[p]}" for p in choice.dtype_pairs]]
    return tuple(defines)


@functools.cache
def native_attention_error() -> str | None:
    """None once the op is loaded in this process, else why it cannot be (built once)."""
    choice = chosen_build()
    error = load_ops("paged_attention", {"pdserve_cpu::paged_attention": _paged_attention_fake,
                                         "pdserve_cpu::paged_attention_with_kv_write": _with_kv_write_fake,
                                         "pdserve_cpu::layer_attention": _layer_attention_fake},
                     _build_defines(choice), num_parts=2 if SECOND_PART_DTYPE_PAIRS & set(choice.dtype_pairs) else 1)
    if error is not None:
        log.warning("native CPU paged attention unavailable, using the torch path: %s", error)
    else:
        log.info("native CPU attention: loops unrolled for head_dim %s (others run the generic loops); "
                 "kernels for %s queries (others take the torch path)",
                 ", ".join(map(str, torch.ops.pdserve_cpu.specialised_head_dims())) or "none",
                 ", ".join(loaded_dtype_pairs()) or "no")
    return error


@functools.cache
def loaded_dtype_pairs() -> tuple[str, ...]:
    """The dtype pairs the loaded library has kernels for."""
    return tuple(torch.ops.pdserve_cpu.dtype_pairs())


@_assume_constant_result  # torch.compile: decided once while tracing, not traced into
def native_attention_serves(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the native kernels take queries of dtype over caches of cache_dtype here
    (the library loaded, with that pair)."""
    return native_attention_available() and dtype_pair(dtype, cache_dtype) in loaded_dtype_pairs()


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

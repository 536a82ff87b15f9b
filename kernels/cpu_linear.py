"""Native GEMVs for decode steps (kernels/cpu/gemv.cpp) as the torch ops
`torch.ops.pdserve_gemv.gemv` (a bf16 or fp32 weight), `.q4_1_gemv` and `.q8_0_gemv`
(GGUF's Q4_1 and Q8_0 blocks), and whether this machine has them.

It needs AVX2 and FMA (x86-64-v3: Intel Haswell, AMD Zen and later) and a C++ compiler;
it is built on first use (kernels/cpu/build.py) for this CPU: with AVX512-BF16 (Intel
Cooper Lake / Sapphire Rapids, AMD Zen 4 and later) bf16 weights take bf16 dot products,
elsewhere every product is an fp32 FMA; GGUF blocks take integer dot products with x
quantized per block to int8 (AVX512-VNNI, else AVX2), their rows rearranged at load in
groups of 16 (q4_1_gemv_blocks, q8_0_gemv_blocks). The start-up log names the build.
Without it, one info line says so and linears stay on oneDNN. PDSERVE_CPU_GEMV=0 turns
it off.
"""
from __future__ import annotations

import functools
import logging

import torch

from kernels._backend import switched_off
from kernels.cpu.build import cpu_flags, load_ops
from kernels.huge_pages import empty_on_huge_pages

log = logging.getLogger(__name__)

GEMV_MAX_ROWS = 4  # the op's limit on rows of x (decode tokens of one step)
PANEL_COLS = 32  # out_features must be a multiple of this for a bf16 panel copy
F32_PANEL_COLS = 16  # and of this for an fp32 one
AMX_TILE_K = 32  # where panel_gemm computes on AMX tiles, in_features must be a multiple of this
GEMV_K_MULTIPLE = 32  # in_features must be a multiple of this
# What the GEMV library (and the decode loop, which runs on it) needs of the CPU.
GEMV_CPU_FLAGS = frozenset({"avx2", "fma"})


@functools.cache
def native_gemv_available() -> bool:
    """Whether the GEMVs run here (built and loaded once per process)."""
    if switched_off("PDSERVE_CPU_GEMV"):
        return False
    if not GEMV_CPU_FLAGS <= set(cpu_flags().split()):
        log.info("no AVX2 and FMA on this CPU: decode linears stay on oneDNN and torch's int4 kernel")
        return False
    error = load_ops("gemv", {"pdserve_gemv::gemv": _gemv_fake,
                              "pdserve_gemv::panel_gemm": _panel_gemm_fake,
                              "pdserve_gemv::q4_1_gemv": _blocks_gemv_fake,
                              "pdserve_gemv::q8_0_gemv": _blocks_gemv_fake,
                              "pdserve_gemv::prepacked_linear": _prepacked_linear_fake,
                              "pdserve_gemv::q4_1_linear": _q4_1_linear_fake,
                              "pdserve_gemv::int8_linear": _int8_linear_fake})
    if error is not None:
        log.warning("native GEMV unavailable, decode linears stay on oneDNN and torch's int4 kernel: %s", error)
        return False
    isa = torch.ops.pdserve_gemv.isa()
    if not isa:  # built for an older -march (PDSERVE_CPU_MARCH) than the flags say
        log.info("native GEMV built without AVX2 and FMA: decode linears stay on oneDNN and torch's int4 kernel")
        return False
    log.info("native decode GEMVs: %s", "bf16 dot products (AVX512-BF16)" if isa == "avx512_bf16" else "fp32 FMAs")
    return True


def _gemv_fake(x, bias, weight):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _panel_gemm_fake(x, bias, panels):
    return x.new_empty((x.shape[0], panels.shape[0] * panels.shape[2]))  # bf16 or fp32 panels


def _blocks_gemv_fake(x, bias, blocks):
    return x.new_empty((x.shape[0], blocks.shape[0]))


def _int8_linear_fake(x, codes, scales, q8_0_blocks):
    return x.new_empty((x.shape[0], scales.shape[0]))


def _q4_1_linear_fake(x, packed, scales_and_zeros, blocks, group_size):
    out_features = blocks.shape[0] if blocks is not None else scales_and_zeros.shape[1]
    return x.new_empty((x.shape[0], out_features))


def _prepacked_linear_fake(x, bias, weight_id, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def gemv_applies(weight: torch.Tensor) -> bool:
    """Whether a linear with this weight [out_features, in_features] can take the GEMV."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
            and weight.shape[1] % GEMV_K_MULTIPLE == 0 and native_gemv_available())


def gemv(
    x: torch.Tensor,  # [num_rows <= GEMV_MAX_ROWS, in_features] bf16 or fp32, the weight's dtype
    bias: torch.Tensor | None,  # [out_features], the weight's dtype
    weight: torch.Tensor,  # [out_features, in_features] bf16 or fp32, contiguous
) -> torch.Tensor:  # [num_rows, out_features], the weight's dtype
    return torch.ops.pdserve_gemv.gemv.default(x, bias, weight)


@functools.cache
def panel_gemm_available() -> bool:
    """Whether panel_gemm runs here: the library's AVX512-BF16 build."""
    return native_gemv_available() and torch.ops.pdserve_gemv.isa() == "avx512_bf16"


@functools.cache
def panel_gemm_max_rows() -> int:
    """prepacked_linear's bf16 steps of up to this many rows take panel_gemm where the linear
    has a panel copy: 128 (on AMX tiles where the CPU has them), or 8 on an AMX CPU whose tiles
    panel_gemm may not use (kernels/cpu/gemv.cpp's kMaxPanelRows says why); 0 where panel_gemm
    does not run."""
    return torch.ops.pdserve_gemv.panel_gemm_max_rows() if panel_gemm_available() else 0


@functools.cache
def f32_panel_gemm_max_rows() -> int:
    """prepacked_linear's fp32 steps of up to this many rows take panel_gemm where the linear
    has an fp32 panel copy (kernels/cpu/panel_gemm_fp32.h): 2,048 where the library is built
    for AVX2 without AVX-512, 128 on AVX-512 builds (past them oneDNN is level or ahead;
    kernels/cpu/gemv.cpp's kMaxF32PanelRows), 0 without the native library."""
    return torch.ops.pdserve_gemv.f32_panel_gemm_max_rows() if native_gemv_available() else 0


def panel_rows_limit(dtype: torch.dtype) -> int:
    """The most rows prepacked_linear sends to panels of this dtype (where the linear also has
    a packed weight for oneDNN)."""
    return panel_gemm_max_rows() if dtype == torch.bfloat16 else f32_panel_gemm_max_rows()


@functools.cache
def q8_0_max_rows() -> int:
    """prepacked_linear's steps of up to this many rows take a linear's Q8_0 blocks (a GGUF
    file's head) where it has them: 256 with AVX512-VNNI unless panel_gemm runs on AMX tiles,
    else GEMV_MAX_ROWS (kernels/cpu/gemv.cpp's kMaxQ8_0Rows says why); 0 where the GEMV does
    not run."""
    return torch.ops.pdserve_gemv.q8_0_max_rows() if native_gemv_available() else 0


@functools.cache
def panel_gemm_amx_built() -> bool:
    """Whether the library was built with panel_gemm's AMX tiles (for an AMX CPU's -march;
    PDSERVE_CPU_MARCH may name an older target)."""
    return panel_gemm_available() and bool(torch.ops.pdserve_gemv.panel_gemm_amx_built())


@functools.cache
def panel_gemm_amx_tiles() -> bool:
    """Whether panel_gemm computes on AMX tiles here (kernels/cpu/panel_gemm_amx.h): an AMX
    CPU whose tiles Linux hands the process, unless PDSERVE_AMX_TILES=0."""
    return panel_gemm_available() and bool(torch.ops.pdserve_gemv.panel_gemm_amx_tiles())


@functools.cache
def gguf_prompt_gemm_available() -> bool:
    """Whether bf16 steps past the GEMV's rows over GGUF blocks take the blocks widened to
    bf16 panels (kernels/cpu/gguf_panels.h; AVX512-BF16 and VNNI), so that a bf16 model's
    Q4_1 linears need no torch int4 copy."""
    return native_gemv_available() and bool(torch.ops.pdserve_gemv.gguf_prompt_gemm_built())


@functools.cache
def panels_for_any_rows() -> bool:
    """Whether a linear may keep its panel copy alone (no oneDNN packing), panel_gemm serving
    steps of every size: where panel_gemm runs and the CPU has no AMX (whose tiles
    out-compute it at prefill sizes; kernels/cpu/gemv.cpp's kPanelsForAnyRows)."""
    return panel_gemm_available() and bool(torch.ops.pdserve_gemv.panels_for_any_rows())


def panels_apply(weight: torch.Tensor) -> bool:
    """Whether this weight gets a panel copy for panel_gemm (instead of the GEMV's row-major
    one), unless PDSERVE_PANEL_GEMM is 0 (then steps of 5+ tokens take oneDNN):
    - bf16: out_features a multiple of PANEL_COLS, in_features even, the library's
      AVX512-BF16 build; where panel_gemm computes on AMX tiles, in_features a multiple of 32
      too (a tile step's K): its vector tiles would take such a weight's steps of up to 128
      rows, far behind oneDNN's AMX calls from 12.
    - fp32: out_features a multiple of F32_PANEL_COLS, where f32_panel_gemm_max_rows() > 0
      (AVX2 and FMA)."""
    if weight.dim() != 2 or switched_off("PDSERVE_PANEL_GEMM"):
        return False
    if weight.dtype == torch.float32:
        return weight.shape[0] % F32_PANEL_COLS == 0 and f32_panel_gemm_max_rows() > 0
    return (weight.dtype == torch.bfloat16 and weight.shape[0] % PANEL_COLS == 0
            and weight.shape[1] % 2 == 0 and panel_gemm_available()
            and (weight.shape[1] % AMX_TILE_K == 0 or not panel_gemm_amx_tiles()))


def pack_panels(
    weight: torch.Tensor,  # [out_features, in_features] bf16 or fp32
    huge_pages: bool = False,
) -> torch.Tensor:  # bf16 [out_features // 32, in_features // 2, 32, 2] or fp32 [out_features // 16, in_features, 16]
    """The weight in the column panels panel_gemm reads (kernels/cpu/panel_gemm.h for bf16,
    panel_gemm_fp32.h for fp32); with huge_pages, written straight into huge-page memory
    (kernels/huge_pages.py), as the model keeps them."""
    shape = ()
    if weight.dim() == 2 and weight.dtype == torch.float32:
        shape = (weight.shape[0] // F32_PANEL_COLS, weight.shape[1], F32_PANEL_COLS)
    elif weight.dim() == 2:
        shape = (weight.shape[0] // PANEL_COLS, weight.shape[1] // 2, PANEL_COLS, 2)
    out = empty_on_huge_pages(shape, weight.dtype) if huge_pages and shape else None
    return torch.ops.pdserve_gemv.pack_panels.default(weight, out)


def panel_gemm(
    x: torch.Tensor,  # [num_rows, in_features], the panels' dtype
    bias: torch.Tensor | None,  # [out_features], the panels' dtype
    panels: torch.Tensor,  # pack_panels(weight): bf16 or fp32
) -> torch.Tensor:  # [num_rows, out_features], the panels' dtype
    """x W^T + b as outer products over W's column panels (kernels/cpu/panel_gemm.h,
    panel_gemm_fp32.h): what a bf16 linear's decode steps of 1 to panel_gemm_max_rows() rows
    take (an fp32 one's 1 to f32_panel_gemm_max_rows()), as fast as the GEMV at 1 to 4 rows
    and faster than oneDNN from 5."""
    return torch.ops.pdserve_gemv.panel_gemm.default(x, bias, panels)


def q4_1_gemv(
    x: torch.Tensor,  # [num_rows <= GEMV_MAX_ROWS, in_features] bf16 or fp32
    bias: torch.Tensor | None,  # [out_features], x's dtype
    blocks: torch.Tensor,  # [out_features, in_features // 32 * 20] uint8: q4_1_gemv_blocks(GGUF's Q4_1 rows)
) -> torch.Tensor:  # [num_rows, out_features], x's dtype
    return torch.ops.pdserve_gemv.q4_1_gemv.default(x, bias, blocks)


GGUF_GROUP_ROWS = 16  # rows whose blocks q4_1_gemv and q8_0_gemv read together, one per vector lane


def q4_1_gemv_blocks(
    raw: torch.Tensor,  # [N, K // 32 * 20] uint8: GGUF's Q4_1 rows (per block fp16 d, fp16 m, 16 bytes of nibbles)
) -> torch.Tensor:  # [N, K // 32 * 20] uint8: the same bytes in q4_1_gemv's order
    """GGUF's Q4_1 rows in the order q4_1_gemv reads them (kernels/cpu/gguf_row_groups.h): per
    group of 16 rows (the last holds N % 16) and block, 4 units of one 4-byte word per row
    (unit L, byte t: column 8L + t in the low nibble, 8L + 4 + t in the high one), then the
    rows' d, then their m. A permutation of the file's bytes: nothing is re-quantized."""
    num_rows, row_bytes = raw.shape
    num_blocks = row_bytes // 20
    blocks = raw.reshape(num_rows, num_blocks, 20)
    nibbles = blocks[..., 4:]  # [N, nb, 16]: column j in the low nibble, j + 16 in the high one
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # [N, nb, 32] in column order
    codes = codes.reshape(num_rows, num_blocks, 4, 2, 4)  # [N, nb, unit, low/high, t]
    words = codes[..., 0, :] | (codes[..., 1, :] << 4)  # [N, nb, unit, t]
    return _in_row_groups(raw, [words, blocks[..., 0:2], blocks[..., 2:4]])


def q8_0_gemv_blocks(
    raw: torch.Tensor,  # [N, K // 32 * 34] uint8: GGUF's Q8_0 rows (per block fp16 d, 32 int8 codes)
) -> torch.Tensor:  # [N, K // 32 * 34] uint8: the same bytes in q8_0_gemv's order
    """GGUF's Q8_0 rows in the order q8_0_gemv reads them (kernels/cpu/gguf_row_groups.h):
    per group of 16 rows (the last holds N % 16) and block, 8 units of one 4-byte word per
    row (unit i: the codes of columns 4i .. 4i + 3), then the rows' d."""
    num_rows, row_bytes = raw.shape
    blocks = raw.reshape(num_rows, row_bytes // 34, 34)
    words = blocks[..., 2:].reshape(num_rows, row_bytes // 34, 8, 4)  # [N, nb, unit, t]
    return _in_row_groups(raw, [words, blocks[..., 0:2]])


def _in_row_groups(
    raw: torch.Tensor,  # [N, row_bytes] uint8: the file's rows
    fields: list[torch.Tensor],  # per row and block: [N, nb, num_units, 4] words, then [N, nb, 2] fp16 bytes
) -> torch.Tensor:  # [N, row_bytes] uint8: per group of rows and block, each field of the group's rows in turn
    num_rows, row_bytes = raw.shape
    out = torch.empty_like(raw)
    num_full_rows = num_rows // GGUF_GROUP_ROWS * GGUF_GROUP_ROWS
    # The full groups in one go, then the last, shorter one.
    for start, end, group_rows in ((0, num_full_rows, GGUF_GROUP_ROWS),
                                   (num_full_rows, num_rows, num_rows - num_full_rows)):
        if end == start:
            continue
        group = torch.cat([_per_group_and_block(field[start:end], group_rows) for field in fields], dim=-1)
        out[start:end] = group.reshape(end - start, row_bytes)  # group: [num_groups, nb, group_rows * ...]
    return out


def _per_group_and_block(
    rows: torch.Tensor,  # [num_groups * group_rows, nb, ...] uint8
    group_rows: int,
) -> torch.Tensor:  # [num_groups, nb, group_rows * ...]: each block's bytes of the group's rows, row after row
    """Each block's fields of a group's rows side by side; the 4-byte unit words
    ([N, nb, unit, t]) unit by unit, each unit's rows in order."""
    num_groups, num_blocks = rows.shape[0] // group_rows, rows.shape[1]
    grouped = rows.reshape(num_groups, group_rows, num_blocks, *rows.shape[2:])
    if rows.dim() == 4:  # unit words: [groups, rows, nb, unit, t] -> [groups, nb, unit, rows, t]
        return grouped.permute(0, 2, 3, 1, 4).reshape(num_groups, num_blocks, -1)
    return grouped.transpose(1, 2).reshape(num_groups, num_blocks, -1)


def q8_0_gemv(
    x: torch.Tensor,  # [num_rows <= GEMV_MAX_ROWS, in_features] bf16 or fp32
    bias: torch.Tensor | None,  # [out_features], x's dtype
    blocks: torch.Tensor,  # [out_features, in_features // 32 * 34] uint8: q8_0_gemv_blocks(GGUF's Q8_0 rows)
) -> torch.Tensor:  # [num_rows, out_features], x's dtype
    return torch.ops.pdserve_gemv.q8_0_gemv.default(x, bias, blocks)


def register_prepacked_linear(
    weight_id: int,
    packed: torch.Tensor | None,  # oneDNN's packed weight (mkldnn layout); None: panels serve every step
    row_major: torch.Tensor | None,  # [out_features, in_features] bf16 / fp32 for the GEMV, or None
    q8_0_blocks: torch.Tensor | None = None,  # [out_features, in_features // 32 * 34] uint8: q8_0_gemv_blocks(...)
    panels: torch.Tensor | None = None,  # pack_panels(weight), or None
) -> None:
    """Make `prepacked_linear(x, bias, weight_id, ...)` use this weight (native_gemv_available() only):
    decode rows (1 to GEMV_MAX_ROWS) take the Q8_0 blocks where given, else the row-major
    copy; bf16 steps of up to panel_gemm_max_rows() rows (fp32: f32_panel_gemm_max_rows())
    the panels where given (of any size where there is no packed weight); else oneDNN. The library holds them until
    release_prepacked_linear(weight_id)."""
    torch.ops.pdserve_gemv.register_linear(weight_id, packed, row_major, q8_0_blocks, panels)


def release_prepacked_linear(weight_id: int) -> None:
    torch.ops.pdserve_gemv.release_linear(weight_id)


def prepacked_linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    bias: torch.Tensor | None,  # [out_features]
    weight_id: torch.Tensor,  # [] int64 on the CPU: the id register_prepacked_linear was given
    out_features: int,
) -> torch.Tensor:  # [num_tokens, out_features]
    """x W^T + b for a registered weight, in one native op: a GEMV for 1 to GEMV_MAX_ROWS rows
    where the weight has Q8_0 blocks or its row-major copy, panel_gemm for up to
    panel_gemm_max_rows() bf16 rows where it has panels (AVX512-BF16; on AMX tiles where the
    CPU has them) or f32_panel_gemm_max_rows() fp32 rows, else oneDNN on the
    packed weight.
    The id is a tensor so that a compiled decoder layer takes it as an input and one
    compiled layer serves them all."""
    return torch.ops.pdserve_gemv.prepacked_linear.default(x, bias, weight_id, out_features)


def q4_1_linear(
    x: torch.Tensor,  # [num_tokens, in_features] bf16 or fp32
    packed: torch.Tensor | None,  # torch's int4 pack of the codes (_convert_weight_to_int4pack_for_cpu), or None
    scales_and_zeros: torch.Tensor | None,  # [in_features // group_size, out_features, 2] bf16, or None
    blocks: torch.Tensor | None,  # [out_features, in_features // 32 * 20] uint8: q4_1_gemv_blocks(...), or None
    group_size: int,
) -> torch.Tensor:  # [num_tokens, out_features], x's dtype
    """A Q4_1 linear in one native op: the Q4_1 GEMV for 1 to GEMV_MAX_ROWS rows where the
    blocks are given, the blocks widened to bf16 panels for bf16 prompts (from 12 rows, or
    from 5 where no int4 copy is given), torch's int4 kernel otherwise."""
    return torch.ops.pdserve_gemv.q4_1_linear.default(x, packed, scales_and_zeros, blocks, group_size)


def int8_linear(
    x: torch.Tensor,  # [num_tokens, in_features] bf16 or fp32
    codes: torch.Tensor | None,  # [out_features, in_features] int8, or None (then q8_0_blocks serve every step)
    scales: torch.Tensor,  # [out_features] bf16: the weight is codes * scales
    q8_0_blocks: torch.Tensor | None,  # q8_0_gemv_blocks of the same weight (scales as d), or None
) -> torch.Tensor:  # [num_tokens, out_features], x's dtype
    """An int8 weight-only linear in one native op: the Q8_0 GEMV for 1 to GEMV_MAX_ROWS rows
    where the blocks are given, the blocks widened to bf16 panels for bf16 prompts (from 12
    rows, or from 5 where no codes are given), torch's int8 kernel otherwise."""
    return torch.ops.pdserve_gemv.int8_linear.default(x, codes, scales, q8_0_blocks)
